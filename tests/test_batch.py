"""Many videos per run (tpu_video/engine/batch_folders.py). Stage 1: a prompt list or a seed sweep writes one stage
folder per entry, each what a single stage-1 run with that entry's flags writes (embeddings bit-identical, the config
equal but for the timing table), and a batch.json listing them; bad entries are one `error:` naming the line, before any
weights load, with nothing written. Stage 3: several folders, or a batch folder, decoded with one loaded VAE, each as a
single run decodes it."""

from __future__ import annotations

import json

import pytest
import torch

import stage1_text_encoder
import stage3_vae_decoder
from helpers import expect_user_error, relative_error, run_script, run_stage
from tpu_video.cli import UserError
from tpu_video.engine import batch_folders
from utils import read_config, read_tensors

MODEL = "tiny-wan2.1"
# What a batched folder's stage-1 section may differ in from its single run's: the timing table (the
# batch's first folder also holds the one encoder load).
STAGE1_EXCLUDED = ("seconds",)


def stage1_outputs(folder):
    config = read_config(folder, needs="stage1")
    tensors = read_tensors(folder, config["stage1"])
    section = {key: value for key, value in config["stage1"].items() if key not in STAGE1_EXCLUDED}
    return tensors, {**config, "stage1": section}


def test_prompt_list_folders_equal_single_runs(tmp_path):
    entries = [
        {"prompt": "a cat on a sofa", "seed": 3},
        {"prompt": "a dog in the rain", "negative_prompt": "blurry", "name": "dog"},
        {"prompt": "a red kite", "seed": 11, "negative_prompt": "dark"},
    ]
    listing = tmp_path / "list.jsonl"
    listing.write_text("# three videos\n\n" + "\n".join(json.dumps(entry) for entry in entries) + "\n")
    out = tmp_path / "batch"
    run_stage(stage1_text_encoder, ["--model", MODEL, "--prompts", listing, "--output_dir", out, "--seed", 5])
    index = json.loads((out / batch_folders.BATCH_FILE).read_text())
    assert [video["folder"] for video in index["videos"]] == ["000", "dog", "002"]
    for position, (entry, video) in enumerate(zip(entries, index["videos"], strict=True)):
        single = tmp_path / f"single{position}"
        flags = ["--prompt", entry["prompt"], "--seed", entry.get("seed", 5)]
        flags += ["--negative_prompt", entry["negative_prompt"]] if "negative_prompt" in entry else []
        run_stage(stage1_text_encoder, ["--model", MODEL, "--output_dir", single, *flags])
        (got_tensors, got_config), (want_tensors, want_config) = (
            stage1_outputs(out / video["folder"]),
            stage1_outputs(single),
        )
        assert got_tensors.keys() == want_tensors.keys()
        assert all(torch.equal(got_tensors[key], want_tensors[key]) for key in want_tensors)
        assert got_config == want_config
    assert batch_folders.expand_folders([str(out)]) == [out / "000", out / "dog", out / "002"]


def test_seed_sweep_and_plain_text_list(tmp_path):
    out = tmp_path / "sweep"
    run_stage(stage1_text_encoder, ["--model", MODEL, "--prompt", "a cat", "--seeds", "1,3-4", "--output_dir", out])
    seeds = [read_config(folder)["seed"] for folder in batch_folders.expand_folders([str(out)])]
    assert seeds == [1, 3, 4]
    listing = tmp_path / "list.txt"
    listing.write_text("a cat\n# a comment\n\n  a dog  \n")
    out = tmp_path / "plain"
    run_stage(stage1_text_encoder, ["--model", MODEL, "--prompts", listing, "--output_dir", out])
    prompts = [read_config(folder)["prompt"] for folder in batch_folders.expand_folders([str(out)])]
    assert prompts == ["a cat", "a dog"]


def test_lines_end_at_newlines_and_a_byte_order_mark_is_not_text(tmp_path):
    """U+2028, U+0085, form feeds and the like stay inside their prompt (in plain text and in JSON strings),
    CRLF is one line end, and a list saved with a UTF-8 BOM reads as the same list without it."""
    entries = [{"prompt": "a cat\u2028sleeping\x85on a mat\x0cat noon", "seed": 3}, {"prompt": "a dog", "seed": 4}]
    lines = [json.dumps(entry, ensure_ascii=False) for entry in entries]
    for suffix, text in ((".jsonl", "\r\n".join(lines) + "\r\n"), (".txt", "\r\n".join(lines))):
        plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
        plain.write_text(text, encoding="utf-8", newline="")
        marked.write_text(text, encoding="utf-8-sig", newline="")
        for listing in (plain, marked):
            assert [(e.prompt, e.seed) for e in batch_folders.read_prompt_list(listing)] == [
                (entry["prompt"], entry["seed"]) for entry in entries
            ], listing
    plain = tmp_path / "plain.txt"
    plain.write_text("a cat\u2028on a mat\r\na dog\n", encoding="utf-8")
    assert [entry.prompt for entry in batch_folders.read_prompt_list(plain)] == ["a cat\u2028on a mat", "a dog"]


def test_a_list_of_more_than_ten_thousand_is_refused_before_reading_entries(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("a cat\n" * (batch_folders.MAX_VIDEOS + 1))
    with pytest.raises(UserError, match="lists 10001 videos; a run makes at most 10000"):
        batch_folders.read_prompt_list(listing)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a cat"}', '{"prompt": ""}'], "line 2: the prompt is empty"),
        (['{"prompt": "a cat", "image": "missing.png"}'], "line 1: image"),
        (['{"prompt": "a cat"}', "", '{"prompt": "a dog", "seed": "7"}'], "line 3: 'seed' must be an integer"),
        (['{"prompt": "a", "name": "x"}', '{"prompt": "b", "name": "x"}'], "line 2: name 'x' is already used by"),
        (['{"prompt": "a cat"}', '{"prompt": "a dog",}'], "line 2: not a JSON object"),
        (['{"prompt": "a cat", "steps": 4}'], "line 1: unknown key(s) steps"),
        (['{"prompt": "a cat", "seed": -1}'], "line 1: --seed -1 must be from 0"),
        (['{"prompt": "a", "name": "ok"}', '{"prompt": "b", "name": "a\\u0000b"}'], "line 2: name 'a\\x00b' cannot"),
        (['{"prompt": "a", "name": "ok"}', json.dumps({"prompt": "b", "name": "x" * 256})], "256 bytes in UTF-8"),
        (['{"prompt": "a", "name": "\\ud800"}'], "holds a lone surrogate"),
        (['{"prompt": "a", "name": "a/b"}'], "holds a slash, a NUL or another control character"),
    ],
)
def test_bad_list_entries_name_the_line_and_write_nothing(capsys, tmp_path, lines, message):
    listing = tmp_path / "list.jsonl"
    listing.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    expect_user_error(
        capsys, stage1_text_encoder, ["--model", MODEL, "--prompts", listing, "--output_dir", out], message
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt", "a", "--seeds", "1,x"], "'x' is not a seed or a range"),
        (["--prompt", "a", "--seeds", "5-3"], "runs backwards"),
        (["--prompt", "a", "--seeds", "1,1"], "a seed appears twice"),
        (["--prompt", "a", "--seeds", "1", "--seed", "2"], "give one seed or a sweep"),
        (["--prompt", "a", "--seeds", "0-18446744073709551616"], "is past the largest seed, 18446744073709551615"),
        (["--prompt", "a", "--seeds", "0-18446744073709551615"], "asks for 18446744073709551616 videos; a run makes"),
        (["--prompt", "a", "--seeds", "1-5000,10001-15001"], "asks for 10001 videos; a run makes at most 10000"),
        ([], "the prompt is missing"),
    ],
)
def test_bad_sweeps(capsys, tmp_path, flags, message):
    expect_user_error(capsys, stage1_text_encoder, ["--model", MODEL, "--output_dir", tmp_path / "o", *flags], message)
    assert not (tmp_path / "o").exists()


def test_stage3_decodes_a_batch_folder_with_one_vae(capsys, tmp_path):
    import stage2_transformer

    out = tmp_path / "batch"
    argv = ["--model", MODEL, "--prompt", "a cat", "--seeds", "1-2", "--output_dir", out, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, argv)
    folders = batch_folders.expand_folders([str(out)])
    for folder in folders:  # stage 2 one folder at a time (its batching is tested elsewhere)
        run_stage(stage2_transformer, ["--input_dir", folder, "--num_inference_steps", 1])
    single = tmp_path / "single"
    run_stage(
        stage3_vae_decoder, ["--input_dir", folders[1], "--output_dir", single, "--backend", "torch", "--save_frames"]
    )
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    sections = [read_config(folder, needs="stage3")["stage3"] for folder in (*folders, single)]
    frames = [
        read_tensors(folder, section["frames_file"])["frames"]
        for folder, section in zip((*folders, single), sections, strict=True)
    ]
    assert torch.equal(frames[1], frames[2]) and not torch.equal(frames[0], frames[1])
    assert "load" in sections[0]["seconds"] and "load" not in sections[1]["seconds"]  # one VAE for both
    argv = ["--input_dir", *folders, "--output_dir", tmp_path / "x", "--backend", "torch"]
    expect_user_error(capsys, stage3_vae_decoder, argv, "with several input folders each video is written into its own")
    expect_user_error(capsys, stage3_vae_decoder, ["--input_dir", out, folders[0]], "named twice in the input folders")


# Stage 2 --------------------------------------------------------------------------------------------------

# What a batched folder's stage-2 section may differ in from its single run's: the batch record, timings,
# the mesh (chosen for the batch), its placement and the devices it ran on, and the compile cache's and the
# executable store's counts.
STAGE2_EXCLUDED = (
    "sha256",  # the latents agree within the tolerance, not bit for bit
    "batch",
    "seconds",
    "step_seconds",
    "mesh_choice",
    "mesh",
    "placement",
    "compile_cache",
    "executables",
    "sequence_parallel",
    "device_count",  # the batch of 3 runs on one device
)
ENTRIES = [
    {"prompt": "a cat on a sofa", "seed": 3},
    {"prompt": "a dog in the rain", "negative_prompt": "blurry", "seed": 4},
    {"prompt": "a red kite", "negative_prompt": "dark", "seed": 11},
]


def stage1_batch(tmp_path, model, name="batch", extra=()):
    listing = tmp_path / f"{name}.jsonl"
    listing.write_text("\n".join(json.dumps(entry) for entry in ENTRIES) + "\n")
    out = tmp_path / name
    argv = ["--model", model, "--prompts", listing, "--output_dir", out, "--dtype", "fp32", *extra]
    run_stage(stage1_text_encoder, argv)
    return out


def stage2_outputs(folder):
    config = read_config(folder, needs="stage2")
    latents = read_tensors(folder, config["stage2"])["latents"]
    section = {key: value for key, value in config["stage2"].items() if key not in STAGE2_EXCLUDED}
    return latents, {**config, "stage2": section}


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-hunyuanvideo15"])
def test_batched_videos_equal_their_single_runs(tmp_path, model):
    """3 videos with different prompts, negative prompts and seeds: alone (8 CPU devices, the default mesh),
    batched 3 at a time on one device (CogVideoX; a process of one CPU device, 6 samples on it) and 2 at a
    time on 4x1x2 (the second batch padded): latents within 1e-5 relative, configs equal but for
    `STAGE2_EXCLUDED`."""
    import shutil

    import stage2_transformer

    out = stage1_batch(tmp_path, model)
    folders = batch_folders.expand_folders([str(out)])
    steps = ["--num_inference_steps", 2, "--warmup_steps", 0]
    singles = []
    for folder in folders:
        single = tmp_path / f"single-{folder.name}"
        shutil.copytree(folder, single)
        run_stage(stage2_transformer, ["--input_dir", single, *steps])
        singles.append(stage2_outputs(single))
    # --batch_size 5 for 3 videos: one batch of 3, not padded with 2 copies; 2: a padded second batch
    runs = {"3": ["--batch_size", 5], "2": ["--batch_size", 2, "--dp", 4, "--tp", 2]}
    if model == "tiny-hunyuanvideo15":  # the suite's time: the padded batches on 4x1x2 only
        del runs["3"]
    for name, flags in runs.items():
        copy = tmp_path / name
        shutil.copytree(out, copy)
        if name == "3":
            one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
            done = run_script("stage2_transformer.py", ["--input_dir", copy, *steps, *flags], env_overrides=one_device)
            assert done.returncode == 0, done.stderr[-3000:]
            assert read_config(copy / "000")["stage2"]["mesh"] == {"dp": 1, "sp": 1, "tp": 1}
        else:
            run_stage(stage2_transformer, ["--input_dir", copy, *steps, *flags])
        for folder, (expected, expected_config) in zip(batch_folders.expand_folders([str(copy)]), singles, strict=True):
            latents, config = stage2_outputs(folder)
            assert relative_error(latents, expected) <= 1e-5, (name, folder.name)
            assert config == expected_config
        record = read_config(copy / "002")["stage2"]["batch"]
        assert record["size"] == int(name) and record["padding"] == (0 if name == "3" else 1)


def test_sigterm_in_the_second_batch_then_resume(tmp_path, monkeypatch):
    """SIGTERM while the second batch runs: the first batch's folders are complete, the others hold a
    checkpoint; --resume skips the former, resumes the latter, and every folder's latents equal an
    uninterrupted batched run's bit for bit."""
    import os
    import shutil
    import signal

    import stage2_transformer
    from tpu_video.engine import batching
    from utils import CHECKPOINT_FILE, STAGE2_FILE

    out = stage1_batch(tmp_path, "tiny-cogvideox")
    argv = ["--num_inference_steps", 4, "--warmup_steps", 0, "--batch_size", 2]
    whole = tmp_path / "whole"
    shutil.copytree(out, whole)
    run_stage(stage2_transformer, ["--input_dir", whole, *argv])

    loops = []
    real_loop = batching.run_denoise_loop

    def signalled_in_the_second(*args, **kwargs):
        loops.append(1)
        if len(loops) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler: the batch stops after its first step
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(batching, "run_denoise_loop", signalled_in_the_second)
    with pytest.raises(SystemExit) as stopped:
        run_stage(stage2_transformer, ["--input_dir", out, *argv])
    assert stopped.value.code == 143
    assert [(out / name / STAGE2_FILE).is_file() for name in ("000", "001", "002")] == [True, True, False]
    assert (out / "002" / CHECKPOINT_FILE).is_file()
    monkeypatch.setattr(batching, "run_denoise_loop", real_loop)
    run_stage(stage2_transformer, ["--input_dir", out, *argv, "--resume"])
    for name in ("000", "001", "002"):
        assert torch.equal(stage2_outputs(out / name)[0], stage2_outputs(whole / name)[0]), name
    assert read_config(out / "002")["stage2"]["resumed"] and not (out / "002" / CHECKPOINT_FILE).exists()


def test_two_sizes_form_two_groups_each_compiled_once(tmp_path):
    """Two lists of two lengths in one stage-2 run: two groups, each with a padded second batch that
    builds nothing (the executable store is asked for no new program after the group's first batch)."""
    import stage2_transformer

    small = stage1_batch(tmp_path, "tiny-cogvideox", "small")
    longer = stage1_batch(tmp_path, "tiny-cogvideox", "longer", ["--num_frames", 17])
    run_stage(stage2_transformer, ["--input_dir", small, longer, "--num_inference_steps", 1, "--batch_size", 2])
    for group, folder in ((1, small), (2, longer)):
        sections = [read_config(folder / name)["stage2"] for name in ("000", "001", "002")]
        assert [s["batch"]["group"] for s in sections] == [group] * 3
        assert [s["batch"]["program"] for s in sections] == ["compiled", "compiled", "reused"]
        counts = [s["executables"]["hits"] + s["executables"]["misses"] for s in sections]
        assert counts[0] > 0 and counts[2] == counts[1], counts


def test_image_to_video_list_batches(tmp_path):
    """Entries with their own images (paths relative to the list), batched 2 at a time: the first batch
    joins two images' conditioning, the second (one video and its padding) shares one; each video within
    1e-5 of its single run."""
    import numpy as np
    from PIL import Image

    import stage2_transformer

    for index in range(2):
        pixels = (np.random.RandomState(index).rand(64, 96, 3) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"frame{index}.png")
    listing = tmp_path / "list.jsonl"
    entries = [
        {"prompt": "a cat", "image": "frame0.png"},
        {"prompt": "a dog", "image": "frame1.png", "seed": 9},
        {"prompt": "a bird", "image": "frame0.png", "seed": 5},
    ]
    listing.write_text("\n".join(json.dumps(entry) for entry in entries) + "\n")
    out = tmp_path / "batch"
    model = ["--model", "tiny-wan2.1-i2v", "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*model, "--prompts", listing, "--output_dir", out])
    steps = ["--num_inference_steps", 2, "--warmup_steps", 0]
    run_stage(stage2_transformer, ["--input_dir", out, *steps, "--batch_size", 2])
    for name, entry in zip(("000", "001", "002"), entries, strict=True):
        single = tmp_path / f"single{name}"
        argv = ["--prompt", entry["prompt"], "--image", tmp_path / entry["image"], "--seed", entry.get("seed", 42)]
        run_stage(stage1_text_encoder, [*model, *argv, "--output_dir", single])
        run_stage(stage2_transformer, ["--input_dir", single, *steps])
        assert relative_error(stage2_outputs(out / name)[0], stage2_outputs(single)[0]) <= 1e-5, name


def test_a_batch_and_a_single_run_never_share_a_folder(capsys, tmp_path):
    run_stage(stage1_text_encoder, ["--model", MODEL, "--prompt", "a cat", "--output_dir", tmp_path / "single"])
    argv = ["--model", MODEL, "--prompt", "a cat", "--seeds", "1-2", "--output_dir", tmp_path / "single"]
    expect_user_error(capsys, stage1_text_encoder, argv, "holds a single run's files")
    run_stage(stage1_text_encoder, [*argv[:-1], tmp_path / "many"])
    argv = ["--model", MODEL, "--prompt", "a cat", "--output_dir", tmp_path / "many"]
    expect_user_error(capsys, stage1_text_encoder, argv, "holds a batch")


def test_interval_cache_batches_and_resumes_per_folder(tmp_path, four_layer_cogvideox):
    """--cache interval over 3 videos in batches of 2 (the second padded, reusing the first's programs with
    its residuals reset): each folder within 1e-5 of its single cached run, with its schedule recorded. Stopped
    after the first batch's second step (a residual held, the next step cached), the checkpoints hold each
    video's own residual rows: --resume equals the uninterrupted batched run bit for bit, and one folder resumed alone
    equals its single run (1e-5)."""
    import shutil

    import stage2_transformer
    from tpu_video.engine import batching
    from utils import CHECKPOINT_FILE

    size = ["--height", 64, "--width", 96, "--num_frames", 9, "--num_inference_steps", 5]
    out = stage1_batch(tmp_path, str(four_layer_cogvideox), extra=size)
    cache = ["--cache", "interval", "--cache_start_step", 1, "--cache_end_step", 5, "--cache_step_interval", 2]
    argv = ["--warmup_steps", 0, *cache]
    singles = {}
    for folder in batch_folders.expand_folders([str(out)]):
        single = tmp_path / f"single-{folder.name}"
        shutil.copytree(folder, single)
        run_stage(stage2_transformer, ["--input_dir", single, *argv])
        singles[folder.name] = stage2_outputs(single)
    whole = tmp_path / "whole"
    shutil.copytree(out, whole)
    run_stage(stage2_transformer, ["--input_dir", whole, *argv, "--batch_size", 2])
    for name, (expected, expected_config) in singles.items():
        latents, config = stage2_outputs(whole / name)
        assert relative_error(latents, expected) <= 1e-5, name
        timed = ("median full step", "median cached step")  # the step cache's record but its timings
        for record in (config["stage2"]["step_cache"], expected_config["stage2"]["step_cache"]):
            assert all(record.pop(key) > 0 for key in timed)
        assert config == expected_config
        assert config["stage2"]["step_cache"]["schedule"] == "FFCFC"

    real_after_step = batching.BatchGuard.after_step

    def stopped_after_the_second_step(self, index, total, tensors, **kwargs):
        self.stop.stop_requested = self.stop.stop_requested or index == 1  # as SIGTERM's handler does
        return real_after_step(self, index, total, tensors, **kwargs)

    stopped = tmp_path / "stopped"
    shutil.copytree(out, stopped)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batching.BatchGuard, "after_step", stopped_after_the_second_step)
        with pytest.raises(SystemExit) as stop:
            run_stage(stage2_transformer, ["--input_dir", stopped, *argv, "--batch_size", 2])
    assert stop.value.code == 143
    assert [(stopped / name / CHECKPOINT_FILE).is_file() for name in ("000", "001", "002")] == [True, True, False]
    alone = tmp_path / "alone"
    shutil.copytree(stopped / "001", alone)
    run_stage(stage2_transformer, ["--input_dir", stopped, *argv, "--batch_size", 2, "--resume"])
    for name in ("000", "001", "002"):
        assert torch.equal(stage2_outputs(stopped / name)[0], stage2_outputs(whole / name)[0]), name
    run_stage(stage2_transformer, ["--input_dir", alone, *argv, "--resume"])
    assert relative_error(stage2_outputs(alone)[0], singles["001"][0]) <= 1e-5
