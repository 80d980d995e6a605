"""CogVideoX's tiny presets: random components built in code (as diffusers' own pipeline tests build
them), deterministic per seed, saved and loaded through `from_pretrained` like a real checkpoint."""

from __future__ import annotations

import torch

from ..tiny import t5_encoder_kwargs, t5_tokenizer


def tiny_pipeline(version: str, seed: int = 0, num_layers: int = 2, image_to_video: bool = False):
    """Random tiny CogVideoX components (as in diffusers' own pipeline tests), deterministic per seed.
    `image_to_video`: CogVideoXImageToVideoPipeline, the transformer taking image latents on channels (1.5:
    with an ofs embedding, as 1.5-5B-I2V; 1.0: learned positional embeddings, as 5b-I2V)."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXDPMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(**t5_encoder_kwargs(tokenizer)))
    torch.manual_seed(seed + 1)
    version_kwargs = (
        {"patch_size_t": 2, "patch_bias": False, "use_rotary_positional_embeddings": True}
        if version == "1.5"
        else {"patch_size_t": None, "use_rotary_positional_embeddings": False}
    )
    if image_to_video:
        version_kwargs |= {"ofs_embed_dim": 8} if version == "1.5" else {"use_rotary_positional_embeddings": True}
        version_kwargs |= {} if version == "1.5" else {"use_learned_positional_embeddings": True}
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=8,  # divisible by every tp of an 8-device mesh
        attention_head_dim=16,
        in_channels=8 if image_to_video else 4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=32,
        num_layers=num_layers,
        sample_width=12,
        sample_height=8,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=32,
        **version_kwargs,
    )
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        scaling_factor=0.7,
    )
    # The real checkpoints' scheduler settings: 1.5 and 5b use DPM, 2b uses DDIM and shifts the SNR by 3.
    scheduler_cls = CogVideoXDPMScheduler if version == "1.5" else CogVideoXDDIMScheduler
    scheduler = scheduler_cls(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        clip_sample=False,
        set_alpha_to_one=True,
        snr_shift_scale=3.0 if version == "1.0" and not image_to_video else 1.0,  # CogVideoX-2b's 3.0, the 5b's 1.0
    )
    if image_to_video and version == "1.5":
        vae.register_to_config(invert_scale_latents=True)  # as the CogVideoX 1.5 VAE folders say
    pipeline = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    components = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}
    return pipeline(transformer=transformer, **components)
