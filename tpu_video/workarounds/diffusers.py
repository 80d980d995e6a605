"""diffusers 0.42.1: what its cache hooks lack for HunyuanVideo-1.5.

The family patches that make diffusers' modules traceable under jit (HunyuanVideo-1.5's forward and VAE
mask, CogVideoX's rotary write) stay in the family's module, one place per family, each with a test
against the stock module in eager PyTorch; docs/workarounds.md lists them with the rest.
"""

from __future__ import annotations


def register_hunyuanvideo15_block() -> None:
    """Put HunyuanVideo15TransformerBlock in diffusers' transformer-block registry, as diffusers registers
    its siblings (the block returns hidden_states, encoder_hidden_states).

    diffusers 0.42.1 leaves it out, so `transformer.enable_cache(MagCacheConfig(...))` raises `Model class
    ...HunyuanVideo15TransformerBlock not registered`, and our step cache reads the same metadata.
    tests/test_upstream_bugs.py fails once diffusers registers it itself: then delete this and its two calls,
    in tpu_video/engine/cached_blocks.py (the step cache) and tpu_video/engine/scanned_blocks.py (the block scan).
    """
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    metadata = TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
    TransformerBlockRegistry.register(model_class=HunyuanVideo15TransformerBlock, metadata=metadata)
