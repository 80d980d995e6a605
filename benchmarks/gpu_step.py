"""Stage 2's step on one NVIDIA GPU against the diffusers transformer in PyTorch on the same GPU, eager and
under torch.compile, side by side in one run; prints one JSON line per model.

For each model: the published transformer config at `--layers` blocks (default: all) with random
weights (seeded), bf16, CFG batch of 2, the family's own stage-2 loop inputs at the request's size.
  - ours: the family's guided denoiser jitted through torchax on JAX-CUDA with `--attention`
    (default cudnn: JAX's cuDNN fused attention), inputs moved in and the prediction pulled back each
    step, as stage 2 runs it;
  - PyTorch (`--baselines`): the same guided denoiser module (the same diffusers transformer and CFG
    combination) eager, under `torch.compile` (default mode) and under `torch.compile(mode=
    "max-autotune-no-cudagraphs")`, each with every SDPA kernel of `--backends` forced in turn
    (`torch.nn.attention.sdpa_kernel`: cudnn, flash, efficient; what diffusers' `_native_*` attention
    backends select) and with PyTorch's own choice (`auto`). A kernel that refuses the model's masks
    (HunyuanVideo-1.5 passes per-key masks (B, 1, 1, S), not the stock dense (B, 1, S, S) one; flash takes
    none) is reported as refused; one whose prediction is further than 5e-2 from eager's `auto` as wrong.
    The fastest correct kernel of each baseline is its `best`.
For each: first-call seconds (trace and compile), the median of `--steps` steps after `--warmup` calls,
peak GPU memory, seconds per video at 50 steps (the median step x 50) and MFU: the step's FLOPs (counted
by `torch.utils.flop_counter` on the meta device: matmuls, convolutions and attention) over the median
step at the GPU's dense bf16 peak (989 TFLOP/s for an H100 SXM or H200; other GPUs: none given, no MFU).
JAX and PyTorch share the GPU (XLA_PYTHON_CLIENT_PREALLOCATE=false, set here before JAX is imported).

    python benchmarks/gpu_step.py                                   # the three models, all layers, on the GPU
    python benchmarks/gpu_step.py --models hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v --layers 20
    python benchmarks/gpu_step.py --baselines eager compile --backends cudnn flash   # fewer compiles
    python benchmarks/gpu_step.py --models zai-org/CogVideoX1.5-5B --profile traces   # the PyTorch side traced
    python benchmarks/gpu_step.py --models zai-org/CogVideoX1.5-5B --profile traces --profile_side ours   # ours
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

MODELS = (
    "zai-org/CogVideoX1.5-5B",  # 768x1360x81 (its request defaults)
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",  # 480x848x121
    "Wan-AI/Wan2.1-T2V-14B-Diffusers",  # 480x832x81 (--height 720 --width 1280 where it fits)
)
BASELINES = {"eager": None, "compile": "default", "compile-max-autotune": "max-autotune-no-cudagraphs"}
BACKENDS = ("auto", "cudnn", "flash", "efficient")  # torch.nn.attention.SDPBackend, or PyTorch's own choice
PEAK_BF16 = {"H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H200": 989e12}  # dense, per the GPU's datasheet
STEPS_PER_VIDEO = 50
CORRECT = 5e-2  # bf16 kernels differ by rounding (~1e-2 at most seen); a wrong mask is far larger


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
    fixed = {"model_family": family.NAME, "model_id": source.ref, "prompt": "", "negative_prompt": "", "dtype": "bf16"}
    return Request.from_values({**fixed, **values})  # the family's options among the defaults


def peak_bf16(name: str) -> float | None:
    """The GPU's dense bf16 FLOP/s by its name (PEAK_BF16), or None for one not listed."""
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def step_flops(family, source, request, embeds, dtype, layers: int | None) -> float:
    """FLOPs of one guided step (CFG batch), counted by torch's flop counter on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tpu_video.runtime.interface import TorchRuntime

    with torch.device("meta"):
        transformer, _ = random_transformer(source, layers, dtype)
    step = make_step(family, source, request, embeds, dtype, TorchRuntime("meta"), transformer, pull=lambda x: x)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        step()
    return float(counter.get_total_flops())


def make_step(family, source, request, embeds, dtype, runtime, transformer, wrap=None, pull=None):
    """One guided step as stage 2 runs it: inputs moved in, the family's denoiser (`wrap`ped, e.g. by
    torch.compile), the prediction pulled back (`pull`, default the runtime's)."""
    # The first expert's program (Wan 2.2's second has the same shape), so every component gets it.
    transformers = dict.fromkeys(family.transformer_components(source), transformer)
    loop, _ = family.denoise_loop(source, request, embeds, dtype, transformers, runtime, "megatron", planning=False)
    denoiser = runtime.compile(loop.guided[0], loop.rules.nested("transformer."))
    denoiser = wrap(denoiser) if wrap is not None else denoiser
    static = tuple(runtime.to_device(tensor, layout) for tensor, layout in loop.static_inputs)
    t = loop.timesteps[0]
    moving = (loop.model_input(loop.latents, t), t.reshape(1))
    pull = pull or runtime.to_host
    return lambda: pull(denoiser(*runtime.to_device(moving), *static))


def sdpa_kernel(backend: str):
    """PyTorch's SDPA restricted to one kernel (`auto`: PyTorch's own choice)."""
    import contextlib

    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as restricted

    kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    kernels["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    return contextlib.nullcontext() if backend == "auto" else restricted([kernels[backend]])


def timing(first: float, median: float, flops: float, peak: float | None, memory: int | None) -> dict:
    return {
        "median_step_seconds": round(median, 4),
        "first_call_seconds": round(first, 1),
        "seconds_per_video": round(median * STEPS_PER_VIDEO, 1),
        "mfu": round(flops / median / peak, 4) if peak else None,
        "peak_memory_gib": round(memory / 2**30, 2) if memory is not None else None,
    }


def relative_difference(got, expected) -> float:
    got, expected = got.double().cpu(), expected.double().cpu()
    return float(f"{((got - expected).norm() / expected.norm()).item():.2e}")


def pytorch_rows(step_for, args, flops: float, peak: float | None) -> tuple[dict, object]:
    """Every baseline x kernel: its timing or why it was refused, and the eager `auto` prediction."""
    import torch

    cuda = args.device.startswith("cuda")
    rows, reference = {}, None
    for baseline in ("eager", *[b for b in args.baselines if b != "eager"]):
        rows[baseline] = {}
        for backend in ("auto", *[b for b in args.backends if b != "auto"]):
            torch._dynamo.reset()  # a fresh compile for each kernel choice
            mode = BASELINES[baseline]
            step = step_for(None if mode is None else lambda module, mode=mode: torch.compile(module, mode=mode))
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                with sdpa_kernel(backend), torch.no_grad():
                    first, median, result = median_step(step, args.steps, args.warmup)
            except Exception as err:  # a kernel that cannot take these inputs; compile failures alike
                rows[baseline][backend] = {"refused": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                continue
            memory = torch.cuda.max_memory_allocated() if cuda else None
            reference = result if reference is None else reference
            row = timing(first, median, flops, peak, memory)
            row["relative_error_vs_eager"] = relative_difference(result, reference)
            row["correct"] = row["relative_error_vs_eager"] <= CORRECT
            rows[baseline][backend] = row
    return rows, reference


def profile_torch(step, folder: Path, backend: str, label: str) -> Path:
    """Three steps under the PyTorch profiler: a Chrome trace and the operator table (CUDA time first)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with sdpa_kernel(backend), torch.no_grad(), profile(activities=activities) as profiler:
        for _ in range(3):
            step()
    folder.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(folder / f"{label}.json"))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = folder / f"{label}.txt"
    table.write_text(profiler.key_averages().table(sort_by=sort, row_limit=40))
    return table


def device_time_table(trace_folder: Path, table: Path, rows: int = 30) -> Path:
    """The JAX trace's time per op on each device timeline (GPU streams, XLA ops), summed over the traced
    steps, as text: what the PyTorch side's operator table gives, readable without TensorBoard."""
    import collections
    import gzip

    trace = json.loads(gzip.decompress(next(trace_folder.rglob("*.trace.json.gz")).read_bytes()))
    events = trace["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CUSTOM" not in name}
    devices = devices or set(processes)  # a CPU run has only the host timeline
    totals = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in devices:
            timeline = f"{processes[e['pid']]} / {names.get((e['pid'], e.get('tid')), e.get('tid'))}"
            totals[timeline][e["name"]] += e.get("dur", 0.0)
    lines = []
    for timeline, counter in sorted(totals.items()):
        lines.append(f"{timeline}: {sum(counter.values()) / 1e3:.1f} ms in all")
        lines += [f"  {us / 1e3:10.2f} ms  {name[:150]}" for name, us in counter.most_common(rows)]
    table.write_text("\n".join(lines) + "\n")
    return table


def best_of(rows: dict) -> dict:
    """Per baseline: its fastest correct kernel and that row."""
    best = {}
    for baseline, kernels in rows.items():
        correct = {name: row for name, row in kernels.items() if row.get("correct")}
        if correct:
            name = min(correct, key=lambda k: correct[k]["median_step_seconds"])
            best[baseline] = {"backend": name, **correct[name]}
    return best


def measure(model: str, args) -> dict:
    import torch

    from tpu_video import models
    from tpu_video.runtime.interface import TorchRuntime, library_versions

    dtype = torch.bfloat16
    source, family = models.resolve_model(model, configs_only=True)
    request = request_for(family, source, args)
    transformer, layers = random_transformer(source, args.layers, dtype)
    torch_transformer = copy.deepcopy(transformer)
    generator = torch.Generator().manual_seed(1)
    embeds = {  # random text, every token valid
        name: torch.randn(t.shape, generator=generator).to(t.dtype) if t.is_floating_point() else torch.ones_like(t)
        for name, t in family.planning_embeds(source, request, dtype).items()
    }
    flops = step_flops(family, source, request, embeds, dtype, args.layers)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    peak = peak_bf16(gpu)

    torch_runtime = TorchRuntime(args.device)

    def step_for(wrap):
        return make_step(family, source, request, embeds, dtype, torch_runtime, torch_transformer, wrap)

    rows, expected = pytorch_rows(step_for, args, flops, peak)
    best = best_of(rows)
    profiles = {}
    if args.profile and args.profile_side == "pytorch":  # the fastest PyTorch baseline, as it ran
        name = min(best, key=lambda b: best[b]["median_step_seconds"])
        mode = BASELINES[name]
        torch._dynamo.reset()
        step = step_for(None if mode is None else lambda module: torch.compile(module, mode=mode))
        with sdpa_kernel(best[name]["backend"]), torch.no_grad():
            step()  # compiled outside the trace
        folder = Path(args.profile) / model.replace("/", "--")
        profiles["pytorch"] = str(profile_torch(step, folder, best[name]["backend"], f"pytorch-{name}"))
    torch_transformer.to("cpu")  # the GPU's memory to JAX
    torch._dynamo.reset()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    # torchax only now: once imported, torch.compile fails ("PyTorch is not linked with support for jax
    # devices"), so the PyTorch baselines run first.
    import jax

    from tpu_video.attention.plan import fixed_plan
    from tpu_video.runtime.sdpa import attention_backend
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    # no saved executables: the first call is the trace and the compile on every run, and nothing is stored
    runtime = TorchaxRuntime.on_all_devices("tp", executables="off")
    ours_step = make_step(family, source, request, embeds, dtype, runtime, transformer)
    with attention_backend(runtime.env, fixed_plan(args.attention), runtime.mesh):  # cudnn or xla
        first, median, got = median_step(ours_step, args.steps, args.warmup)
        if args.profile and args.profile_side == "ours":  # three steps under JAX's profiler (TensorBoard / XProf)
            folder = Path(args.profile) / model.replace("/", "--") / "ours"
            with jax.profiler.trace(str(folder)):
                for _ in range(3):
                    ours_step()
            profiles["ours"] = str(folder)
            profiles["ours_table"] = str(device_time_table(folder, folder.parent / "ours.txt"))
    device = jax.devices()[0]
    memory = (device.memory_stats() or {}).get("peak_bytes_in_use")
    ours = {"attention": args.attention, **timing(first, median, flops, peak, memory)}
    ours["relative_error_vs_eager"] = relative_difference(got, expected)  # bf16 rounding, not a bug
    return {
        "model": model,
        "layers": layers,
        "video": {"height": request.height, "width": request.width, "num_frames": request.num_frames},
        "dtype": "bf16",
        "gpu": gpu,
        "jax_device": device.device_kind,
        "flops_per_step": flops,
        "peak_bf16_flops": peak,
        "ours": ours,
        "pytorch": rows,
        "best": best,
        "ours_over_best": {name: round(median / row["median_step_seconds"], 3) for name, row in best.items()},
        "steps": args.steps,
        **({"profiles": profiles} if profiles else {}),
        "versions": {
            "python": sys.version.split()[0],
            **library_versions("jax", "jaxlib", "torch", "torchax", "diffusers"),
        },
        "command": "python benchmarks/gpu_step.py " + " ".join(sys.argv[1:]),
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
    parser.add_argument("--attention", choices=("cudnn", "xla"), default="cudnn", help="ours (default: cudnn)")
    parser.add_argument("--baselines", nargs="+", choices=list(BASELINES), default=list(BASELINES))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="SDPA kernels")
    parser.add_argument("--profile", help="folder: a trace of 3 steps of one side (--profile_side) and its time table")
    parser.add_argument(
        "--profile_side",
        choices=("pytorch", "ours"),
        default="pytorch",
        help="the fastest PyTorch baseline (PyTorch profiler) or ours (JAX profiler); one per process: both "
        "profilers subscribe to CUPTI, which takes one subscriber (the second gets "
        "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED and traces no GPU work)",
    )
    parser.add_argument("--device", default="cuda", help="torch device of the eager baseline (default: cuda)")
    args = parser.parse_args()
    for model in args.models:
        print(json.dumps(measure(model, args)), flush=True)


if __name__ == "__main__":
    main()
