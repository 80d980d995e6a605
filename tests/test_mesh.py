"""The one default-mesh function (runtime.mesh.default_mesh): every published model on every listed TPU
slice, every tiny preset on 1 to 8 devices, the errors for flags that cannot work, the weight bytes it
reasons with against what placement really puts on a device, and its activation estimate against the
TPU compiler's temporaries as measured by benchmarks/activation_estimate.py. Plain arithmetic, except the
two compiled plans at the end: the default meshes of two published models, built by the TPU compiler for
a v6e-8.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import stage2_transformer
from helpers import run_stage
from tpu_video import models
from tpu_video.attention.sp_modes import sp_mode_choice
from tpu_video.engine.meta import model_facts
from tpu_video.planning import tpus
from tpu_video.planning.flags import default_request
from tpu_video.runtime import placement
from tpu_video.runtime.mesh import MEMORY_SHARE, MeshShape, ModelFacts, default_batch, default_mesh
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from tpu_video.stages import stage2_attention

TOPOLOGIES = ("v5e-8", "v6e-8", "v5p-8", "tpu7x-8", "v6e-16")


def facts_of(model: str, dtype=torch.bfloat16, **request_flags) -> ModelFacts:
    """A preset's weight facts, or a published model's with its activations at its defaults and the flags."""
    if model.startswith("tiny"):
        source, family = models.resolve_model(model)
        return model_facts(family, source, dtype, "megatron")
    request, source, family = default_request(model, request_flags)
    return model_facts(family, source, dtype, "megatron", request)


def assert_valid(choice, devices: int, facts: ModelFacts, branches: int, per_host: int) -> None:
    shape = choice.shape
    assert shape.size == devices
    assert facts.heads % shape.tp == 0 and all(dim % shape.tp == 0 for dim in facts.tp_dims)
    assert per_host % shape.tp == 0  # tp never spans hosts
    assert shape.dp <= branches
    sp_mode_choice("auto", shape.as_dict(), facts.heads)  # raises where no scheme can run
    assert choice.why


@pytest.fixture(scope="module")
def published_facts():
    return {hub_id: facts_of(hub_id) for hub_id in models.PUBLISHED}


@pytest.fixture(scope="module")
def default_branches():
    """Each published model's samples per step at its pipeline's defaults (2 with CFG; Wan Animate's scale 1: 1)."""
    requests = {hub_id: default_request(hub_id, {}) for hub_id in models.PUBLISHED}
    return {hub_id: family.guidance_branches(source, request) for hub_id, (request, source, family) in requests.items()}


@pytest.mark.parametrize("branches", [2, 1], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_published_model_gets_a_valid_default_mesh(published_facts, default_branches, topology, branches):
    """A valid mesh for every model, and one that fits at as many samples as its defaults run (more, as Wan
    Animate 14B's 720p segment with CFG on v5e-8, may pass 85% of HBM: the choice says so)."""
    target = tpus.parse_target(topology)
    for hub_id, facts in published_facts.items():
        choice = default_mesh(
            target.devices,
            branches=branches,
            model=facts,
            devices_per_host=target.devices_per_host,
            device_memory=target.hbm_per_device,
        )
        assert_valid(choice, target.devices, facts, branches, target.devices_per_host)
        if branches > default_branches[hub_id] and not choice.fits:
            assert "more than 85% of it on every mesh" in choice.why, (hub_id, choice.why)
            continue
        assert choice.fits, (hub_id, choice.why)
        assert choice.estimate == facts.bytes_per_device(choice.shape, branches) <= MEMORY_SHARE * target.hbm_per_device


def test_default_meshes_the_issue_named(published_facts):
    """CogVideoX-2b's 30 heads on a v6e-8 were an error (tp 4); Wan 2.2's two experts on a v5e-8 would pass
    85% of each 16 GiB chip at tp 4 with a 480p video's activations, so dp gives way and tp takes all 8."""
    v6e, v5e = tpus.parse_target("v6e-8"), tpus.parse_target("v5e-8")
    cog = default_mesh(8, branches=2, model=published_facts["THUDM/CogVideoX-2b"], device_memory=v6e.hbm_per_device)
    assert cog.shape == MeshShape(2, 2, 2) and "ring attention" in cog.why
    wan22 = published_facts["Wan-AI/Wan2.2-T2V-A14B-Diffusers"]
    assert wan22.bytes_per_device(MeshShape(2, 1, 4), 2) > MEMORY_SHARE * v5e.hbm_per_device
    choice = default_mesh(8, branches=2, model=wan22, device_memory=v5e.hbm_per_device)
    assert choice.shape == MeshShape(1, 1, 8) and choice.fits
    assert "dp 1: the largest divisor of the 2 CFG branches of one video" in choice.why
    assert "dp 2 x sp 1 x tp 4 would need" in choice.why and "GiB per device (estimated), more than 85%" in choice.why
    assert default_mesh(8, branches=2, model=wan22, device_memory=None).shape == MeshShape(2, 1, 4)


WAN13, WAN14 = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers"
TI2V, TI2V_CARD = "Wan-AI/Wan2.2-TI2V-5B-Diffusers", {"height": 704, "width": 1280, "num_frames": 121}
HUNYUAN = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{}p_t2v"
# The TPU compiler's temporaries per device in GiB (bf16, CFG on, v6e-8; one video unless a batch is
# given), each from one `stage2_transformer.py --plan` on 2026-11-24 (docs/planning.md; the rows are
# benchmarks/activation_estimate.py's); the batch row is `--plan v5e-8 --batch_size 2` (docs/batches.md).
MEASURED_TEMPORARIES = [
    (WAN13, {}, (2, 1, 4), 1, 0.825),
    (WAN13, {}, (2, 4, 1), 1, 0.497),
    (WAN13, {}, (1, 2, 4), 1, 0.606),
    (WAN13, {}, (2, 2, 2), 1, 0.504),
    (WAN14, {}, (2, 1, 4), 1, 2.778),
    (WAN14, {"height": 720, "width": 1280}, (2, 1, 4), 1, 6.265),
    (TI2V, {}, (2, 1, 4), 1, 1.732),
    (TI2V, TI2V_CARD, (2, 1, 4), 1, 5.578),
    (TI2V, TI2V_CARD, (2, 4, 1), 1, 1.544),
    (HUNYUAN.format(480), {}, (2, 1, 4), 1, 1.360),
    (HUNYUAN.format(480), {}, (2, 4, 1), 1, 1.264),
    (HUNYUAN.format(720), {}, (2, 1, 4), 1, 2.91),
    ("zai-org/CogVideoX1.5-5B", {}, (2, 1, 4), 1, 1.92),
    ("zai-org/CogVideoX1.5-5B", {}, (2, 4, 1), 1, 2.079),
    ("zai-org/CogVideoX1.5-5B", {}, (4, 1, 2), 2, 4.28),
]
# LTX-2 (2026-11-26, one video: 3 passes per step on LTX-2.0, 4 on LTX-2.3; docs/planning.md#ltx-2): the
# blocks under one scan (the default) unless marked unrolled, which needs more.
LTX2, LTX23, LTX2_CARD = "Lightricks/LTX-2", "Lightricks/LTX-2.3", {"height": 704, "width": 1280}
MEASURED_LTX2_TEMPORARIES = [
    (LTX2, {}, (1, 1, 8), 3, 0.5219),
    (LTX2, {}, (1, 1, 8), 3, 0.7546),  # unrolled
    (LTX2, LTX2_CARD, (1, 1, 8), 3, 1.3843),
    (LTX23, {}, (4, 1, 2), 4, 0.3434),
    (LTX23, {}, (2, 1, 4), 4, 0.3467),  # v5e-8
]


@pytest.mark.parametrize(
    "model, flags, mesh, passes, measured_gib, slack",
    [(model, flags, mesh, 2 * videos, gib, 1.4) for model, flags, mesh, videos, gib in MEASURED_TEMPORARIES]
    # one linear model for both LTX-2 versions, scanned and unrolled: up to 1.63x
    + [(*row, 1.65) for row in MEASURED_LTX2_TEMPORARIES],
)
def test_the_activation_estimate_covers_what_the_tpu_compiler_measured(model, flags, mesh, passes, measured_gib, slack):
    """At or above the compiler on every measured row (the families' copies are fitted to them), and not
    far above it: the default mesh should not pass over meshes that fit."""
    dp, sp, tp = mesh
    estimate = facts_of(model, **flags).activations.bytes_per_device(passes // dp, sp, tp) / 2**30
    assert measured_gib <= estimate <= measured_gib * slack, (estimate, measured_gib)


def valid_meshes(devices: int, batch: int, facts: ModelFacts, per_host: int):
    """Every dp x sp x tp of `devices` the default could choose, enumerated independently of runtime.mesh."""
    for dp, sp, tp in itertools.product(range(1, devices + 1), repeat=3):
        whole = all(dim % tp == 0 for dim in (facts.heads, *facts.tp_dims))
        if dp * sp * tp == devices and batch % dp == 0 and per_host % tp == 0 and whole:
            yield MeshShape(dp, sp, tp)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
    "model, flags",
    [
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", {"height": 720, "width": 1280}),
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", {"height": 720, "width": 1280}),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", {"height": 704, "width": 1280, "num_frames": 121}),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", {"height": 1408, "width": 2560, "num_frames": 121}),
        ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v", {"num_frames": 241}),
        ("zai-org/CogVideoX1.5-5B", {}),
    ],
)
def test_the_default_fits_the_estimate_wherever_some_mesh_does(topology, model, flags):
    """Larger videos than the published defaults too: where any valid mesh keeps the estimate within
    MEMORY_SHARE the default does; where none does, it is the mesh needing least, and says so."""
    target = tpus.parse_target(topology)
    facts = facts_of(model, **flags)
    memory = {"devices_per_host": target.devices_per_host, "device_memory": target.hbm_per_device}
    choice = default_mesh(target.devices, branches=2, model=facts, **memory)
    needs = {
        shape: facts.bytes_per_device(shape, 2)
        for shape in valid_meshes(target.devices, 2, facts, target.devices_per_host)
    }
    assert choice.shape in needs
    if min(needs.values()) <= MEMORY_SHARE * target.hbm_per_device:
        assert choice.fits and needs[choice.shape] <= MEMORY_SHARE * target.hbm_per_device, choice.why
    else:
        assert not choice.fits and needs[choice.shape] == min(needs.values())
        assert "more than 85% of it on every mesh of these devices" in choice.why


@pytest.mark.parametrize("preset", sorted(models.PRESETS))
def test_every_preset_gets_a_valid_default_mesh_on_1_to_8_devices(preset):
    facts = facts_of(preset, torch.float32)
    for devices in range(1, 9):
        for branches in (1, 2, 3, 4):  # 3 and 4: LTX-2's guidance passes
            choice = default_mesh(devices, branches=branches, model=facts)
            assert_valid(choice, devices, facts, branches, devices)
            assert choice.shape.dp == math.gcd(branches, devices)


def test_where_a_run_that_does_not_fit_would_fit():
    """Wan 2.2 A14B at 720p fits no mesh of a v5e-8, nor of any larger v5e slice (tp stops at a host's 4
    chips, where the two experts alone take 13.6 GiB): the smallest slice of each other generation is
    named. Mesh flags that pass the estimate where the default fits are pointed at the default instead."""
    wan22 = facts_of("Wan-AI/Wan2.2-T2V-A14B-Diffusers", height=720, width=1280)
    v5e = tpus.parse_target("v5e-8")
    at = (v5e.devices, v5e.devices_per_host, v5e.hbm_per_device, v5e.generation)
    advice = stage2_attention.where_it_fits(wan22, 2, 1, *at, MeshShape(1, 1, 8))
    assert advice == "the smallest slices estimated to fit: v5p-8, v6e-4, tpu7x-8"
    v6e = tpus.parse_target("v6e-4")
    assert default_mesh(4, branches=2, model=wan22, device_memory=v6e.hbm_per_device).fits
    assert not default_mesh(4, branches=2, model=wan22, device_memory=v5e.hbm_per_device).fits
    off_tpu = stage2_attention.where_it_fits(wan22, 2, 1, 8, None, v5e.hbm_per_device, None, MeshShape(1, 1, 8))
    assert off_tpu == "no mesh of these 8 devices is estimated to fit it"
    hunyuan = facts_of("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v")
    given = stage2_attention.where_it_fits(hunyuan, 2, 1, *at, MeshShape(2, 4, 1))
    assert given == "the default mesh dp 2 x sp 1 x tp 4 is estimated to fit (no --dp/--sp/--tp)"


def test_slices_are_listed_smallest_first_and_the_search_skips_the_slice_that_does_not_fit():
    v6e = tpus.GENERATIONS["v6e"]
    assert [target.name for target in tpus.slices(v6e)][:3] == ["v6e-4", "v6e-8", "v6e-16"]
    assert [target.devices for target in tpus.slices(tpus.GENERATIONS["v5p"])][:2] == [4, 8]
    found = tpus.smallest_fitting(lambda target: target.devices >= 8, v6e, 8)
    assert [target.name for target in found] == ["v5litepod-8", "v5p-16", "v6e-16", "tpu7x-8"]


def test_a_model_no_host_can_hold_is_still_given_its_most_split_mesh():
    facts = ModelFacts(heads=8, split_bytes=((64, 120 * 2**30),))
    choice = default_mesh(8, branches=2, model=facts, device_memory=16 * 2**30)
    assert choice.shape == MeshShape(1, 1, 8) and not choice.fits
    assert "more than 85% of it on every mesh" in choice.why and choice.record()["fits_estimate"] is False


@pytest.mark.parametrize(
    "flags, branches, expected",
    [
        ({}, 2, (2, 1, 4)),
        ({}, 1, (1, 1, 8)),
        ({"sp": 2}, 2, (2, 2, 2)),
        ({"tp": 8}, 2, (1, 1, 8)),
        ({"dp": 1, "sp": 8}, 2, (1, 8, 1)),
        ({"dp": 1}, 2, (1, 1, 8)),
    ],
)
def test_given_axes_are_kept_and_the_rest_filled(flags, branches, expected):
    assert default_mesh(8, **flags, branches=branches, model=ModelFacts(heads=8)).shape == MeshShape(*expected)


def test_ltx2s_three_or_four_guidance_passes_take_dp_where_they_divide_it():
    four = default_mesh(8, branches=4, model=ModelFacts(heads=8))
    assert four.shape == MeshShape(4, 1, 2) and "dp 4: the 4 guidance passes of one video" in four.why
    three = default_mesh(8, branches=3, model=ModelFacts(heads=8))
    assert three.shape == MeshShape(1, 1, 8) and "largest divisor of the 3 guidance passes" in three.why
    with pytest.raises(ValueError, match="dp 4 is more than the batch of 3"):
        default_mesh(8, dp=4, branches=3, model=ModelFacts(heads=8))


def test_heads_and_split_dimensions_bound_tp_and_sp_takes_the_rest():
    assert default_mesh(6, branches=2, model=ModelFacts(heads=8)).shape == MeshShape(2, 3, 1)
    assert default_mesh(7, branches=2, model=ModelFacts(heads=8)).shape == MeshShape(1, 7, 1)
    # 12 heads but an MLP width of 8960 = 2**8 x 35: tp 4, not 6 or 12
    facts = ModelFacts(heads=12, split_bytes=((1536, 10), (8960, 10)))
    assert default_mesh(12, branches=1, model=facts).shape == MeshShape(1, 3, 4)


def test_tp_stays_within_a_host():
    """16 devices on 4 hosts: tp takes one host's 4 and the rest goes on sp; tp 8 is refused."""
    facts = ModelFacts(heads=8)
    assert default_mesh(16, branches=2, model=facts, devices_per_host=4).shape == MeshShape(2, 2, 4)
    assert default_mesh(8, branches=2, model=facts, devices_per_host=4).shape == MeshShape(2, 1, 4)
    with pytest.raises(ValueError, match="tp 8 would span hosts .*a mesh that works: dp 2 x sp 2 x tp 4"):
        default_mesh(16, dp=2, tp=8, branches=2, model=facts, devices_per_host=4)


@pytest.mark.parametrize(
    "flags, heads, message",
    [
        ({"dp": 3}, 8, "dp 3 = 3 does not divide the 8 devices; a mesh that works: dp 2 x sp 1 x tp 4"),
        ({"dp": 1, "tp": 3}, 8, "dp 1 x tp 3 = 3 does not divide the 8 devices"),
        ({"dp": 2, "sp": 2, "tp": 4}, 8, "= 16 devices, but 8 are available"),
        ({"tp": 8}, 6, "tp 8 does not divide the transformer's 6 attention heads; a mesh that works: dp 2 x sp 2"),
        ({"sp": 0}, 8, "sp must be at least 1"),
        ({"dp": 4}, 8, "dp 4 is more than the batch of 2"),
        ({"dp": 2, "sp": 8}, 8, "dp 2 x sp 8 = 16 does not divide the 8 devices"),
    ],
)
def test_flags_that_cannot_work_name_a_mesh_that_does(flags, heads, message):
    with pytest.raises(ValueError, match=message):
        default_mesh(8, **flags, branches=2, model=ModelFacts(heads=heads))


@pytest.mark.parametrize("preset", ["tiny-cogvideox", "tiny-wan2.2"])
def test_weight_bytes_agree_with_what_placement_puts_on_a_device(preset):
    pipe = models.PRESETS[preset].build()
    facts = facts_of(preset, torch.float32)
    runtime = TorchaxRuntime(placement.make_mesh(MeshShape(2, 1, 4)))
    source, family = models.resolve_model(preset)
    placed = 0
    for transformer in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if transformer is not None:
            stats = placement.place_module(transformer, family.transformer_rules("megatron"), runtime.mesh, runtime.env)
            placed += stats["bytes_per_device"]
    assert facts.weight_bytes(4) == placed
    assert facts.weight_bytes(1) > placed


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, mesh, scheme",
    [("THUDM/CogVideoX-2b", (2, 2, 2), "ring"), ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", (2, 1, 4), "none")],
)
def test_published_models_plan_on_their_default_mesh(tmp_path, capsys, model, mesh, scheme):
    """No mesh flags: the default mesh compiles for a v6e-8 (CogVideoX-2b's 30 heads were a --tp 4 error).
    One small frame keeps the compile under a minute; the mesh does not depend on the video size."""
    out = tmp_path / "plan.json"
    video = ["--num_frames", 1, "--height", 96, "--width", 160]
    argv = ["--input_dir", tmp_path, "--model", model, "--plan", "v6e-8", "--plan_json", out]
    run_stage(stage2_transformer, [*argv, *video])
    report = json.loads(out.read_text())
    assert report["fits"] and report["mesh"] == dict(zip(("dp", "sp", "tp"), mesh, strict=True))
    assert report["mesh_choice"]["fits_estimate"] and report["splash_custom_calls"] > 0
    log = capsys.readouterr().out
    assert f"mesh dp {mesh[0]} x sp {mesh[1]} x tp {mesh[2]} (dp 2: the 2 CFG branches of one video;" in log
    assert scheme == "none" or f"sequence parallel: {scheme}" in log


@pytest.mark.parametrize(
    "videos, branches, memory_gib, flags, expected",
    [
        (3, 2, None, {}, 2),  # 3 videos x 2 branches cannot be one per device on 8: 2 videos on dp 4
        (4, 2, None, {}, 4),  # dp 8
        (9, 2, None, {}, 4),
        (8, 1, None, {}, 8),
        (4, 2, 32, {}, 2),  # 40 GiB of weights fit 85% of 32 GiB from tp 2 on: dp 4
        (4, 2, 16, {}, 1),  # from tp 4 on: dp 2 holds one video's two branches only
        (4, 2, None, {"tp": 4}, 1),
        (1, 2, None, {}, 1),
    ],
)
def test_default_batch_is_one_sample_per_device_within_the_memory_share(videos, branches, memory_gib, flags, expected):
    facts = ModelFacts(heads=8, split_bytes=((64, 40 * 2**30),))
    memory = memory_gib * 2**30 if memory_gib else None
    size, why = default_batch(videos, 8, branches=branches, model=facts, device_memory=memory, **flags)
    assert size == expected, why
    if size > 1:
        shape = default_mesh(8, branches=branches, model=facts, device_memory=memory, videos=size, **flags).shape
        assert shape.dp == size * branches and f"on {shape}" in why
