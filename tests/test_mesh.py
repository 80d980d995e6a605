"""The one default-mesh function (runtime.mesh.default_mesh): every published model on every listed TPU
slice, every tiny preset on 1 to 8 devices, the errors for flags that cannot work, and the weight bytes it
reasons with against what placement really puts on a device. Plain arithmetic, except the two compiled
plans at the end: the default meshes of two published models, built by the TPU compiler for a v6e-8.
"""

from __future__ import annotations

import json

import pytest
import torch

import models
import stage2_transformer
from helpers import run_stage
from models.meta import model_facts
from planning import tpus
from runtime import placement
from runtime.mesh import WEIGHT_SHARE, MeshShape, ModelFacts, default_batch, default_mesh, sp_mode_choice
from runtime.torchax_runtime import TorchaxRuntime

TOPOLOGIES = ("v5e-8", "v6e-8", "v5p-8", "tpu7x-8", "v6e-16")


def facts_of(model: str, dtype=torch.bfloat16) -> ModelFacts:
    source, family = models.resolve_model(model, configs_only=not model.startswith("tiny"))
    return model_facts(family, source, dtype, "megatron")


def assert_valid(choice, devices: int, facts: ModelFacts, cfg: bool, per_host: int) -> None:
    shape = choice.shape
    assert shape.size == devices
    assert facts.heads % shape.tp == 0 and all(dim % shape.tp == 0 for dim in facts.tp_dims)
    assert per_host % shape.tp == 0  # tp never spans hosts
    assert shape.dp <= (2 if cfg else 1)
    sp_mode_choice("auto", shape.as_dict(), facts.heads)  # raises where no scheme can run
    assert choice.why


@pytest.fixture(scope="module")
def published_facts():
    return {hub_id: facts_of(hub_id) for hub_id in models.PUBLISHED}


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_published_model_gets_a_valid_default_mesh(published_facts, topology, cfg):
    target = tpus.parse_target(topology)
    for hub_id, facts in published_facts.items():
        choice = default_mesh(
            target.devices,
            cfg=cfg,
            model=facts,
            devices_per_host=target.devices_per_host,
            device_memory=target.hbm_per_device,
        )
        assert_valid(choice, target.devices, facts, cfg, target.devices_per_host)
        assert choice.fits, (hub_id, choice.why)
        assert facts.weight_bytes(choice.shape.tp) <= WEIGHT_SHARE * target.hbm_per_device


def test_default_meshes_the_issue_named(published_facts):
    """CogVideoX-2b's 30 heads on a v6e-8 were an error (tp 4); Wan 2.2's two experts on a v5e-8 would fill
    3/4 of each 16 GiB chip at tp 4, so dp gives way and tp takes all 8."""
    v6e, v5e = tpus.parse_target("v6e-8"), tpus.parse_target("v5e-8")
    cog = default_mesh(8, cfg=True, model=published_facts["THUDM/CogVideoX-2b"], device_memory=v6e.hbm_per_device)
    assert cog.shape == MeshShape(2, 2, 2) and "ring attention" in cog.why
    wan22 = published_facts["Wan-AI/Wan2.2-T2V-A14B-Diffusers"]
    assert wan22.weight_bytes(4) > WEIGHT_SHARE * v5e.hbm_per_device
    choice = default_mesh(8, cfg=True, model=wan22, device_memory=v5e.hbm_per_device)
    assert choice.shape == MeshShape(1, 1, 8)
    assert "dp 1: the largest divisor of the 2 CFG branches of one video" in choice.why
    assert default_mesh(8, cfg=True, model=wan22, device_memory=None).shape == MeshShape(2, 1, 4)


@pytest.mark.parametrize("preset", sorted(models.PRESETS))
def test_every_preset_gets_a_valid_default_mesh_on_1_to_8_devices(preset):
    facts = facts_of(preset, torch.float32)
    for devices in range(1, 9):
        for cfg in (True, False):
            choice = default_mesh(devices, cfg=cfg, model=facts)
            assert_valid(choice, devices, facts, cfg, devices)
            assert choice.shape.dp == (2 if cfg and devices % 2 == 0 else 1)


def test_a_model_no_host_can_hold_is_still_given_its_most_split_mesh():
    facts = ModelFacts(heads=8, split_bytes=((64, 100 * 2**30),))
    choice = default_mesh(8, cfg=True, model=facts, device_memory=16 * 2**30)
    assert choice.shape == MeshShape(1, 1, 8) and not choice.fits
    assert "more than 75% of it on every mesh" in choice.why and choice.record()["weights_fit"] is False


@pytest.mark.parametrize(
    "flags, cfg, expected",
    [
        ({}, True, (2, 1, 4)),
        ({}, False, (1, 1, 8)),
        ({"sp": 2}, True, (2, 2, 2)),
        ({"tp": 8}, True, (1, 1, 8)),
        ({"dp": 1, "sp": 8}, True, (1, 8, 1)),
        ({"dp": 1}, True, (1, 1, 8)),
    ],
)
def test_given_axes_are_kept_and_the_rest_filled(flags, cfg, expected):
    assert default_mesh(8, **flags, cfg=cfg, model=ModelFacts(heads=8)).shape == MeshShape(*expected)


def test_heads_and_split_dimensions_bound_tp_and_sp_takes_the_rest():
    assert default_mesh(6, cfg=True, model=ModelFacts(heads=8)).shape == MeshShape(2, 3, 1)
    assert default_mesh(7, cfg=True, model=ModelFacts(heads=8)).shape == MeshShape(1, 7, 1)
    # 12 heads but an MLP width of 8960 = 2**8 x 35: tp 4, not 6 or 12
    facts = ModelFacts(heads=12, split_bytes=((1536, 10), (8960, 10)))
    assert default_mesh(12, cfg=False, model=facts).shape == MeshShape(1, 3, 4)


def test_tp_stays_within_a_host():
    """16 devices on 4 hosts: tp takes one host's 4 and the rest goes on sp; tp 8 is refused."""
    facts = ModelFacts(heads=8)
    assert default_mesh(16, cfg=True, model=facts, devices_per_host=4).shape == MeshShape(2, 2, 4)
    assert default_mesh(8, cfg=True, model=facts, devices_per_host=4).shape == MeshShape(2, 1, 4)
    with pytest.raises(ValueError, match="tp 8 would span hosts .*a mesh that works: dp 2 x sp 2 x tp 4"):
        default_mesh(16, dp=2, tp=8, cfg=True, model=facts, devices_per_host=4)


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
        default_mesh(8, **flags, cfg=True, model=ModelFacts(heads=heads))


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
    assert report["mesh_choice"]["weights_fit"] and report["splash_custom_calls"] > 0
    log = capsys.readouterr().out
    assert f"mesh dp {mesh[0]} x sp {mesh[1]} x tp {mesh[2]} (dp 2: the 2 CFG branches of one video;" in log
    assert scheme == "none" or f"sequence parallel: {scheme}" in log


@pytest.mark.parametrize(
    "videos, cfg, memory_gib, flags, expected",
    [
        (3, True, None, {}, 2),  # 3 videos x 2 branches cannot be one per device on 8: 2 videos on dp 4
        (4, True, None, {}, 4),  # dp 8
        (9, True, None, {}, 4),
        (8, False, None, {}, 8),
        (4, True, 32, {}, 2),  # 40 GiB of weights fit 75% of 32 GiB from tp 2 on: dp 4
        (4, True, 16, {}, 1),  # from tp 4 on: dp 2 holds one video's two branches only
        (4, True, None, {"tp": 4}, 1),
        (1, True, None, {}, 1),
    ],
)
def test_default_batch_is_one_sample_per_device_with_the_weights_within_their_share(
    videos, cfg, memory_gib, flags, expected
):
    facts = ModelFacts(heads=8, split_bytes=((64, 40 * 2**30),))
    memory = memory_gib * 2**30 if memory_gib else None
    size, why = default_batch(videos, 8, cfg=cfg, model=facts, device_memory=memory, **flags)
    assert size == expected, why
    if size > 1:
        shape = default_mesh(8, cfg=cfg, model=facts, device_memory=memory, videos=size, **flags).shape
        assert shape.dp == size * (2 if cfg else 1) and f"on {shape}" in why
