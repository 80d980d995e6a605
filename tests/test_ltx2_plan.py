"""LTX-2's programs compiled for a TPU by libtpu (`--plan`): stage 2 with every guidance pass and its per-block
collectives, stage 3 from configs alone, stage 1's Gemma and text connectors from a folder and from configs kept in
code, the connectors' attention split over tp. Stage 1 with conditions: tests/test_ltx2_conditions.py."""

from __future__ import annotations

import json

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import run_stage
from tpu_video import models


def test_the_plan_compiles_all_four_passes_on_dp_for_v6e_with_the_real_splash_kernel(tmp_path, four_block_ltx2):
    """The TPU compiler (libtpu) builds stage 2 of a 4-block tiny LTX-2.3 with every guidance pass on dp 4, its
    blocks under one scan, STG on block 3. Per block (tensors): only the 20 all-reduces of tp (6 attention
    outputs, 2 MLP outputs, 12 q/k norm statistics); with the modulation linears split on their input there
    were also 9 all-gathers and 20 permutes. The 2- and 3-block copies that count them run the same four
    passes (block 3 is beyond their depth: before, the plan refused the flag there, and a default STG block
    beyond their depth dropped their STG pass, so the counts outside the blocks came out negative)."""
    out = tmp_path / "plan.json"
    argv = ["--input_dir", tmp_path, "--model", four_block_ltx2, "--stg_blocks", "3", "--plan", "v6e:2x4"]
    argv += ["--height", 64, "--width", 64, "--num_frames", 9]
    run_stage(stage2_transformer, [*argv, "--plan_json", out])
    report = json.loads(out.read_text())
    assert report["fits"] and report["mesh"] == {"dp": 4, "sp": 1, "tp": 2}
    assert report["splash_custom_calls"] >= 1 and report["flops_per_device"]["attention"] > 0
    per_block = {op: value["tensors"] for op, value in report["collectives"]["per_block"].items()}
    assert per_block == {"all-reduce": 20}
    assert report["collectives"]["scanned_blocks"] == 4
    # Outside the blocks (the full program less 4 blocks' worth), as libtpu 0.0.42.1 compiled it on 2026-11-27;
    # a miscounted block makes these differ (before the fix above, they came out negative).
    outside = {op: (value["count"], value["tensors"]) for op, value in report["collectives"]["outside_blocks"].items()}
    assert outside == {"all-reduce": (4, 11), "collective-permute": (6, 24)}


def test_stage3_plans_from_configs_alone(tmp_path, monkeypatch):
    """Stage 3's --plan reaches stage 2's de-normalisation, which reads no statistics when planning (no
    checkpoint file is opened, no component loaded)."""
    from tpu_video.models.ltx2 import latents as ltx2_latents

    def no_weights(*args, **kwargs):
        raise AssertionError("a plan read weights")

    # Not safetensors.safe_open itself: a library module first imported under the patch would keep it.
    monkeypatch.setattr(ltx2_latents, "_checkpoint_statistics", no_weights)
    monkeypatch.setattr(models.ModelSource, "load", no_weights)
    out = tmp_path / "plan.json"
    argv = ["--input_dir", tmp_path, "--model", "tiny-ltx2", "--plan", "v6e-8", "--plan_json", out]
    run_stage(stage3_vae_decoder, argv)  # an empty folder: nothing of a previous run in ./stage_outputs is read
    report = json.loads(out.read_text())
    assert report["fits"] and report["latents"] == [1, 8, 3, 4, 6]
    assert report["soundtrack"] == {"runs_on": "host", "audio_latents": [1, 2, 9, 2]}


def configs_kept_in_code(folder) -> dict:
    """A pipeline folder's configs as a published pipeline's entry (tpu_video/models/<family>/published.py's form): what
    `--plan` of a hub id reads, without the network, weights or tokenizer files."""
    index = json.loads((folder / "model_index.json").read_text())
    entry: dict = {"_class_name": ("diffusers", index["_class_name"])}
    for component, (library, class_name) in [(k, v) for k, v in index.items() if isinstance(v, list) and v[0]]:
        cls = models.library_class(library, class_name)
        if hasattr(cls, "config_name"):  # diffusers models and schedulers
            config = json.loads((folder / component / cls.config_name).read_text())
        elif hasattr(cls, "config_class"):  # transformers models
            config = cls.config_class.from_pretrained(folder / component).to_dict()
        else:  # tokenizers: not kept
            continue
        entry[component] = (library, class_name, {k: v for k, v in config.items() if not k.startswith("_")})
    return entry


def test_stage1_plans_gemma_and_the_connectors_also_from_configs_kept_in_code(tmp_path, monkeypatch):
    """Stage 1's --plan compiles Gemma 3's language model (the prompt's and the negative prompt's encodes)
    and the text connectors (one call on both; their rotary tables are inputs). A hub id plans from its configs
    kept in code (no weights, no tokenizer: tiny-ltx2's stands in) as its folder does: here tiny-ltx2's own
    configs under a hub id, so the programs must be the preset's."""
    configs = configs_kept_in_code(models.materialize_preset("tiny-ltx2"))
    monkeypatch.setitem(models.PUBLISHED, "Lightricks/tiny", configs)
    reports = []
    for model in ("tiny-ltx2", "Lightricks/tiny"):
        out = tmp_path / "plan.json"
        argv = ["--model", model, "--prompt", "a dog barking", "--plan", "v6e-8", "--plan_json", out]
        run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path / "unused"])
        reports.append(json.loads(out.read_text()))
    preset, published = reports
    assert preset["fits"] and preset["stage"] == 1 and preset["mesh"] == {"dp": 1, "sp": 1, "tp": 8}
    tables = ", ".join(["[2, 2, 1024, 4]"] * 4)  # each connector's (cos, sin)
    gemma = "Gemma3TextModel ([1, 1024], [1, 1024])"
    connectors = f"LTX2TextConnectors ([2, 1024, 48], [2, 1024], {tables})"
    assert preset["programs"] == [gemma, connectors] and preset["calls"] == {gemma: 2, connectors: 1}
    assert "all-reduce" in preset["collectives"][connectors]  # split over tp (tpu_video/models/ltx2/connectors.py)
    assert not (tmp_path / "unused").exists()
    assert published["model"] == "Lightricks/tiny" and published["stand_ins"] == {"tokenizer": "tiny-ltx2's tokenizer"}
    assert "stand_ins" not in preset
    for key in ("programs", "calls", "hbm_bytes_per_device", "flops_per_device", "collectives"):
        assert published[key] == preset[key], key


def test_stage1_connectors_with_heads_on_tp_gather_nothing(tmp_path):
    """tiny-ltx2.3's connectors (8 heads) split their attention over tp 8; their attention runs as the attention
    plan's XLA einsums, so the [negative, prompt] batch and the split heads stay apart and nothing is gathered
    (torchax's own SDPA lowering gathered q, k and v whole: 6 all-gathers here, 48 for the published LTX-2.3)."""
    out = tmp_path / "plan.json"
    argv = ["--model", "tiny-ltx2.3", "--prompt", "a dog barking", "--plan", "v6e-8", "--plan_json", out]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path / "unused"])
    report = json.loads(out.read_text())
    connectors = next(name for name in report["programs"] if name.startswith("LTX2TextConnectors"))
    assert set(report["collectives"][connectors]) == {"all-reduce"}, report["collectives"][connectors]
