"""Each jit-safety patch of the CogVideoX transformer is numerically identical to the stock code (eager)."""

import copy

import pytest
import torch

from helpers import relative_error
from tpu_video.models import cogvideox


@pytest.mark.parametrize("version", ["1.5", "1.0"])
@pytest.mark.parametrize("batch", [1, 2])
def test_cat_rotary_processor_equals_stock_processor_in_eager_pytorch(version, batch):
    stock = cogvideox.presets.tiny_pipeline(version).transformer.eval()
    patched = cogvideox.transformer.make_jit_safe(copy.deepcopy(stock))
    generator = torch.Generator().manual_seed(batch)
    hidden_states = torch.randn(batch, 4 if version == "1.5" else 3, 4, 8, 12, generator=generator)
    prompt_embeds = torch.randn(batch, 32, 32, generator=generator)
    rotary = None
    if version == "1.5":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        rotary = get_3d_rotary_pos_embed(16, None, (4, 6), temporal_size=2, grid_type="slice", max_size=(4, 6))
    kwargs = dict(timestep=torch.tensor([500] * batch), image_rotary_emb=rotary, return_dict=False)
    with torch.no_grad():
        expected = stock(hidden_states=hidden_states, encoder_hidden_states=prompt_embeds, **kwargs)[0]
        actual = patched(hidden_states=hidden_states, encoder_hidden_states=prompt_embeds, **kwargs)[0]
    assert type(patched.transformer_blocks[0].attn1.processor).__name__ == "CatRotaryCogVideoXAttnProcessor"
    assert relative_error(actual, expected) <= 1e-6  # same ops in the same order: only ulp-level noise
