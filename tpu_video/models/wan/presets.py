"""Wan's tiny presets: random components built in code (UMT5 with a T5 tokenizer, the transformer, the Wan
2.1 or 2.2 VAE; CLIP for 2.1 image-to-video), deterministic per seed, for every variant the family runs."""

from __future__ import annotations

import torch

from ..tiny import t5_encoder_kwargs, t5_tokenizer


def tiny_animate_transformer(seed: int = 0) -> torch.nn.Module:
    """A random tiny WanAnimateTransformer3DModel: tiny_transformer's blocks with 36 input channels (noise, and
    the reference and previous-segment latents with their masks) and an image embedder (the tiny CLIP's width),
    a 16-pixel motion encoder (two residual blocks), a face encoder and a face adapter after blocks 0 and 2 (of
    4)."""
    animate = {
        "in_channels": 36,
        "latent_channels": 16,
        "image_dim": 16,
        "motion_encoder_channel_sizes": {"4": 16, "8": 16, "16": 16},
        "motion_encoder_size": 16,
        "motion_style_dim": 8,
        "motion_dim": 4,
        "motion_encoder_dim": 16,
        "face_encoder_hidden_dim": 16,
        "face_encoder_num_heads": 2,
        "inject_face_latents_blocks": 2,
    }
    return tiny_transformer(seed, "WanAnimateTransformer3DModel", num_layers=4, **animate).eval()


def tiny_transformer(
    seed: int = 0, cls: str = "WanTransformer3DModel", num_layers: int = 2, **image_to_video
) -> torch.nn.Module:
    """A random tiny WanTransformer3DModel (or `cls`, e.g. the VACE one): 8 heads x 16 (divisible by every tp
    of 8 devices), 2 blocks. `image_to_video`: in_channels 36 (noise, mask, image latents), and for Wan 2.1
    the image embedder; or the VACE layers."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, cls)(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=16,
        in_channels=image_to_video.pop("in_channels", 16),
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **image_to_video,
    ).eval()


def tiny_pipeline(version: str, seed: int = 0):
    """Random tiny Wan components, deterministic per seed. "2.2" adds a second expert and a boundary
    (0.875, the A14B value) that the tiny presets' schedules cross mid-way."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer()  # a T5 tokenizer, as Wan's UMT5 one is
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(**t5_encoder_kwargs(tokenizer)))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    # The published Wan folders' scheduler: UniPC with flow sigmas.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    two_experts = version == "2.2"
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=tiny_transformer(seed + 2),
        transformer_2=tiny_transformer(seed + 3) if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,
    )


def tiny_ti2v_pipeline(seed: int = 0):
    """WanPipeline with expand_timesteps (Wan 2.2 TI2V-5B's layout): the tiny transformer on a tiny Wan 2.2
    VAE (residual blocks, 2x2 patchified pixels, 16x spatial compression; 16 latent channels here, 48 in the
    real one), UniPC at shift 5 as the published folder has it."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    base = tiny_pipeline("2.1", seed)
    torch.manual_seed(seed + 5)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=torch.linspace(-0.3, 0.3, 16).tolist(),
        latents_std=torch.linspace(0.4, 1.6, 16).tolist(),
    ).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=5.0
    )
    components = {"tokenizer": base.tokenizer, "text_encoder": base.text_encoder, "transformer": base.transformer}
    return WanPipeline(**components, vae=vae, scheduler=scheduler, expand_timesteps=True)


WAN_I2V_CHANNELS = 16 + 4 + 16  # noise latents, the first-frame mask (4 frames per latent frame), image latents


def tiny_clip(seed: int):
    """A tiny CLIP vision encoder (width 16, 32-pixel images of 8-pixel patches) and its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    sizes = {"hidden_size": 16, "intermediate_size": 32, "image_size": 32, "patch_size": 8}
    config = CLIPVisionConfig(num_hidden_layers=2, num_attention_heads=2, **sizes)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return CLIPVisionModel(config).eval(), processor


def tiny_i2v_pipeline(version: str, seed: int = 0):
    """WanImageToVideoPipeline with the tiny Wan components. "2.1": one transformer with an image embedder
    fed by a tiny CLIP vision encoder; "2.2": two experts (boundary 0.9, the A14B value) and no image encoder."""
    from diffusers import WanImageToVideoPipeline

    base = tiny_pipeline("2.1", seed)
    image_encoder = image_processor = None
    extra = {}
    if version == "2.1":
        image_encoder, image_processor = tiny_clip(seed + 4)
        extra = {"image_dim": 16, "added_kv_proj_dim": 128}
    two_experts = version == "2.2"
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=tiny_transformer(seed + 2, in_channels=WAN_I2V_CHANNELS, **extra),
        transformer_2=tiny_transformer(seed + 3, in_channels=WAN_I2V_CHANNELS) if two_experts else None,
        boundary_ratio=0.9 if two_experts else None,
    )


# VACE's control channels: the kept and redrawn parts' latents (16 each) and the 8 x 8 mask pixels per latent.
WAN_VACE_CHANNELS = 16 + 16 + 8 * 8


def tiny_vace_pipeline(seed: int = 0):
    """WanVACEPipeline with the tiny Wan components and a VACE transformer of 3 blocks whose 2 VACE blocks feed
    blocks 0 and 2 (a layer index apart from its VACE block's, as in the published ones: the 1.3B's 15 feed
    every other of 30 blocks)."""
    from diffusers import WanVACEPipeline

    base = tiny_pipeline("2.1", seed)
    transformer = tiny_transformer(
        seed + 6, "WanVACETransformer3DModel", 3, vace_layers=[0, 2], vace_in_channels=WAN_VACE_CHANNELS
    )
    components = {key: getattr(base, key) for key in ("tokenizer", "text_encoder", "vae", "scheduler")}
    return WanVACEPipeline(**components, transformer=transformer)


def tiny_animate_pipeline(seed: int = 0):
    """WanAnimatePipeline with the tiny Wan components, the tiny CLIP and tiny_animate_transformer."""
    from diffusers import WanAnimatePipeline

    base = tiny_pipeline("2.1", seed)
    image_encoder, image_processor = tiny_clip(seed + 4)
    components = {key: getattr(base, key) for key in ("tokenizer", "text_encoder", "vae", "scheduler")}
    transformer = tiny_animate_transformer(seed + 7)
    return WanAnimatePipeline(
        **components, image_encoder=image_encoder, image_processor=image_processor, transformer=transformer
    )
