"""HunyuanVideo-1.5's published checkpoints (480p and 720p; t2v, i2v and the distilled i2v folders), their
configs kept in code for `--plan` (offline, architecture only; the text encoders' too). Each entry maps a
component to (library, class, config.json values)."""

from __future__ import annotations

from typing import Any

# HunyuanVideo-1.5's prompt encoder, the Qwen2.5-VL-7B text model (Qwen2_5_VLTextConfig kwargs: every published
# folder's `text_encoder`, also for benchmarks/collectives.py and table tests).
QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 24]},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128000,
}
# Its glyph encoder (`text_encoder_2`, T5Config kwargs): ByT5-small's encoder with Glyph-SDXL-v2's weights, its
# byte vocabulary (384) grown by 138 colour and 988 font tokens to 1510 (diffusers'
# convert_hunyuan_video1_5_to_diffusers.py adds them from the Glyph-SDXL-v2 assets, then resizes the embedding).
BYT5_GLYPH_ENCODER = {
    "vocab_size": 1510,
    "d_model": 1472,
    "d_kv": 64,
    "d_ff": 3584,
    "num_layers": 12,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
}
# diffusers' HunyuanVideo15Transformer3DModel defaults are the published architecture; t2v at 480p or 720p.
HUNYUANVIDEO15_T2V_TRANSFORMER = {"task_type": "t2v"}


# HunyuanVideo-1.5 image-to-video's image encoder: SigLIP so400m/14 at 384 px (SiglipVisionConfig kwargs), 729
# tokens of width 1152 (the transformer's image_embed_dim).
SIGLIP_SO400M_384 = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 384,
    "patch_size": 14,
}
# Its image processor (`feature_extractor`, SiglipImageProcessor kwargs; the conversion takes FLUX.1-Redux-dev's):
# images resized to the encoder's 384 px; the class's defaults are the rest of SigLIP's preprocessing.
SIGLIP_384_PROCESSOR = {"size": {"height": 384, "width": 384}}
IMAGE_COMPONENTS = {  # image-to-video's
    "image_encoder": ("transformers", "SiglipVisionModel", SIGLIP_SO400M_384),
    "feature_extractor": ("transformers", "SiglipImageProcessor", SIGLIP_384_PROCESSOR),
}


def _hunyuanvideo15(
    target_size: int, shift: float, task: str = "t2v", guidance: float = 6.0, meanflow: bool = False
) -> dict[str, tuple]:
    """A HunyuanVideo-1.5 pipeline; the distilled folders differ in guidance (1: CFG distilled away), shift and,
    for the step-distilled one, a meanflow transformer (diffusers' convert_hunyuan_video1_5_to_diffusers.py)."""
    pipeline = "HunyuanVideo15Pipeline" if task == "t2v" else "HunyuanVideo15ImageToVideoPipeline"
    return {
        "_class_name": ("diffusers", pipeline),
        "text_encoder": ("transformers", "Qwen2_5_VLTextModel", QWEN25_VL_7B_TEXT),
        "text_encoder_2": ("transformers", "T5EncoderModel", BYT5_GLYPH_ENCODER),
        **(IMAGE_COMPONENTS if task == "i2v" else {}),
        "transformer": (
            "diffusers",
            "HunyuanVideo15Transformer3DModel",
            {**HUNYUANVIDEO15_T2V_TRANSFORMER, "target_size": target_size, "task_type": task, "use_meanflow": meanflow},
        ),
        "vae": ("diffusers", "AutoencoderKLHunyuanVideo15", {}),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {"shift": shift}),
        "guider": ("diffusers", "ClassifierFreeGuidance", {"guidance_scale": guidance}),
    }


PUBLISHED: dict[str, dict[str, Any]] = {
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": _hunyuanvideo15(640, 5.0),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v": _hunyuanvideo15(960, 9.0),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v": _hunyuanvideo15(640, 5.0, "i2v"),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v": _hunyuanvideo15(960, 7.0, "i2v"),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v_distilled": _hunyuanvideo15(640, 5.0, "i2v", 1.0),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v_distilled": _hunyuanvideo15(960, 7.0, "i2v", 1.0),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v_step_distilled": _hunyuanvideo15(
        640, 7.0, "i2v", 1.0, meanflow=True
    ),
}
