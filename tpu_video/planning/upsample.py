"""`stage2_transformer.py --upsample --plan TPU`: the step between two passes (LTX-2's x2 latent upsampler) compiled
for a TPU topology as the step builds it: the family's own code on a planning runtime (encoders.PlanningRuntime)
whose mesh puts every device on `sp`, as the step's runtime does, with the upsampler built from its config on the
meta device and zero latents of the first pass's size."""

from __future__ import annotations

from typing import Any

import torch

from sharding import MeshShape
from tpu_video.planning.encoders import PlanningRuntime, programs_report
from tpu_video.planning.tpus import Target, topology_mesh


def plan_upsample_step(family, source, request, location, filters, target: Target) -> dict[str, Any]:
    """The report of the upsampler's program for the first pass of `request` on `target` (float32, as it runs)."""
    runtime = PlanningRuntime(topology_mesh(target, MeshShape(sp=target.devices)))
    record = family.plan_upsample(source, request, location, runtime, *filters)
    report = programs_report(2, runtime, target, request, torch.float32, work="upsample", upsample=record)
    report["upsampled_video"] = {"height": request.height * 2, "width": request.width * 2}
    return report
