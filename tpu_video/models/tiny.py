"""What several families' tiny presets share: a T5 tokenizer built in code (no files) and the tiny T5/UMT5
encoder's config. Each family's own tiny components are in its `presets` module; the presets and the tests
run the real pipelines on them (diffusers' own pipeline tests use the same habit: one or two layers, head
dim 8).
"""

from __future__ import annotations


def t5_tokenizer():
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
