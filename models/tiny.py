"""Tiny random components for every family, built in code: fixed seeds, tokenizers that need no files.

The presets (`--model tiny-cogvideox`, ...) and the tests run the real pipelines on these (diffusers'
own pipeline tests use the same habit: one or two layers, head dim 8).
"""

from __future__ import annotations

import torch

# CogVideoX -----------------------------------------------------------------------------------------


def cogvideox_tokenizer():
    """A T5 (Unigram) tokenizer built in code: special tokens, a few words and single characters."""
    from transformers import T5Tokenizer

    words = [
        "a",
        "the",
        "of",
        "and",
        "in",
        "on",
        "with",
        "is",
        "playing",
        "panda",
        "guitar",
        "forest",
        "cat",
        "dog",
        "video",
        "red",
        "blue",
    ]
    characters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + word, -1.0) for word in words] + [(char, -3.0) for char in characters]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def t5_encoder_kwargs(tokenizer) -> dict:
    """The tiny T5 / UMT5 encoder of the CogVideoX and Wan presets: 2 layers, 4 heads x 8."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def cogvideox(version: str, seed: int = 0, num_layers: int = 2, image_to_video: bool = False):
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

    tokenizer = cogvideox_tokenizer()
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
    # The real checkpoints' scheduler settings: 1.5 and 5b use DPM, 2b uses DDIM.
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
        snr_shift_scale=1.0,
    )
    if image_to_video and version == "1.5":
        vae.register_to_config(invert_scale_latents=True)  # as the CogVideoX 1.5 VAE folders say
    pipeline = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    components = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}
    return pipeline(transformer=transformer, **components)


# HunyuanVideo-1.5 ----------------------------------------------------------------------------------


def hunyuanvideo15_transformer(seed: int = 0, target_size: int = 640, use_meanflow: bool = False) -> torch.nn.Module:
    """A random tiny HunyuanVideo15Transformer3DModel: 8 heads x 8, 2 blocks, 1 refiner block. `target_size`
    is the pixel size the image-to-video pipeline picks its size bucket around; `use_meanflow` adds the
    step-distilled checkpoints' second timestep embedding."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=8,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=1,
        text_embed_dim=16,
        text_embed_2_dim=8,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        task_type="t2v",
        target_size=target_size,
        use_meanflow=use_meanflow,
    ).eval()


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer built in code (every byte a token, no merges) with Qwen's chat format."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def hunyuanvideo15_vae(seed: int = 0) -> torch.nn.Module:
    """A random tiny AutoencoderKLHunyuanVideo15: 4 latent channels, 8x spatial and 4x temporal compression."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()


def hunyuanvideo15(seed: int = 0, image_to_video: bool = False, step_distilled: bool = False):
    """Random tiny HunyuanVideo-1.5 components, deterministic per seed. `image_to_video`:
    HunyuanVideo15ImageToVideoPipeline with a tiny SigLIP image encoder (16 tokens of width 12) and size
    buckets around 48 pixels. `step_distilled`: what the 480p_i2v_step_distilled folder changes (a meanflow
    transformer, shift 7, guidance 1)."""
    from diffusers import (
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer = qwen_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,  # the pipeline reads hidden state -3
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
            max_position_embeddings=2048,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.pad_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    tokenizer_2 = ByT5Tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=8,
            d_kv=4,
            d_ff=16,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
        )
    )
    transformer = hunyuanvideo15_transformer(seed + 2, 48 if image_to_video else 640, use_meanflow=step_distilled)
    vae = hunyuanvideo15_vae(seed + 3)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0 if step_distilled else 5.0)
    guider = ClassifierFreeGuidance(guidance_scale=1.0 if step_distilled else 6.0)
    components = {"text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": transformer, "vae": vae}
    components |= {
        "scheduler": scheduler,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "guider": guider,
    }
    if not image_to_video:
        return HunyuanVideo15Pipeline(**components)
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed + 4)
    sizes = {"hidden_size": 12, "intermediate_size": 16, "image_size": 32, "patch_size": 8}
    image_encoder = SiglipVisionModel(SiglipVisionConfig(num_hidden_layers=1, num_attention_heads=2, **sizes)).eval()
    feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideoPipeline(
        **components, image_encoder=image_encoder, feature_extractor=feature_extractor
    )


# Wan 2.1 / 2.2 ------------------------------------------------------------------------------------


def wan_transformer(seed: int = 0, **image_to_video) -> torch.nn.Module:
    """A random tiny WanTransformer3DModel: 8 heads x 16 (divisible by every tp of 8 devices), 2 blocks.
    `image_to_video`: in_channels 36 (noise, mask, image latents), and for Wan 2.1 the image embedder."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=16,
        in_channels=image_to_video.pop("in_channels", 16),
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **image_to_video,
    ).eval()


def wan(version: str, seed: int = 0):
    """Random tiny Wan components, deterministic per seed. "2.2" adds a second expert and a boundary
    (0.875, the A14B value) that the tiny presets' schedules cross mid-way."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = cogvideox_tokenizer()  # a T5 tokenizer, as Wan's UMT5 one is
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
        transformer=wan_transformer(seed + 2),
        transformer_2=wan_transformer(seed + 3) if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,
    )


def wan_ti2v(seed: int = 0):
    """WanPipeline with expand_timesteps (Wan 2.2 TI2V-5B's layout): the tiny transformer on a tiny Wan 2.2
    VAE (residual blocks, 2x2 patchified pixels, 16x spatial compression; 16 latent channels here, 48 in the
    real one), UniPC at shift 5 as the published folder has it."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    base = wan("2.1", seed)
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


def wan_i2v(version: str, seed: int = 0):
    """WanImageToVideoPipeline with the tiny Wan components. "2.1": one transformer with an image embedder
    fed by a tiny CLIP vision encoder; "2.2": two experts (boundary 0.9, the A14B value) and no image encoder."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = wan("2.1", seed)
    image_encoder = image_processor = None
    extra = {}
    if version == "2.1":
        torch.manual_seed(seed + 4)
        sizes = {"hidden_size": 16, "intermediate_size": 32, "image_size": 32, "patch_size": 8}
        config = CLIPVisionConfig(num_hidden_layers=2, num_attention_heads=2, **sizes)
        image_encoder = CLIPVisionModel(config).eval()
        image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        extra = {"image_dim": 16, "added_kv_proj_dim": 128}
    two_experts = version == "2.2"
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=wan_transformer(seed + 2, in_channels=WAN_I2V_CHANNELS, **extra),
        transformer_2=wan_transformer(seed + 3, in_channels=WAN_I2V_CHANNELS) if two_experts else None,
        boundary_ratio=0.9 if two_experts else None,
    )
