"""Stage 2 on CPU, side by side in one run; prints one JSON line.

1. Median denoising step of our path (the guided transformer jitted through torchax_runtime, inputs
   moved in and the prediction pulled back each step, as stage 2 does) vs the same diffusers
   transformer plus CFG combination in eager PyTorch. Mid-size CogVideoX-1.5-like model: 4 layers,
   8 heads x 64 (the real head width), 320 video + 226 text tokens, batch 2 (CFG), fp32.
2. First-call (trace + compile) seconds in two fresh processes sharing an empty persistent
   compilation cache: cold, then warm.
3. Peak resident memory added while loading a saved model with `from_pretrained` and placing it with
   placement.place_module, divided by the model's weight bytes (16 layers x 1024 wide, ~0.6 GB fp32).

    python benchmarks/stage2_step.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tpu_video.models.cogvideox.published import COGVIDEOX15_5B_TRANSFORMER  # noqa: E402

TEXT_TOKENS = COGVIDEOX15_5B_TRANSFORMER["max_text_seq_length"]
LATENT_SHAPE = (1, 4, 16, 20, 32)  # B, F, C, H, W (CogVideoX's transformer layout)
STEP_MODEL = {"num_layers": 4, "num_attention_heads": 8, "attention_head_dim": 64}
MEMORY_MODEL = {"num_layers": 16, "num_attention_heads": 16, "attention_head_dim": 64}


def build_transformer(num_layers: int, num_attention_heads: int, attention_head_dim: int):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    shape = {
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "attention_head_dim": attention_head_dim,
    }
    return CogVideoXTransformer3DModel(**{**COGVIDEOX15_5B_TRANSFORMER, **shape}).eval()


def inputs(transformer):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(LATENT_SHAPE, generator=generator)
    embeds = torch.randn(2, TEXT_TOKENS, 4096, generator=generator)
    _, frames, _, height, width = LATENT_SHAPE
    patch = transformer.config.patch_size
    rotary = get_3d_rotary_pos_embed(
        embed_dim=transformer.config.attention_head_dim,
        crops_coords=None,
        grid_size=(height // patch, width // patch),
        temporal_size=frames // transformer.config.patch_size_t,
        grid_type="slice",
        max_size=(height // patch, width // patch),
    )
    return latents, torch.tensor([500.0]), embeds, rotary, torch.tensor(6.0)


def interleaved_medians(calls: dict, steps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call, the calls alternating step by step so machine noise hits all alike."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = {name: [] for name in calls}
    for _ in range(steps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def step_times(steps: int) -> dict[str, float]:
    from tpu_video.models.cogvideox.transformer import GuidedTransformer, make_jit_safe
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    transformer = make_jit_safe(build_transformer(**STEP_MODEL))
    latents, timestep, embeds, rotary, guidance = inputs(transformer)
    eager_model = build_transformer(**STEP_MODEL)  # same seed, same weights; stays in PyTorch
    eager = GuidedTransformer(eager_model, do_cfg=True)

    runtime = TorchaxRuntime()
    ours = runtime.compile(GuidedTransformer(transformer, do_cfg=True, constrain=runtime.constrain))
    static = runtime.to_device((embeds, rotary, guidance))

    def eager_step():
        with torch.no_grad():
            return eager(latents, timestep, embeds, rotary, guidance)

    def our_step():
        model_input = runtime.to_device((latents, timestep))
        return runtime.to_host(ours(*model_input, *static))

    expected, got = eager_step(), our_step()
    medians = interleaved_medians({"eager": eager_step, "ours": our_step}, steps)
    error = ((got - expected).norm() / expected.norm()).item()
    return {"eager_step_s": medians["eager"], "ours_step_s": medians["ours"], "relative_error": error}


def first_call_seconds() -> float:
    """Child process: configure the cache, compile the step model once, report the first call's time."""
    from tpu_video.models.cogvideox.transformer import GuidedTransformer, make_jit_safe
    from tpu_video.runtime.torchax_runtime import CompileCache, TorchaxRuntime

    cache = CompileCache(enabled=True)

    transformer = make_jit_safe(build_transformer(**STEP_MODEL))
    latents, timestep, embeds, rotary, guidance = inputs(transformer)
    runtime = TorchaxRuntime()
    compiled = runtime.compile(GuidedTransformer(transformer, do_cfg=True, constrain=runtime.constrain))
    arguments = runtime.to_device((latents, timestep, embeds, rotary, guidance))
    start = time.perf_counter()
    runtime.to_host(compiled(*arguments))
    seconds = time.perf_counter() - start
    cache.report()
    return seconds


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it is not inherited from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_load_ratio(folder: str) -> dict[str, float]:
    """Child process: peak RSS growth over load + place, relative to the weights' bytes."""
    import jax
    from diffusers import CogVideoXTransformer3DModel

    from tpu_video.models import cogvideox
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    runtime = TorchaxRuntime()
    before = peak_rss_bytes()
    transformer = CogVideoXTransformer3DModel.from_pretrained(folder, dtype=torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    runtime.compile(transformer, cogvideox.transformer_rules())
    placed = peak_rss_bytes()
    # from_pretrained maps the file and the CPU backend may alias host buffers, so nothing need be
    # resident yet: read every placed weight once to make all of it resident.
    total = sum(float(jax.numpy.sum(p.jax())) for p in transformer.parameters())
    peak = peak_rss_bytes()
    return {
        "weight_bytes": weight_bytes,
        "peak_rss_growth_over_weights_after_place": (placed - before) / weight_bytes,
        "peak_rss_growth_over_weights_after_reading_all": (peak - before) / weight_bytes,
        "checksum": total,
    }


def child(mode: str, argument: str | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode] + ([argument] if argument else []),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **({"JAX_COMPILATION_CACHE_DIR": argument} if mode == "compile" else {})},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per path (default: %(default)s)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode = args.child[0]
        out = {"seconds": first_call_seconds()} if mode == "compile" else peak_load_ratio(args.child[1])
        print(json.dumps(out))
        return

    result = step_times(args.steps)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as folder:
        cold = child("compile", cache)["seconds"]
        warm = child("compile", cache)["seconds"]
        build_transformer(**MEMORY_MODEL).save_pretrained(folder)
        memory = child("memory", folder)
        memory.pop("checksum")
    result.update(
        {
            "model": {**STEP_MODEL, "tokens": TEXT_TOKENS + 320, "batch": 2, "dtype": "fp32"},
            "ours_over_eager": result["ours_step_s"] / result["eager_step_s"],
            "cold_compile_s": cold,
            "warm_cache_compile_s": warm,
            "warm_over_cold": warm / cold,
            "memory_model": MEMORY_MODEL,
            **memory,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
