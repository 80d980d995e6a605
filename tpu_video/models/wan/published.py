"""Wan's published checkpoints (2.1 T2V 1.3B and 14B, 2.1 I2V 480p/720p, 2.2 T2V and I2V A14B, 2.2
TI2V-5B, 2.1 VACE 1.3B and 14B, 2.2 Animate 14B), their configs kept in code for `--plan` (offline,
architecture only). Each entry maps a component to (library, class, config.json values); pipeline-level
values (boundary_ratio, expand_timesteps) as they are."""

from __future__ import annotations

from typing import Any

# Wan 2.1 T2V 14B's transformer (Wan 2.2 T2V A14B's two experts have the same architecture).
WAN_14B_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
WAN_13B_TRANSFORMER = {**WAN_14B_TRANSFORMER, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
# Every Wan folder's text encoder, UMT5-XXL (UMT5Config kwargs): T5 v1.1 XXL's shape with a 256,384-token
# vocabulary.
UMT5_XXL_ENCODER = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
}
# UniPC with flow sigmas, as the Diffusers folders ship it. The flow shift recorded here (3.0, the 480p
# value) only sets the default --flow_shift; it does not change a plan.
WAN_SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}


# Wan 2.1 I2V 14B (480P and 720P): the T2V 14B blocks with image keys/values in cross-attention (CLIP
# ViT-H/14 tokens lifted to the width by an image embedder) and 36 input channels (noise, mask, image latents).
WAN_I2V_14B_TRANSFORMER = {**WAN_14B_TRANSFORMER, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# Wan 2.2 I2V A14B's two experts: 36 input channels, no image embedder.
WAN22_I2V_TRANSFORMER = {**WAN_14B_TRANSFORMER, "in_channels": 36}
# Wan 2.2 Animate 14B: the I2V 14B's blocks (with CLIP image keys and values) and 36 input channels (noise, and
# the character's and the condition frames' latents behind their masks), a pose patch embedding, a motion encoder
# over 512-pixel face frames and a face adapter after every fifth block (its diffusers config.json).
WAN_ANIMATE_14B_TRANSFORMER = {
    **WAN_I2V_14B_TRANSFORMER,
    "latent_channels": 16,
    "motion_encoder_size": 512,
    "motion_style_dim": 512,
    "motion_dim": 20,
    "motion_encoder_dim": 512,
    "face_encoder_hidden_dim": 1024,
    "face_encoder_num_heads": 4,
    "inject_face_latents_blocks": 5,
    "motion_encoder_batch_size": 8,
}
# OpenCLIP ViT-H/14, Wan 2.1 I2V's image encoder (CLIPVisionConfig kwargs): 257 tokens of width 1280.
CLIP_VIT_H_14 = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",
}
# Its image processor (CLIPImageProcessor kwargs): 224-pixel crops, which make the encoder's 257 tokens; the mean
# and std of CLIP's training images, the values every CLIP ViT processor carries (a plan depends only on the size).
CLIP_IMAGE_PROCESSOR = {
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


# Wan 2.2 TI2V-5B: 24 heads x 128, 30 blocks, on the 48-channel Wan 2.2 VAE (residual blocks, 2x2
# patchified pixels, 16x16 spatial compression); the pipeline gives every video token its own timestep.
WAN_TI2V_5B_TRANSFORMER = {
    **WAN_14B_TRANSFORMER,
    "num_attention_heads": 24,
    "ffn_dim": 14336,
    "num_layers": 30,
    "in_channels": 48,
    "out_channels": 48,
}
WAN22_VAE = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    # the published vae/config.json's per-channel statistics
    "latents_mean": [
        -0.2289,
        -0.0052,
        -0.1323,
        -0.2339,
        -0.2799,
        0.0174,
        0.1838,
        0.1557,
        -0.1382,
        0.0542,
        0.2813,
        0.0891,
        0.157,
        -0.0098,
        0.0375,
        -0.1825,
        -0.2246,
        -0.1207,
        -0.0698,
        0.5109,
        0.2665,
        -0.2108,
        -0.2158,
        0.2502,
        -0.2055,
        -0.0322,
        0.1109,
        0.1567,
        -0.0729,
        0.0899,
        -0.2799,
        -0.123,
        -0.0313,
        -0.1649,
        0.0117,
        0.0723,
        -0.2839,
        -0.2083,
        -0.052,
        0.3748,
        0.0152,
        0.1957,
        0.1433,
        -0.2944,
        0.3573,
        -0.0548,
        -0.1681,
        -0.0667,
    ],  # fmt: skip
    "latents_std": [
        0.4765,
        1.0364,
        0.4514,
        1.1677,
        0.5313,
        0.499,
        0.4818,
        0.5013,
        0.8158,
        1.0344,
        0.5894,
        1.0901,
        0.6885,
        0.6165,
        0.8454,
        0.4978,
        0.5759,
        0.3523,
        0.7135,
        0.6804,
        0.5833,
        1.4146,
        0.8986,
        0.5659,
        0.7069,
        0.5338,
        0.4889,
        0.4917,
        0.4069,
        0.4999,
        0.6866,
        0.4093,
        0.5709,
        0.6065,
        0.6415,
        0.4944,
        0.5726,
        1.2042,
        0.5458,
        1.6887,
        0.3971,
        1.06,
        0.3943,
        0.5537,
        0.5444,
        0.4089,
        0.7468,
        0.7744,
    ],  # fmt: skip
}


def _wan_ti2v() -> dict[str, Any]:
    """Wan 2.2 TI2V-5B: a WanPipeline with expand_timesteps (image-to-video through the same folder)."""
    return {
        **_wan(WAN_TI2V_5B_TRANSFORMER),
        "vae": ("diffusers", "AutoencoderKLWan", WAN22_VAE),
        "scheduler": ("diffusers", "UniPCMultistepScheduler", {**WAN_SCHEDULER, "flow_shift": 5.0}),
        "expand_timesteps": True,
    }


def _wan_i2v(transformer: dict[str, Any], shift: float, boundary_ratio: float | None = None) -> dict[str, Any]:
    """A WanImageToVideoPipeline: Wan 2.1's with its CLIP image encoder, or Wan 2.2's two experts without one."""
    pipeline = {
        **_wan(transformer, boundary_ratio),
        "_class_name": ("diffusers", "WanImageToVideoPipeline"),
        "scheduler": ("diffusers", "UniPCMultistepScheduler", {**WAN_SCHEDULER, "flow_shift": shift}),
    }
    if "image_dim" in transformer:
        pipeline["image_encoder"] = ("transformers", "CLIPVisionModel", CLIP_VIT_H_14)
        pipeline["image_processor"] = ("transformers", "CLIPImageProcessor", CLIP_IMAGE_PROCESSOR)
    return pipeline


def _wan_vace(transformer: dict[str, Any], vace_layers: list[int]) -> dict[str, Any]:
    """A WanVACEPipeline: the T2V transformer with VACE blocks feeding `vace_layers` (diffusers' conversion
    script's configs: 96 control channels, 16 + 16 latent channels and 64 mask pixels per latent)."""
    vace = {**transformer, "vace_layers": vace_layers, "vace_in_channels": 96}
    return {
        **_wan(transformer),
        "_class_name": ("diffusers", "WanVACEPipeline"),
        "transformer": ("diffusers", "WanVACETransformer3DModel", vace),
    }


def _wan_animate() -> dict[str, Any]:
    """A WanAnimatePipeline: the Animate transformer and the I2V models' CLIP image encoder. The scheduler's flow
    shift (here the T2V folders' 3.0) only sets the default --flow_shift; a plan does not depend on it."""
    return {
        **_wan(WAN_ANIMATE_14B_TRANSFORMER),
        "_class_name": ("diffusers", "WanAnimatePipeline"),
        "transformer": ("diffusers", "WanAnimateTransformer3DModel", WAN_ANIMATE_14B_TRANSFORMER),
        "image_encoder": ("transformers", "CLIPVisionModel", CLIP_VIT_H_14),
        "image_processor": ("transformers", "CLIPImageProcessor", CLIP_IMAGE_PROCESSOR),
    }


def _wan(transformer: dict[str, Any], boundary_ratio: float | None = None) -> dict[str, Any]:
    """A Wan T2V pipeline; with `boundary_ratio`, Wan 2.2's two experts (pipeline-level config keys are
    plain values, components are (library, class, config) tuples)."""
    pipeline: dict[str, Any] = {
        "_class_name": ("diffusers", "WanPipeline"),
        "text_encoder": ("transformers", "UMT5EncoderModel", UMT5_XXL_ENCODER),
        "transformer": ("diffusers", "WanTransformer3DModel", transformer),
        "vae": ("diffusers", "AutoencoderKLWan", {}),  # the class defaults are the Wan 2.1 VAE
        "scheduler": ("diffusers", "UniPCMultistepScheduler", WAN_SCHEDULER),
    }
    if boundary_ratio is not None:
        pipeline["transformer_2"] = ("diffusers", "WanTransformer3DModel", transformer)
        pipeline["boundary_ratio"] = boundary_ratio
    return pipeline


PUBLISHED: dict[str, dict[str, Any]] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": _wan(WAN_13B_TRANSFORMER),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": _wan(WAN_14B_TRANSFORMER),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": _wan(WAN_14B_TRANSFORMER, boundary_ratio=0.875),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": _wan_i2v(WAN_I2V_14B_TRANSFORMER, 3.0),
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": _wan_i2v(WAN_I2V_14B_TRANSFORMER, 5.0),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": _wan_i2v(WAN22_I2V_TRANSFORMER, 5.0, boundary_ratio=0.9),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": _wan_ti2v(),
    "Wan-AI/Wan2.1-VACE-1.3B-diffusers": _wan_vace(WAN_13B_TRANSFORMER, list(range(0, 30, 2))),
    "Wan-AI/Wan2.1-VACE-14B-diffusers": _wan_vace(WAN_14B_TRANSFORMER, list(range(0, 40, 5))),
    "Wan-AI/Wan2.2-Animate-14B-Diffusers": _wan_animate(),
}
