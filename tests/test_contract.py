"""The stage-file contract in seconds: checked tensor files, the config, the request and checkpoints.

Unit tests of utils.py and tpu_video/engine/denoise.py's checkpoints, without running a model, so a change to the
contract fails here first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tpu_video import models
from tpu_video.cli import UserError
from tpu_video.engine.guard import DenoiseGuard
from utils import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    FORMAT_VERSION,
    Request,
    check_stage2_fresh,
    describe_folder,
    earlier_overrides,
    read_config,
    read_tensors,
    write_config,
    write_stage_config,
    write_tensors,
)

REQUEST = {
    "model_family": "cogvideox",
    "model_id": "tiny-cogvideox",
    "prompt": "a cat",
    "negative_prompt": "",
    "dtype": "fp32",
    "height": 64,
    "width": 96,
    "num_frames": 9,
    "fps": 8,
    "num_inference_steps": 4,
    "guidance_scale": 6.0,
    "seed": 7,
}


def test_tensors_round_trip_in_their_own_dtype(tmp_path):
    tensors = {"prompt_embeds": torch.randn(1, 4, 8).to(torch.bfloat16), "mask": torch.tensor([[1, 0]])}
    record = write_tensors(tmp_path / "t.safetensors", tensors)
    assert record["tensors"] == {
        "prompt_embeds": {"shape": [1, 4, 8], "dtype": "bfloat16"},
        "mask": {"shape": [1, 2], "dtype": "int64"},
    }
    back = read_tensors(tmp_path, record)
    assert all(torch.equal(back[name], tensors[name]) and back[name].dtype == tensors[name].dtype for name in tensors)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda path, record: path.unlink(), "is missing"),
        (lambda path, record: path.write_bytes(path.read_bytes()[:-4]), "does not match the sha256"),
        (lambda path, record: record["tensors"]["latents"].update(shape=[1, 2]), "tensor 'latents' is"),
        (lambda path, record: record["tensors"].update(other={"shape": [1], "dtype": "float32"}), "has no tensor"),
    ],
    ids=["missing", "truncated", "shape", "name"],
)
def test_read_tensors_names_the_file_and_the_problem(tmp_path, breakage, message):
    record = write_tensors(tmp_path / "t.safetensors", {"latents": torch.zeros(1, 3)})
    breakage(tmp_path / "t.safetensors", record)
    with pytest.raises(UserError, match=message):
        read_tensors(tmp_path, record)


@pytest.mark.parametrize(
    "text, needs, message",
    [
        (None, "stage1", "is missing (run stage1_text_encoder.py first)"),
        ("{not json", None, "is not valid JSON"),
        (json.dumps({"format_version": FORMAT_VERSION + 1}), None, "written by a newer version"),
        (json.dumps({"prompt": "x"}), None, "has format_version None; this tool reads format_version 1, 2"),
        (json.dumps({"format_version": FORMAT_VERSION}), "stage2", "has no 'stage2' section"),
    ],
    ids=["missing", "not-json", "newer", "no-version", "no-section"],
)
def test_read_config_errors(tmp_path, text, needs, message):
    if text is not None:
        (tmp_path / CONFIG_FILE).write_text(text)
    with pytest.raises(UserError, match=re.escape(message)):
        read_config(tmp_path, needs=needs)


def test_request_round_trips_through_the_config_and_keeps_other_sections(tmp_path):
    request = Request(**REQUEST)
    made_from = {"file": "x", "stage1_sha256": "abc"}  # from these embeddings: kept
    write_stage_config(tmp_path, request, {"stage2": made_from}, "stage1", {"file": "y", "sha256": "abc"})
    config = read_config(tmp_path, needs="stage1")
    assert Request.from_config(config) == request
    assert list(config)[-2:] == ["stage2", "stage1"] and "flow_shift" not in config  # unset extras left out


def test_overrides_stay_and_a_later_run_records_what_it_kept():
    """A plain rerun after `--seed 8` runs seed 8 (the folder's request) and records it as kept from an earlier
    override, against the request stage 1 recorded in its section."""
    stage1 = Request(**REQUEST)
    config = {"stage1": {"request": stage1.to_config()}}
    overridden, overrides = stage1.with_overrides({"seed": 8})
    assert earlier_overrides(config, overridden, overrides) == {}  # this run's own override
    rerun, overrides = overridden.with_overrides({"num_inference_steps": 2})
    assert earlier_overrides(config, rerun, overrides) == {"seed": [7, 8]}
    assert earlier_overrides({"stage1": {}}, rerun, overrides) == {}  # stage 1 before it recorded its request


def test_a_later_stage_names_the_folder_it_reads_and_what_it_holds(tmp_path):
    write_stage_config(tmp_path, Request(**REQUEST), {}, "stage1", {"file": "y"})
    line = describe_folder(tmp_path, read_config(tmp_path, needs="stage1"))
    assert line.startswith(f'reading {tmp_path}: cogvideox tiny-cogvideox, prompt "a cat", stage1 written by 20')


def test_request_overrides_are_applied_and_recorded():
    request, overrides = Request(**REQUEST).with_overrides({"seed": 8, "fps": None, "height": 64})
    assert request.seed == 8 and overrides == {"seed": [7, 8]}  # None: not given; 64: unchanged
    wan = Request.from_values({**REQUEST, "model_family": "wan", "scheduler": "unipc"})
    changed, overrides = wan.with_overrides({"scheduler": "euler", "guidance_scale_2": 2.0, "stg_scale": None})
    assert changed.options == {"scheduler": "euler", "guidance_scale_2": 2.0}
    assert overrides == {"scheduler": ["unipc", "euler"], "guidance_scale_2": [None, 2.0]}


def test_family_options_are_stored_beside_the_shared_keys_and_retired_keys_dropped(tmp_path):
    """A family's options are top-level keys of the config, as before they left Request; CogVideoX's
    "variant", which older stage 1s wrote and nothing read, is dropped on read."""
    request = Request.from_values({**REQUEST, "model_family": "ltx2", "stg_blocks": "2", "motion_speed": 1.5})
    assert request.options == {"stg_blocks": "2", "motion_speed": 1.5} and request.option("stg_scale") is None
    write_stage_config(tmp_path, request, {}, "stage1", {"file": "y"})
    config = read_config(tmp_path, needs="stage1")
    assert config["stg_blocks"] == "2" and config["motion_speed"] == 1.5
    assert Request.from_config(config) == request
    assert Request.from_config({**config, "variant": "1.5"}) == request
    assert request.fingerprint()["motion_speed"] == 1.5 and "stg_scale" not in request.fingerprint()


@pytest.mark.parametrize(
    "model, options, message",
    [
        ("tiny-cogvideox", {"guidance_scale_2": 2.0}, "--guidance_scale_2 is an option of wan (Wan 2.2 A14B"),
        ("tiny-wan2.1", {"stg_scale": 2.0}, "--stg_scale is an option of ltx2"),
        ("tiny-wan2.1", {"shoe_size": 2}, "the request holds 'shoe_size', which no model family takes"),
        ("tiny-wan2.1", {"scheduler": 3}, "scheduler is 3 in the request; it must be a string"),
        ("tiny-wan2.1", {"scheduler": "ddim"}, "--scheduler 'ddim' is not one of unipc, euler"),
        ("tiny-ltx2", {"stg_scale": "2"}, 'stg_scale is "2" in the request; it must be a number'),
    ],
)
def test_a_family_takes_its_own_options_only_and_of_their_types(model, options, message):
    source, family = models.resolve_model(model, configs_only=True)
    values = {**REQUEST, **family.request_defaults(source), "model_family": family.NAME, "model_id": model}
    request = Request.from_values({**values, **options})
    with pytest.raises(UserError, match=re.escape(message)):
        models.validate_request(family, source, request)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_inference_steps": 0}, "--num_inference_steps 0 must be at least 1"),
        ({"fps": 0}, "--fps 0 must be from 1 to 1000"),
        ({"dtype": "float64"}, "--dtype 'float64' is not one of"),
    ],
)
def test_request_checks_what_every_family_shares(change, message):
    with pytest.raises(UserError, match=message):
        Request(**{**REQUEST, **change})


def test_guidance_scales_may_be_any_finite_number():
    """Each pipeline decides what a scale means (CFG on above 1); a negative one is the user's to try."""
    assert Request(**{**REQUEST, "guidance_scale": -3.5}).guidance_scale == -3.5


def test_request_missing_from_a_config_is_a_user_error():
    with pytest.raises(UserError, match=r"lacks the request keys \['seed'\]"):
        Request.from_config({key: value for key, value in REQUEST.items() if key != "seed"})


def test_stage2_staleness_follows_what_the_latents_depend_on():
    request = Request(**REQUEST)
    folder = Path("stage_outputs")
    config = {
        "stage1": {"sha256": "a"},
        "stage2": {
            "stage1_sha256": "a",
            "request": request.fingerprint(),
            "latents_scaled_by_vae_scaling_factor": True,
        },
    }
    config["stage2"]["latents_scaled_by_vae_scaling_factor"] = True
    check_stage2_fresh(folder, config, request.with_overrides({"fps": 24})[0])  # fps: the mp4 only
    with pytest.raises(UserError, match=r"stale.*\(seed changed\)"):
        check_stage2_fresh(folder, config, request.with_overrides({"seed": 8})[0])
    config["stage1"]["sha256"] = "b"
    with pytest.raises(UserError, match=r"stale.*\(embeddings changed\)"):
        check_stage2_fresh(folder, config, request)


def test_stage2_staleness_sees_an_option_added_or_dropped_and_not_an_older_null_or_a_stage1_option():
    wan = Request.from_values({**REQUEST, "model_family": "wan", "flow_shift": 3.0})
    config = {"stage1": {"sha256": "a"}, "stage2": {"stage1_sha256": "a", "request": wan.fingerprint()}}
    config["stage2"]["latents_normalization"] = {"method": "mean_std"}
    added = wan.with_overrides({"scheduler": "euler"})[0]  # stage 1 rerun with the same prompt and a new flag
    with pytest.raises(UserError, match=r"\(scheduler changed\)"):
        check_stage2_fresh(Path("f"), config, added)
    config["stage2"]["request"] = added.fingerprint()
    with pytest.raises(UserError, match=r"\(scheduler changed\)"):  # and dropped again
        check_stage2_fresh(Path("f"), config, wan)
    config["stage2"]["request"] = {**wan.fingerprint(), "scheduler": None, "stg_scale": None}  # an older stage 2
    check_stage2_fresh(Path("f"), config, wan)
    crf = Request.from_values({**REQUEST, "model_family": "ltx2", "image_crf": 33})
    config["stage2"]["request"] = crf.fingerprint(["image_crf"])  # a stage-1 option: the embeddings cover it
    assert "image_crf" not in config["stage2"]["request"]
    check_stage2_fresh(Path("f"), config, crf, ["image_crf"])


def test_checkpoint_round_trip_and_fingerprint(tmp_path):
    fingerprint = Request(**REQUEST).fingerprint()
    state = {"latents": torch.randn(1, 4, 2, 3, 3), "generator_state": torch.Generator().manual_seed(1).get_state()}
    DenoiseGuard(tmp_path, fingerprint).save(3, state)
    step, restored = DenoiseGuard(tmp_path, fingerprint, resume=True).restored
    assert step == 3 and restored.keys() == state.keys()
    assert all(torch.equal(restored[name], state[name]) for name in state)

    with pytest.raises(UserError, match=r"belongs to a different request or stage-1 file \(seed differs\)"):
        DenoiseGuard(tmp_path, {**fingerprint, "seed": 8}, resume=True)
    # A stage 2 from before the options left Request recorded every family's keys, null where unset.
    DenoiseGuard(tmp_path, {**fingerprint, "stg_scale": None, "scheduler": None}).save(3, state)
    assert DenoiseGuard(tmp_path, fingerprint, resume=True).restored[0] == 3
    with pytest.raises(UserError, match=r"\(scheduler differs\)"):
        DenoiseGuard(tmp_path, {**fingerprint, "scheduler": "euler"}, resume=True)
    DenoiseGuard(tmp_path, fingerprint).finished()
    assert not (tmp_path / CHECKPOINT_FILE).exists()
    with pytest.raises(UserError, match="there is no checkpoint"):
        DenoiseGuard(tmp_path, fingerprint, resume=True)


def test_config_writes_are_atomic_and_readable(tmp_path):
    write_config(tmp_path, {"format_version": FORMAT_VERSION, "prompt": "x"})
    assert [path.name for path in tmp_path.iterdir()] == [CONFIG_FILE]  # no temp file left behind
    assert read_config(tmp_path)["prompt"] == "x"


def test_a_new_output_removes_the_later_outputs_made_from_the_old_one(tmp_path, capsys):
    """Stage 2 rerun to the same latents keeps stage 3's video; another seed removes it (and its section);
    stage 1 with another prompt removes the latents too. Nothing else in the folder is touched."""
    import stage1_text_encoder
    import stage2_transformer
    import stage3_vae_decoder
    from helpers import run_stage, three_stages

    out = tmp_path / "run"
    stage1 = ["--model", "tiny-cogvideox", "--prompt", "a red cat", "--dtype", "fp32"]
    three_stages(out, stage1)
    (out / "notes.txt").write_text("mine")
    video = {"output_video.mp4", "output_video_preview.png", "output_video_frames.safetensors"}
    assert video <= {path.name for path in out.iterdir()}
    run_stage(stage2_transformer, ["--input_dir", out])  # the same latents, bit for bit
    assert video <= {path.name for path in out.iterdir()} and "stage3" in read_config(out)
    run_stage(stage2_transformer, ["--input_dir", out, "--seed", "9"])
    assert not video & {path.name for path in out.iterdir()} and "stage3" not in read_config(out)
    assert "stage 3's outputs from what stage 2 wrote before" in capsys.readouterr().out
    run_stage(stage3_vae_decoder, ["--input_dir", out])
    run_stage(stage1_text_encoder, [*stage1, "--prompt", "a blue dog", "--output_dir", out])
    left = {path.name for path in out.iterdir()}
    assert left == {"generation_config.json", "stage1_embeddings.safetensors", "notes.txt"}
    assert set(read_config(out)) & {"stage2", "stage3"} == set()


def test_a_stage_2_into_another_folder_judges_that_folders_own_outputs(tmp_path):
    """Stage 2 with --output_dir keeps the input folder's stage-3 section out of the output folder (its files
    are not there) and removes only the output folder's own stale video; a file no section names is kept."""
    import stage2_transformer
    import stage3_vae_decoder
    from helpers import run_stage, three_stages

    inputs, other, mine = tmp_path / "in", tmp_path / "other", tmp_path / "mine"
    three_stages(inputs, ["--model", "tiny-cogvideox", "--prompt", "a red cat", "--dtype", "fp32"])
    mine.mkdir()
    (mine / "output_video.mp4").write_bytes(b"the user's own file")
    run_stage(stage2_transformer, ["--input_dir", inputs, "--output_dir", mine, "--seed", "3"])
    assert (mine / "output_video.mp4").read_bytes() == b"the user's own file" and "stage3" not in read_config(mine)
    run_stage(stage2_transformer, ["--input_dir", inputs, "--output_dir", other, "--seed", "7"])
    run_stage(stage3_vae_decoder, ["--input_dir", other])
    run_stage(stage2_transformer, ["--input_dir", inputs, "--output_dir", other, "--seed", "7"])  # the same latents
    assert (other / "output_video.mp4").is_file() and "stage3" in read_config(other)
    run_stage(stage2_transformer, ["--input_dir", inputs, "--output_dir", other])  # seed 42: the input's latents
    assert not (other / "output_video.mp4").exists() and "stage3" not in read_config(other)
    assert (inputs / "output_video.mp4").is_file() and "stage3" in read_config(inputs)
