"""The tiny LTX-2 presets' text side, built in code: a Gemma tokenizer that needs no files, the random Gemma 3 or 4
text encoders, and the prompt enhancer's Gemma 3 processor (a chat template, image tokens)."""

from __future__ import annotations

import torch


def gemma_tokenizer():
    """A Gemma tokenizer built in code: Gemma's special tokens and single characters (no merges)."""
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for token in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"):
        vocab[token] = len(vocab)
    for char in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()":
        vocab[char] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[])


# The prompt enhancer's chat template, reduced to the roles and the image marker (Gemma's own is a Jinja file in
# the published processor folders), in characters the tiny vocabulary holds.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ boi_token }}{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}. {% endfor %}{% if add_generation_prompt %}model: {% endif %}"
)


def tiny_processor():
    """Gemma 3's processor for the prompt enhancer (the pipelines' `processor`): the tiny tokenizer's vocabulary
    and then Gemma's image tokens, the chat template above, 28-pixel images of 4 tokens (the tiny Gemma 3's vision
    tower). LTX-2.5's presets have none: its enhancer is a Gemma 4 model with Gemma 4's processor, which needs
    torchvision, and torchvision's wheels do not load with the CPU torch build this project installs."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, GemmaTokenizer

    image_tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = GemmaTokenizer(vocab=gemma_tokenizer().get_vocab(), merges=[], extra_special_tokens=image_tokens)
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4)


def with_image_tokens(gemma: torch.nn.Module, processor) -> torch.nn.Module:
    """The tiny Gemma 3 given rows for the processor's image tokens (after its own, which keep their values, so
    the prompt encodes do not change) and those tokens' ids, so it runs as the prompt enhancer, images too."""
    tokenizer = processor.tokenizer
    gemma.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    gemma.config.boi_token_id, gemma.config.eoi_token_id = tokenizer.boi_token_id, tokenizer.eoi_token_id
    gemma.config.image_token_id = tokenizer.image_token_id
    return gemma


def tiny_text_encoder(tokenizer, seed: int, version: str = "2.0") -> torch.nn.Module:
    """A random tiny Gemma3ForConditionalGeneration (LTX-2.5: Gemma4UnifiedForConditionalGeneration, a sliding
    and a full-attention layer, the latter with 2 heads x 16 and keys as values): text 2 layers of 2 heads x 8
    (one key/value head), sliding window 8; small vision (and audio) towers the stages never run (LTX-2
    encodes text only)."""
    import transformers

    torch.manual_seed(seed)
    text = {"vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8}
    if version == "2.5":  # as the published Gemma 4: the full-attention layer has its own head width and k = v
        text |= {"global_head_dim": 16, "num_global_key_value_heads": 2, "attention_k_eq_v": True}
        text |= {"layer_types": ["sliding_attention", "full_attention"]}
        vision = {"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 16, "mm_posemb_size": 8}
        audio = {"audio_embed_dim": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
        config = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=audio)
        return transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return transformers.Gemma3ForConditionalGeneration(config).eval()
