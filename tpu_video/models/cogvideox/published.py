"""CogVideoX's published checkpoints, their configs kept in code: `--plan` needs the architecture only, so
these hub ids plan offline; benchmarks and table tests build real-width modules from them. Each entry maps
a component to (library, class, the config.json values that shape the compiled program)."""

from __future__ import annotations

from typing import Any

# CogVideoX1.5-5B's published transformer config (for benchmarks and table tests; weights never needed).
COGVIDEOX15_5B_TRANSFORMER = {
    "num_attention_heads": 48,
    "attention_head_dim": 64,
    "in_channels": 16,
    "out_channels": 16,
    "time_embed_dim": 512,
    "text_embed_dim": 4096,
    "num_layers": 42,
    "sample_width": 300,
    "sample_height": 300,
    "sample_frames": 81,
    "patch_size": 2,
    "patch_size_t": 2,
    "patch_bias": False,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "use_rotary_positional_embeddings": True,
}

# CogVideoX's text encoder, T5 v1.1 XXL (T5Config kwargs: every published CogVideoX folder's `text_encoder`,
# also for benchmarks/collectives.py and table tests).
T5_XXL_ENCODER = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
}

COGVIDEOX_5B_TRANSFORMER = {  # THUDM/CogVideoX-5b
    **COGVIDEOX15_5B_TRANSFORMER,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "patch_size_t": None,
    "patch_bias": True,
}
COGVIDEOX_2B_TRANSFORMER = {  # THUDM/CogVideoX-2b
    **COGVIDEOX_5B_TRANSFORMER,
    "num_attention_heads": 30,
    "num_layers": 30,
    "use_rotary_positional_embeddings": False,
}
COGVIDEOX_VAE = {"block_out_channels": [128, 256, 256, 512], "latent_channels": 16, "temporal_compression_ratio": 4}
COGVIDEOX_SCHEDULER = {
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "timestep_spacing": "trailing",
    "clip_sample": False,
    "set_alpha_to_one": True,
}
# The image-to-video transformers take the image latents on channels (2 x 16 in); CogVideoX-5b-I2V learned
# its positional embeddings (one size: 480x720x49), CogVideoX1.5-5B-I2V adds an ofs embedding.
COGVIDEOX_5B_I2V_TRANSFORMER = {
    **COGVIDEOX_5B_TRANSFORMER,
    "in_channels": 32,
    "use_learned_positional_embeddings": True,
}
COGVIDEOX15_5B_I2V_TRANSFORMER = {**COGVIDEOX15_5B_TRANSFORMER, "in_channels": 32, "ofs_embed_dim": 512}


def _cogvideox(
    transformer: dict[str, Any],
    scheduler: str,
    scaling_factor: float,
    pipeline: str = "CogVideoXPipeline",
    snr_shift_scale: float = 1.0,
    **vae,
) -> dict[str, tuple]:
    return {
        "_class_name": ("diffusers", pipeline),
        "text_encoder": ("transformers", "T5EncoderModel", T5_XXL_ENCODER),
        "transformer": ("diffusers", "CogVideoXTransformer3DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLCogVideoX", {**COGVIDEOX_VAE, "scaling_factor": scaling_factor, **vae}),
        "scheduler": ("diffusers", scheduler, {**COGVIDEOX_SCHEDULER, "snr_shift_scale": snr_shift_scale}),
    }


PUBLISHED: dict[str, dict[str, Any]] = {
    "zai-org/CogVideoX1.5-5B": _cogvideox(COGVIDEOX15_5B_TRANSFORMER, "CogVideoXDPMScheduler", 0.7),
    "THUDM/CogVideoX-5b": _cogvideox(COGVIDEOX_5B_TRANSFORMER, "CogVideoXDPMScheduler", 0.7),
    "THUDM/CogVideoX-2b": _cogvideox(
        COGVIDEOX_2B_TRANSFORMER, "CogVideoXDDIMScheduler", 1.15258426, snr_shift_scale=3.0
    ),
    "THUDM/CogVideoX-5b-I2V": _cogvideox(
        COGVIDEOX_5B_I2V_TRANSFORMER, "CogVideoXDPMScheduler", 0.7, "CogVideoXImageToVideoPipeline"
    ),
    "zai-org/CogVideoX1.5-5B-I2V": _cogvideox(
        COGVIDEOX15_5B_I2V_TRANSFORMER,
        "CogVideoXDPMScheduler",
        0.7,
        "CogVideoXImageToVideoPipeline",
        invert_scale_latents=True,  # the 1.5 VAE folders say so; only the image latents' scaling reads it
    ),
}
