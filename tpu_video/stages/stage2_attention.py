"""Stage 2's attention plan from its flags, as a run and `--plan` both build it, and, for a model that does not
fit, where it would (a mesh of these devices, or the smallest TPU slices)."""

from __future__ import annotations

import dataclasses

from tpu_video.attention.plan import AttentionFlags
from tpu_video.cli import UserError, log
from tpu_video.engine.meta import attention_heads, model_facts
from tpu_video.stages.feature_flags import quantization


def attention_flags(args) -> AttentionFlags:
    """The attention and mesh flags as given (None: not given)."""
    return AttentionFlags(**{field.name: getattr(args, field.name) for field in dataclasses.fields(AttentionFlags)})


def attention_plan(args, run_model, platform: str, devices: int, per_host=None, memory=None, generation=None, videos=1):
    """The run's AttentionPlan (tpu_video/attention/plan.py), as --plan and a run both build it: `run_model` is the
    (family, source, request, dtype) denoised; the mesh for a batch of `videos` (runtime.mesh.default_mesh
    for the axes not given); `generation` the TPU's (None: not a TPU). Logged with its reasons."""
    from tpu_video.attention.plan import build_plan
    from tpu_video.runtime.mesh import MEMORY_SHARE, default_mesh

    family, source, request, dtype = run_model
    facts = model_facts(family, source, dtype, args.tp_mode, request, quantization(args))
    branches = family.guidance_branches(source, request)

    def choose_mesh(dp, sp, tp, sequence_split):
        mesh = {"devices_per_host": per_host, "device_memory": memory, "videos": videos}
        return default_mesh(devices, dp, sp, tp, branches=branches, model=facts, sequence_split=sequence_split, **mesh)

    try:
        plan = build_plan(
            attention_flags(args),
            platform=platform,
            dtype=dtype,
            heads=attention_heads(source),
            tile_defaults=family.SPLASH_BLOCK_SIZES,
            tile_cap=generation.splash_tile_cap if generation is not None else None,
            choose_mesh=choose_mesh,
            log=log,
        )
    except ValueError as err:
        raise UserError(str(err)) from None
    log(f"mesh {plan.mesh.shape} ({plan.mesh.why})")
    if not plan.mesh.fits:
        advice = where_it_fits(facts, branches, videos, devices, per_host, memory, generation, plan.mesh.shape)
        log(f"warning: mesh {plan.mesh.shape} is estimated to pass {MEMORY_SHARE:.0%} of the device memory; {advice}")
    if plan.sequence_parallel != "none":
        log(f"sequence parallel: {plan.sequence_parallel} ({plan.sequence_parallel_why})")
    return plan


def where_it_fits(facts, branches: int, videos: int, devices: int, per_host, memory: int, generation, shape) -> str:
    """For a run or plan that does not fit on `shape`: the default mesh of these devices where the estimate
    fits it (mesh flags gave another), else on a TPU (`generation` not None) the smallest slice of each
    generation whose default mesh does (of `generation`, larger than `devices`); a phrase for a log line or
    the plan's verdict."""
    from tpu_video.planning import tpus
    from tpu_video.runtime.mesh import default_mesh

    here = default_mesh(
        devices, branches=branches, model=facts, videos=videos, devices_per_host=per_host, device_memory=memory
    )
    if here.fits and here.shape != shape:
        return f"the default mesh {here.shape} is estimated to fit (no --dp/--sp/--tp)"
    if generation is None:
        return f"no mesh of these {devices} devices is estimated to fit it"

    def fits(target) -> bool:
        at = {"devices_per_host": target.devices_per_host, "device_memory": target.hbm_per_device}
        return default_mesh(target.devices, branches=branches, model=facts, videos=videos, **at).fits

    found = tpus.smallest_fitting(fits, generation, devices)
    if not found:
        return "no TPU slice this tool knows is estimated to fit it"
    return "the smallest slices estimated to fit: " + ", ".join(target.name for target in found)
