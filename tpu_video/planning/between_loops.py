"""`--plan` of the work between a video's loops (Wan Animate's VAE decode and encode between segments:
`DenoiseLoop.between_plan`): each program compiled as a run compiles it, beside what the denoise keeps on the
devices all along."""

from __future__ import annotations

from typing import Any

import torch

from tpu_video.planning.tpus import Target


def plan_between_loops(loop, runtime, target: Target, step, compile_program) -> dict[str, Any]:
    """Compile `loop.between_plan`'s programs with `compile_program(module, inputs=, method=)` (plan.py's
    compile_module, weights replicated), under its attention plan, in float32 at the highest matmul precision, as
    the run does. `step`: the step program's plan.Compiled. Its arguments (the transformers' weights and the
    step's inputs) stay on the devices meanwhile, so each program needs those bytes and its own; and the
    module's weights, placed at the first segment's end, stay through the later segments' steps. It fits where
    both do. FLOPs per segment from the calls a segment makes, and their time at peak bf16 (a lower bound: fp32
    at the highest precision takes several bf16 passes)."""
    module, inputs, calls, attention = loop.between_plan(runtime)
    resident = step.memory["arguments"]
    weights = sum(tensor.numel() * tensor.element_size() for tensor in module.parameters())  # on every device
    compiled = {}
    with runtime.attention(attention), runtime.precision(torch.float32):
        for name in (name for name, count in calls.items() if count):
            compiled[name] = compile_program(module, inputs=inputs[name], method=name)
    if any(program.refused for program in compiled.values()):
        needed = max(program.refused["required"] for program in compiled.values() if program.refused)
        return {"fits": False, "hbm_bytes_per_device": resident + needed, "resident_bytes": resident}
    need = {name: resident + program.memory["total"] for name, program in compiled.items()}
    flops = sum(program.flops * calls[name] for name, program in compiled.items())
    steps_with_weights = step.memory["total"] + weights
    return {
        "fits": max(need.values()) <= target.hbm_per_device and steps_with_weights <= target.hbm_per_device,
        "hbm_bytes_per_device": max(need.values()),
        "resident_bytes": resident,
        "hbm_bytes_per_program": need,
        "weights_bytes": weights,
        "later_steps_hbm_bytes_per_device": steps_with_weights,
        "calls": {name: calls[name] for name in compiled},
        "flops_per_device": flops,
        "seconds_lower_bound": flops / target.bf16_flops_per_device,
        "compile_seconds": round(sum(program.seconds for program in compiled.values()), 1),
    }
