#!/usr/bin/env python
"""LTX-2's stage-1 text encoder, Gemma 3 12B, on a CPU host: its language model at the published widths
(tpu_video/models/ltx2/published.py) with random weights, run as stage 1 runs it (1024 left-padded tokens, every
hidden state returned) at 1 and at 2 layers, in eager PyTorch and through torchax on the JAX CPU device.
The difference is one layer's cost; the full model is the 1-layer run plus 47 more layers. The whole
model does not fit this 24 GiB host (its bf16 weights alone are 22 GiB), so the full figure is that sum.
Then the text connectors (`Lightricks/LTX-2`'s, or `--connectors_of Lightricks/LTX-2.3`), which stage 1
runs on the host, in eager PyTorch on the [negative, prompt] batch of Gemma's 49 stacked hidden states, as
the pipeline runs them. Prints one JSON line.

    python benchmarks/gemma_stage1.py [--dtype bf16] [--repeats 2] [--backends torch torchax]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS = 1024  # LTX2Pipeline's max_sequence_length: the prompt is always padded to it


def language_model(layers: int, dtype):
    """Gemma 3 12B's text model cut to `layers` layers, random weights (normal, 0.02)."""
    import torch
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from tpu_video.models.ltx2.published import GEMMA3_12B

    config = Gemma3TextConfig(**{**GEMMA3_12B["text_config"], "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Gemma3TextModel(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return model.eval()


def seconds(layers: int, dtype, backend: str, repeats: int) -> float:
    """The best of `repeats` forward passes (after one to warm up or compile)."""
    import torch

    model = language_model(layers, dtype)
    ids = torch.randint(0, 262208, (1, TOKENS))
    mask = torch.ones(1, TOKENS, dtype=torch.int64)
    mask[:, : TOKENS // 2] = 0  # a prompt of 512 tokens, left-padded as the pipeline pads it
    if backend == "torch":

        def run():
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]

    else:
        from tpu_video.engine.encoders import DeviceTextEncoder
        from tpu_video.runtime.torchax_runtime import TorchaxRuntime

        encoder = DeviceTextEncoder(model, TorchaxRuntime(), hidden_states=True)

        def run():
            return encoder(ids, mask, output_hidden_states=True).hidden_states[-1]

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def connectors_seconds(model: str, dtype, repeats: int) -> float:
    """The best of `repeats` calls of the published connectors (random weights, normal 0.02) on two
    1024-token sequences, half of each padding (after one warm-up call)."""
    import torch

    from tpu_video import models
    from tpu_video.engine.meta import meta_module
    from tpu_video.models.ltx2.config import TOKENIZER_PADDING_SIDE

    source, _ = models.resolve_model(model, configs_only=True)
    connectors = meta_module(source, "connectors", dtype).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in connectors.parameters():
            tensor.normal_(0.0, 0.02)
    config = source.load_config("connectors")
    width = config["caption_channels"] * config["text_proj_in_factor"]  # Gemma's hidden states, stacked
    embeds = torch.randn(2, TOKENS, width).to(dtype)
    mask = torch.ones(2, TOKENS, dtype=torch.int64)
    mask[:, : TOKENS // 2] = 0  # left padding, as the pipeline pads
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            connectors(embeds, mask, padding_side=TOKENIZER_PADDING_SIDE)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", nargs="+", choices=("torch", "torchax"), default=["torch", "torchax"])
    parser.add_argument("--connectors_of", default="Lightricks/LTX-2", help="the published model whose connectors")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    result = {"tokens": TOKENS, "dtype": args.dtype, "threads": torch.get_num_threads()}
    for backend in args.backends:
        one, two = (seconds(layers, dtype, backend, args.repeats) for layers in (1, 2))
        per_layer = two - one
        result[backend] = {
            "one_layer_s": round(one, 3),
            "two_layers_s": round(two, 3),
            "per_layer_s": round(per_layer, 3),
            "48_layers_s": round(one + 47 * per_layer, 1),
        }
    result["connectors_torch_s"] = round(connectors_seconds(args.connectors_of, dtype, args.repeats), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
