"""HunyuanVideo-1.5's tiny presets: random components built in code (Qwen2.5-VL and ByT5 text encoders with
tokenizers that need no files, the transformer, the VAE; SigLIP for image-to-video), deterministic per seed."""

from __future__ import annotations

import torch


def tiny_transformer(seed: int = 0, target_size: int = 640, use_meanflow: bool = False) -> torch.nn.Module:
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


def tiny_vae(seed: int = 0) -> torch.nn.Module:
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


def tiny_pipeline(seed: int = 0, image_to_video: bool = False, step_distilled: bool = False):
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
    transformer = tiny_transformer(seed + 2, 48 if image_to_video else 640, use_meanflow=step_distilled)
    vae = tiny_vae(seed + 3)
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
