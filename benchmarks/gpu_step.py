"""Stage 2's step on one NVIDIA GPU against the diffusers transformer in eager PyTorch on the same GPU,
side by side in one run; prints one JSON line per model.

For each model: the published transformer config at `--layers` blocks (default: all) with random
weights (seeded), bf16, CFG batch of 2, the family's own stage-2 loop inputs at the request's size.
  - ours: the family's guided denoiser jitted through torchax on JAX-CUDA with `--attention`
    (default cudnn: JAX's cuDNN fused attention), inputs moved in and the prediction pulled back each
    step, as stage 2 runs it; first-call seconds (trace + compile) reported separately;
  - eager: the same guided denoiser module (the same diffusers transformer and CFG combination) in
    eager PyTorch on CUDA with PyTorch's default SDPA dispatch. For HunyuanVideo-1.5 that module passes
    per-key masks (B, 1, 1, S), where the stock processor builds a dense (B, 1, S, S) mask.
Median of `--steps` steps after `--warmup` calls each; the two predictions' relative difference is
reported too (both bf16, so it measures bf16 rounding, not a bug). JAX and PyTorch share the GPU
(XLA_PYTHON_CLIENT_PREALLOCATE=false, set here before JAX is imported).

    python benchmarks/gpu_step.py                                   # both models, all layers, on the GPU
    python benchmarks/gpu_step.py --models hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v --layers 20
    python benchmarks/gpu_step.py --models tiny-cogvideox --device cpu --attention xla   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("zai-org/CogVideoX1.5-5B", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v")


def median_step(step, steps: int, warmup: int):
    """(first call seconds, median seconds of `steps` calls after `warmup` calls, the last result)."""
    start = time.perf_counter()
    result = step()
    first = time.perf_counter() - start
    for _ in range(max(warmup - 1, 0)):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), result


def random_transformer(source, layers: int | None, dtype):
    import torch

    config = source.load_config("transformer")
    if layers is not None:
        config["num_layers"] = layers
    torch.manual_seed(0)
    return source.component_class("transformer").from_config(config).to(dtype).eval(), config["num_layers"]


def request_for(family, source, args):
    from utils import Request

    values = {**family.request_defaults(source), "seed": 0}
    values.update({key: getattr(args, key) for key in ("height", "width", "num_frames") if getattr(args, key)})
    return Request(model_family=family.NAME, model_id=source.ref, prompt="", negative_prompt="", dtype="bf16", **values)


def measure(model: str, args) -> dict:
    import jax
    import torch

    import models
    from runtime.interface import TorchRuntime, library_versions
    from runtime.torchax_runtime import TorchaxRuntime
    from splash_attention import SplashConfig, attention_backend

    dtype = torch.bfloat16
    source, family = models.resolve_model(model, configs_only=True)
    request = request_for(family, source, args)
    transformer, layers = random_transformer(source, args.layers, dtype)
    eager_transformer = copy.deepcopy(transformer)
    generator = torch.Generator().manual_seed(1)
    embeds = {  # random text, every token valid
        name: torch.randn(t.shape, generator=generator).to(t.dtype) if t.is_floating_point() else torch.ones_like(t)
        for name, t in family.planning_embeds(source, request, dtype).items()
    }

    def step_of(runtime, transformer):
        # The first expert's program (Wan 2.2's second has the same shape), so every component gets it.
        transformers = dict.fromkeys(family.transformer_components(source), transformer)
        loop, _ = family.denoise_loop(source, request, embeds, dtype, transformers, runtime, "megatron")
        denoiser = runtime.compile(loop.guided[0], loop.rules.nested("transformer."))
        static = tuple(runtime.to_device(tensor, layout) for tensor, layout in loop.static_inputs)
        t = loop.timesteps[0]
        moving = (loop.model_input(loop.latents, t), t.reshape(1))
        return lambda: runtime.to_host(denoiser(*runtime.to_device(moving), *static))

    eager_runtime = TorchRuntime(args.device)
    eager = step_of(eager_runtime, eager_transformer)
    with torch.no_grad():
        _, eager_seconds, expected = median_step(eager, args.steps, args.warmup)
    del eager, eager_transformer
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    runtime = TorchaxRuntime.on_all_devices("tp")
    ours = step_of(runtime, transformer)
    with attention_backend(runtime.env, args.attention, SplashConfig(), runtime.mesh):
        first, ours_seconds, got = median_step(ours, args.steps, args.warmup)
    expected, got = expected.double(), got.double()
    device = jax.devices()[0]
    return {
        "model": model,
        "layers": layers,
        "video": {"height": request.height, "width": request.width, "num_frames": request.num_frames},
        "dtype": "bf16",
        "attention": args.attention,
        "gpu": device.device_kind,
        "torch_device": str(torch.cuda.get_device_name()) if args.device.startswith("cuda") else args.device,
        "ours_median_step_seconds": round(ours_seconds, 4),
        "eager_median_step_seconds": round(eager_seconds, 4),
        "ours_over_eager": round(ours_seconds / eager_seconds, 3),
        "ours_first_call_seconds": round(first, 1),
        # The same weights and inputs: how far our bf16 prediction is from eager's (||a - b|| / ||b||).
        "relative_error_vs_eager": float(f"{((got - expected).norm() / expected.norm()).item():.2e}"),
        "steps": args.steps,
        "versions": {
            "python": sys.version.split()[0],
            **library_versions("jax", "jaxlib", "torch", "torchax", "diffusers"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="hub ids (configs kept in code) or presets")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the model's all)")
    parser.add_argument("--height", type=int, help="default: the model's request default")
    parser.add_argument("--width", type=int)
    parser.add_argument("--num_frames", type=int)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--attention", choices=("cudnn", "xla"), default="cudnn")
    parser.add_argument("--device", default="cuda", help="torch device of the eager baseline (default: cuda)")
    args = parser.parse_args()
    for model in args.models:
        print(json.dumps(measure(model, args)), flush=True)


if __name__ == "__main__":
    main()
