"""The bad-input suite: each case a bad flag, a hand-edited or damaged file, or a folder that is not what it
should be, run through a stage's main() in this process (a few through the real command line at the end).
Every case must exit with status 2 and exactly one `error:` line naming the input, print no traceback,
and leave every file and folder of the case byte for byte as it was (no temp file left behind).

`CAUSE` names the group of docs/reliability.md a case belongs to; that page lists every case by its id.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import ROOT, run_script, run_stage, tiny_stage1
from tpu_video.cli import INTERRUPTED_EXIT_STATUS, run_cli
from utils import CONFIG_FILE, STAGE1_FILE, STAGE2_FILE, strict_json, write_config

STAGES = {"stage1": stage1_text_encoder, "stage2": stage2_transformer, "stage3": stage3_vae_decoder}
STAGE1 = ["--model", "tiny-cogvideox", "--prompt", "a cat", "--num_inference_steps", "2", "--output_dir", "OUT"]
CAUSE = {
    "non-finite output": "stage 3 decodes NaN or Inf",
    "non-finite numbers": "NaN or Inf in a flag, a config or a ratio file",
    "another run's folder": "--output_dir holding another run's files",
    "out of range": "integers past what the scheduler, the generator, the model or the host can take",
    "hand-edited config": "wrong types and values in generation_config.json",
    "user errors": "devices, output names, topologies, addresses, model folders, output paths",
    "mesh": "mesh flags that cannot work",
    "stale prompt": "a prompt edited after stage 1",
    "argparse": "argparse's own errors",
    "nonsense": "values with no meaning for the flag",
    "images": "image-to-video inputs",
    "ltx2": "LTX-2's sizes, guidance terms and image re-encode",
    "held": "cases that were already refused",
}


@dataclass(frozen=True)
class Case:
    id: str
    cause: str
    stage: str
    argv: tuple  # "D": the case's copy of a denoised folder; "OUT", "OTHER", "MODEL": folders the case may prepare
    message: str
    prepare: Callable[[Path], None] | None = None  # damages the case's folder (tmp_path) before the run
    after_loading: bool = False  # refused only once the work is done (the rest load no weights first)


def edit_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def prepare(root: Path) -> None:
        path = root / "D" / CONFIG_FILE
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))  # Python's json writes NaN and Infinity as they are

    return prepare


def other_run(root: Path) -> None:
    """OTHER: a complete folder of another model's run (its config says Wan; its files are what they are)."""
    shutil.copytree(root / "D", root / "OTHER")
    path = root / "OTHER" / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(model_family="wan", model_id="tiny-wan2.1")
    config["stage1"]["sha256"] = "0" * 64
    path.write_text(json.dumps(config))


def model_without(component: str) -> Callable[[Path], None]:
    def prepare(root: Path) -> None:
        from tpu_video.models import materialize_preset

        shutil.copytree(materialize_preset("tiny-cogvideox"), root / "MODEL")
        shutil.rmtree(root / "MODEL" / component)

    return prepare


def stage1_only(root: Path) -> None:
    edit_config(lambda config: config.pop("stage2"))(root)
    (root / "D" / STAGE2_FILE).unlink()


def changed_embeddings(root: Path) -> None:
    tensors = load_file(root / "D" / STAGE1_FILE)
    tensors["prompt_embeds"] = tensors["prompt_embeds"] + 1
    save_file(tensors, root / "D" / STAGE1_FILE)


def truncated_latents(root: Path) -> None:
    path = root / "D" / STAGE2_FILE
    path.write_bytes(path.read_bytes()[:100])


def ratio_file(root: Path) -> None:
    (root / "ratios.json").write_text('{"mag_ratios": [1.0, NaN]}')


def latents_path_is_a_folder(root: Path) -> None:
    (root / "D" / STAGE2_FILE).unlink()
    (root / "D" / STAGE2_FILE).mkdir()


def stray_latents(root: Path) -> None:
    (root / "OUT").mkdir()
    shutil.copy(root / "D" / STAGE2_FILE, root / "OUT")


def a_file(root: Path) -> None:
    (root / "OUT").write_text("not a folder")


def image_files(root: Path) -> None:
    """IMAGE: a real PNG; TEXT_PNG: a text file named .png."""
    from PIL import Image

    Image.new("RGB", (48, 32), (200, 30, 30)).save(root / "image.png")
    (root / "text.png").write_text("not an image")


def clip_frames(root: Path) -> None:
    """IMAGE and TEXT_PNG, and CLIP: a folder of 9 frames."""
    from PIL import Image

    image_files(root)
    (root / "clip").mkdir()
    for number in range(9):
        Image.new("RGB", (48, 32), (20 * number, 30, 30)).save(root / "clip" / f"{number}.png")


def i2v(case_id, flags, message, model="tiny-wan2.1-i2v"):
    """A stage-1 case on an image-to-video preset (IMAGE and TEXT_PNG prepared)."""
    argv = ("--model", model, "--prompt", "a cat", "--output_dir", "OUT", *flags)
    return Case(case_id, "images", "stage1", argv, message, image_files)


def ltx2(case_id, model, flags, message):
    """A stage-1 case on an LTX-2 preset (or a flag of LTX-2's on another family); IMAGE and CLIP prepared."""
    argv = ("--model", model, "--prompt", "a cat", "--output_dir", "OUT", *flags)
    return Case(case_id, "ltx2", "stage1", argv, message, clip_frames)


def s1(case_id, cause, flags, message, prepare=None):
    return Case(case_id, cause, "stage1", (*STAGE1, *flags), message, prepare)


def s1_hunyuan(case_id, cause, flags, message):
    return Case(case_id, cause, "stage1", (*STAGE1, "--model", "tiny-hunyuanvideo15", *flags), message)


def s2(case_id, cause, flags, message, prepare=None):
    return Case(case_id, cause, "stage2", ("--input_dir", "D", *flags), message, prepare)


def s3(case_id, cause, flags, message, prepare=None):
    return Case(case_id, cause, "stage3", ("--input_dir", "D", *flags), message, prepare)


def scaling(value):
    return edit_config(lambda config: config["stage2"]["latents_normalization"].update(scaling_factor=value))


NOT_FINITE = "is not a finite number"
CASES = [
    Case(
        "s3-decode-overflow",
        "non-finite output",
        "stage3",
        ("--input_dir", "D"),
        "the decoded frames hold NaN or Inf",
        scaling(1e-30),
        after_loading=True,
    ),
    s1("s1-guidance-nan", "non-finite numbers", ["--guidance_scale", "nan"], f"--guidance_scale: 'nan' {NOT_FINITE}"),
    s1("s1-guidance-inf", "non-finite numbers", ["--guidance_scale", "inf"], f"--guidance_scale: 'inf' {NOT_FINITE}"),
    s1("s1-guidance-minus-inf", "non-finite numbers", ["--guidance_scale=-inf"], f"'-inf' {NOT_FINITE}"),
    s1("s1-guidance2-minus-inf", "non-finite numbers", ["--guidance_scale_2", "-inf"], "expected one argument"),
    s1("s1-flow-shift-nan", "non-finite numbers", ["--flow_shift", "nan"], f"--flow_shift: 'nan' {NOT_FINITE}"),
    s2("s2-guidance-nan", "non-finite numbers", ["--guidance_scale", "nan"], f"--guidance_scale: 'nan' {NOT_FINITE}"),
    s2("s2-plan-guidance-inf", "non-finite numbers", ["--plan", "v6e-8", "--guidance_scale", "inf"], NOT_FINITE),
    s2("s2-cache-threshold-nan", "non-finite numbers", ["--cache_threshold", "nan"], f"'nan' {NOT_FINITE}"),
    s2("s2-retention-inf", "non-finite numbers", ["--cache_retention_ratio", "inf"], f"'inf' {NOT_FINITE}"),
    s2("s2-retention-nan", "non-finite numbers", ["--cache_retention_ratio", "nan"], f"'nan' {NOT_FINITE}"),
    s2("s2-peer-timeout-nan", "non-finite numbers", ["--peer_timeout", "nan"], f"'nan' {NOT_FINITE}"),
    s2(
        "s2-config-nan",
        "non-finite numbers",
        [],
        "guidance_scale is NaN or infinite",
        edit_config(lambda c: c.update(guidance_scale=float("nan"))),
    ),
    s3(
        "s3-config-section-inf",
        "non-finite numbers",
        [],
        "stage1.seconds is NaN or infinite",
        edit_config(lambda c: c["stage1"].update(seconds=float("inf"))),
    ),
    s2(
        "s2-ratio-file-nan",
        "non-finite numbers",
        ["--output_dir", "OUT", "--cache", "magcache", "--cache_mag_ratios", "ratios.json"],
        "mag_ratios[1] is NaN",
        ratio_file,
    ),
    s2(
        "s2-output-another-run",
        "another run's folder",
        ["--output_dir", "OTHER"],
        "holds another run's files",
        other_run,
    ),
    s3(
        "s3-output-another-run",
        "another run's folder",
        ["--output_dir", "OTHER"],
        "holds another run's files",
        other_run,
    ),
    s2("s2-output-stray-latents", "another run's folder", ["--output_dir", "OUT"], "without a", stray_latents),
    s2("s2-output-is-a-file", "another run's folder", ["--output_dir", "OUT"], "is a file, not a folder", a_file),
    s3("s3-output-is-a-file", "another run's folder", ["--output_dir", "OUT"], "is a file, not a folder", a_file),
    s1("s1-steps-1001", "out of range", ["--num_inference_steps", "1001"], "more than the scheduler's 1000 training"),
    s2("s2-steps-5000", "out of range", ["--num_inference_steps", "5000"], "more than the scheduler's 1000"),
    s1("s1-seed-2-64", "out of range", ["--seed", str(2**64)], f"--seed {2**64} must be from 0 to 2**64 - 1"),
    s2("s2-seed-int64-min", "out of range", ["--seed", str(-(2**63) - 1)], "must be from 0 to 2**64 - 1"),
    s1("s1-fps-1e23", "out of range", ["--fps", str(10**23)], f"--fps {10**23} must be from 1 to 1000"),
    s1("s1-fps-0", "out of range", ["--fps", "0"], "--fps 0 must be from 1 to 1000"),
    s3("s3-fps-2000", "out of range", ["--fps", "2000"], "--fps 2000 must be from 1 to 1000"),
    # HunyuanVideo-1.5: no positional table bounds the size (tiny CogVideoX 1.5's rotary grid stops at 64 x 96)
    s1_hunyuan("s1-height-16e6", "out of range", ["--height", "16000000"], "GiB of float32 frames, more than this"),
    s1_hunyuan("s1-width-16e6", "out of range", ["--width", "16000000"], "GiB of float32 frames, more than this"),
    s1("s1-cogvideox15-rotary-grid", "out of range", ["--width", "2048"], "the most this model's rotary embeddings"),
    s2("s2-frames-8e12", "out of range", ["--num_frames", "8000000000001"], "GiB of float32 frames"),
    Case(
        "s1-wan-rope-positions",
        "out of range",
        "stage1",
        ("--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", "OUT", "--height", "16400"),
        "more than the 32 the transformer's rotary embedding holds",
    ),
    s2(
        "s2-config-height-string",
        "hand-edited config",
        [],
        'height is "64"',
        edit_config(lambda c: c.update(height="64")),
    ),
    s2("s2-config-seed-string", "hand-edited config", [], 'seed is "abc"', edit_config(lambda c: c.update(seed="abc"))),
    s2(
        "s2-config-guidance-null",
        "hand-edited config",
        [],
        "guidance_scale is null in the request; it must be a number",
        edit_config(lambda c: c.update(guidance_scale=None)),
    ),
    s3("s3-config-fps-bool", "hand-edited config", [], "fps is true", edit_config(lambda c: c.update(fps=True))),
    s3(
        "s3-config-a-list",
        "hand-edited config",
        [],
        "holds a JSON list, not an object",
        lambda root: (root / "D" / CONFIG_FILE).write_text("[1, 2]"),
    ),
    s2(
        "s2-config-stage1-null",
        "hand-edited config",
        [],
        "the 'stage1' section is null, not an object",
        edit_config(lambda c: c.update(stage1=None)),
    ),
    s2(
        "s2-config-record-without-file",
        "hand-edited config",
        [],
        "a stage file's record is not the file, sha256 and tensors",
        edit_config(lambda c: c["stage1"].pop("file")),
    ),
    s3("s3-scaling-factor-0", "hand-edited config", [], "its scaling_factor must be a positive number", scaling(0)),
    s1("s1-device-cuda", "user errors", ["--device", "cuda"], "--device cuda: this torch is built without CUDA"),
    s1("s1-device-banana", "user errors", ["--device", "banana"], "--device 'banana' is not a torch device"),
    s3("s3-device-cuda", "user errors", ["--device", "cuda:0"], "--device cuda:0: this torch is built without CUDA"),
    s3("s3-device-banana", "user errors", ["--device", "banana"], "--device 'banana' is not a torch device"),
    s3("s3-output-name-noext", "user errors", ["--output_name", "noext"], "name it .mp4"),
    s3("s3-output-name-empty", "user errors", ["--output_name", ""], "name it .mp4"),
    s3("s3-output-name-gif", "user errors", ["--output_name", "video.gif"], "name it .mp4"),
    s2("s2-plan-odd-topology", "user errors", ["--plan", "v6e:3x3"], "--plan: libtpu knows no TPU topology 'v6e:3x3'"),
    s1("s1-lora-not-ltx2", "user errors", ["--lora", "x.safetensors"], "adapters change the transformer alone"),
    s2(
        "s2-coordinator-without-port",
        "user errors",
        ["--coordinator_address", "notahost", "--num_processes", "2", "--process_id", "0"],
        "--coordinator_address 'notahost' must be HOST:PORT",
    ),
    s2(
        "s2-model-without-transformer",
        "user errors",
        ["--model", "MODEL"],
        "transformer/config.json is missing",
        model_without("transformer"),
    ),  # fmt: skip
    s3("s3-model-without-vae", "user errors", ["--model", "MODEL"], "vae/config.json is missing", model_without("vae")),
    s2("s2-latents-path-is-a-folder", "user errors", [], f"{STAGE2_FILE} is a folder", latents_path_is_a_folder),
    s2("s2-tp-3", "mesh", ["--tp", "3"], "a mesh that works: --dp 2 --sp 1 --tp 4"),
    s2("s2-dp-4", "mesh", ["--dp", "4"], "--dp 4 is more than the batch of 2"),
    s2("s2-mesh-16", "mesh", ["--dp", "2", "--sp", "2", "--tp", "4"], "= 16 devices, but 8 are available"),
    s2("s2-tp-16", "mesh", ["--tp", "16", "--dp", "1"], "--dp 1 --tp 16 = 16 does not divide the 8 devices"),
    s2(
        "s2-edited-prompt",
        "stale prompt",
        [],
        "prompt differs from what stage 1 encoded",
        edit_config(lambda c: c.update(prompt="a dog")),
    ),  # fmt: skip
    s3(
        "s3-edited-negative-prompt",
        "stale prompt",
        [],
        "negative_prompt differs from what stage 1 encoded",
        edit_config(lambda c: c.update(negative_prompt="blurry")),
    ),  # fmt: skip
    s1("s1-height-2.5", "argparse", ["--height", "2.5"], "argument --height: invalid int value: '2.5'"),
    s1("s1-steps-1e30", "argparse", ["--num_inference_steps", "1e30"], "--num_inference_steps: invalid int value"),
    s1("s1-seed-nan", "argparse", ["--seed", "nan"], "argument --seed: invalid int value: 'nan'"),
    s1("s1-unknown-flag", "argparse", ["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    s2("s2-dp-1.5", "argparse", ["--dp", "1.5"], "argument --dp: invalid int value: '1.5'"),
    s3("s3-backend-choice", "argparse", ["--backend", "jax"], "argument --backend: invalid choice: 'jax'"),
    s2("s2-stage1-flag", "argparse", ["--condition_strength", "0.5"], "--condition_strength is stage 1's"),
    s2("s2-stage1-flag-prefix", "argparse", ["--mode", "replace"], "--mode is stage 1's"),  # begins --model
    s3("s3-stage1-flag", "argparse", ["--image", "IMAGE"], "rerun stage1_text_encoder.py with it (its --help lists"),
    s2("s2-threshold-minus-1", "nonsense", ["--cache", "magcache", "--cache_threshold=-1"], "must be greater than 0"),
    s2(
        "s2-max-skip-minus-1", "nonsense", ["--cache", "magcache", "--cache_max_skip_steps", "-1"], "must be at least 1"
    ),
    s2("s2-retention-5", "nonsense", ["--cache", "magcache", "--cache_retention_ratio", "5"], "must be from 0 up to"),
    s2("s2-batch-size-0", "nonsense", ["--batch_size", "0"], "--batch_size 0 must be >= 1"),
    s2("s2-magcache-batch-2", "nonsense", ["--cache", "magcache", "--batch_size", "2"], "use --batch_size 1"),
    s2("s2-peer-timeout-minus-5", "nonsense", ["--peer_timeout", "-5"], "must be a positive number of seconds"),
    s1("s1-seed-minus-1", "nonsense", ["--seed=-1"], "--seed -1 must be from 0 to 2**64 - 1"),
    s2("s2-seed-minus-1", "nonsense", ["--seed", "-1"], "--seed -1 must be from 0 to 2**64 - 1"),
    i2v("s1-i2v-without-image", [], "is an image-to-video model: give the first frame with --image PATH"),
    i2v("s1-i2v-image-is-text", ["--image", "TEXT_PNG"], "is not a readable image"),
    i2v("s1-i2v-last-image-unused", ["--image", "IMAGE", "--last_image", "IMAGE"], "takes no --last_image"),
    i2v(
        "s1-hunyuan-i2v-height",
        ["--image", "IMAGE", "--height", "32"],
        "takes the video's size from the image",
        model="tiny-hunyuanvideo15-i2v",
    ),  # fmt: skip
    s1("s1-t2v-given-an-image", "images", ["--image", "IMAGE"], "takes no image (a text-to-video model)", image_files),
    i2v(
        "s1-cogvideox-i2v-last-image",
        ["--image", "IMAGE", "--last_image", "IMAGE"],
        "takes no --last_image",
        model="tiny-cogvideox-i2v",
    ),  # fmt: skip
    ltx2("s1-ltx2-height-48", "tiny-ltx2", ["--height", "48"], "must be a positive multiple of 32"),
    ltx2("s1-ltx2-given-an-image", "tiny-ltx2", ["--image", "IMAGE"], "takes no image (a text-to-video model)"),
    ltx2("s1-audio-scale-on-wan", "tiny-wan2.1", ["--audio_guidance_scale", "2"], "is an option of ltx2"),
    ltx2("s1-ltx2.0-stg-scale", "tiny-ltx2", ["--stg_scale", "2"], "spatio-temporal guidance cannot act"),
    ltx2("s1-ltx2-stg-block-5", "tiny-ltx2.3", ["--stg_blocks", "5"], "the transformer has 2 blocks (0 to 1)"),
    ltx2("s1-ltx2-stg-blocks-text", "tiny-ltx2.3", ["--stg_blocks", "a,b"], "comma-separated block indices"),
    ltx2("s1-ltx2-rescale-2", "tiny-ltx2", ["--audio_guidance_rescale", "2"], "must be from 0 to 1"),
    ltx2(
        "s1-ltx2-image-crf-on-t2v",
        "tiny-ltx2",
        ["--image_crf", "20"],
        "acts only with stage 1's --image or --condition",
    ),
    ltx2("s1-image-crf-on-wan", "tiny-wan2.1-i2v", ["--image", "IMAGE", "--image_crf", "20"], "wan does not take it"),
    Case(
        "s1-animate-mode-on-t2v",
        "user errors",
        "stage1",
        ("--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", "OUT", "--mode", "replace"),
        "--mode replace acts only with stage 1's --pose_video, which this --model does not take",
    ),
    ltx2("s1-ltx2-i2v-crf-52", "tiny-ltx2-i2v", ["--image", "IMAGE", "--image_crf", "52"], "H.264's range"),
    ltx2("s1-ltx2-distilled-30", "tiny-ltx2", ["--sigmas", "distilled", "--num_inference_steps", "30"], "8 steps"),
    ltx2("s1-ltx2-sigmas-unknown", "tiny-ltx2", ["--sigmas", "dev"], "invalid choice: 'dev'"),
    ltx2("s1-sigmas-on-wan", "tiny-wan2.1", ["--sigmas", "distilled"], "--sigmas is an option of ltx2"),
    ltx2("s1-ltx2-noise-scale-2", "tiny-ltx2", ["--noise_scale", "2"], "must be from 0 (the latents as given) to 1"),
    ltx2("s1-ltx2-system-prompt-alone", "tiny-ltx2", ["--system_prompt", "be brief"], "give --enhance_prompt too"),
    ltx2("s1-ltx2.5-enhance-no-processor", "tiny-ltx2.5", ["--enhance_prompt"], "has no `processor` folder"),
    ltx2("s1-enhance-prompt-on-wan", "tiny-wan2.1", ["--enhance_prompt"], "--enhance_prompt is an option of ltx2"),
    # tiny-ltx2: 9 frames, 3 latent frames (the tiny VAE compresses time 4x)
    ltx2("s1-ltx2-condition-index-3", "tiny-ltx2", ["--condition", "IMAGE", "--condition_index", "3"], "3 latent"),
    ltx2("s1-ltx2-condition-strength", "tiny-ltx2", ["--condition", "IMAGE", "--condition_strength", "1.5"], "0 (not"),
    ltx2("s1-ltx2-conditions-no-index", "tiny-ltx2", ["--condition", "IMAGE", "IMAGE"], "with --condition_index"),
    ltx2(
        "s1-ltx2-condition-index-count",
        "tiny-ltx2",
        ["--condition", "IMAGE", "IMAGE", "--condition_index", "0"],
        "--condition_index has 1 for 2 --condition paths; give one for each",
    ),
    ltx2("s1-ltx2-condition-index-alone", "tiny-ltx2", ["--condition_index", "1"], "only with stage 1's --condition"),
    ltx2(
        "s1-ltx2-condition-clip-too-long",
        "tiny-ltx2",
        ["--condition", "CLIP", "--condition_index", "2"],
        "9 frames from pixel frame 5 (--condition_index 2); the video has 9, so 4 fit",
    ),
    ltx2("s1-ltx2-i2v-condition", "tiny-ltx2-i2v", ["--image", "IMAGE", "--condition", "IMAGE"], "no --condition"),
    ltx2("s1-ltx2.5-condition-no-frames", "tiny-ltx2.5", ["--condition", "IMAGE"], "--condition: give --num_frames"),
    s2("s2-missing-stage1", "held", [], f"{STAGE1_FILE} is missing", lambda root: (root / "D" / STAGE1_FILE).unlink()),
    s2("s2-changed-embeddings", "held", [], "does not match the sha256", changed_embeddings),
    s3("s3-before-stage2", "held", [], "has no 'stage2' section", stage1_only),
    s3("s3-truncated-latents", "held", [], "does not match the sha256", truncated_latents),
    s2("s2-cross-family-model", "held", ["--model", "tiny-wan2.1"], "is a wan model but the stage files are from"),
    s2("s2-resume-without-checkpoint", "held", ["--resume"], "--resume: there is no checkpoint"),
    s1("s1-no-such-model", "held", ["--model", "./no/such/folder"], "no such folder"),
    s1("s1-dtype-int8", "held", ["--dtype", "int8"], "--dtype 'int8' is not one of bf16, fp16, fp32"),
]


@pytest.fixture(scope="module")
def denoised(tmp_path_factory):
    """One tiny CogVideoX folder through stage 2, shared by every case (each works on its own copy)."""
    folder = tiny_stage1(tmp_path_factory.mktemp("bad-inputs"), "--num_inference_steps", 2)
    run_stage(stage2_transformer, ["--input_dir", folder])
    return folder


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (folders as None), so a new temp file or folder shows as a difference."""
    return {str(path.relative_to(root)): path.read_bytes() if path.is_file() else None for path in root.rglob("*")}


def case_folder(root: Path, denoised: Path, case: Case) -> list[str]:
    shutil.copytree(denoised, root / "D")
    if case.prepare is not None:
        case.prepare(root)
    names = {"D": "D", "OUT": "OUT", "OTHER": "OTHER", "MODEL": "MODEL", "ratios.json": "ratios.json"}
    names |= {"IMAGE": "image.png", "TEXT_PNG": "text.png", "CLIP": "clip"}
    return [str(root / names[arg]) if arg in names else arg for arg in case.argv]


def test_the_suite_covers_every_cause_with_60_cases_or_more():
    assert len(CASES) >= 60 and len({case.id for case in CASES}) == len(CASES)
    assert {case.cause for case in CASES} == set(CAUSE)


def test_docs_list_every_case():
    page = (ROOT / "docs" / "reliability.md").read_text()
    assert [case.id for case in CASES if f"`{case.id}`" not in page] == []


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_is_one_error_line_and_changes_nothing(request, capsys, denoised, tmp_path, case):
    argv = case_folder(tmp_path, denoised, case)
    if not case.after_loading:
        request.getfixturevalue("no_weights_loaded")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_stage(STAGES[case.stage], argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and case.message in errors[0], errors
    assert err.splitlines()[-1] == errors[0], f"the error is not one line: {err[err.index(errors[0]) :]}"
    if case.cause == "argparse":  # it points at the --help that lists the flag: this stage's, or stage 1's
        help_pointers = (
            f"(see {STAGES[case.stage].__name__}.py --help)",
            "stage1_text_encoder.py with it (its --help lists it)",
        )
        assert errors[0].endswith(help_pointers), errors[0]
    assert snapshot(tmp_path) == before


SUBPROCESS_CASES = ["s1-height-2.5", "s2-config-height-string", "s3-output-name-noext", "s2-output-another-run"]
SUBPROCESS_CASES += ["s1-i2v-image-is-text"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_the_real_command_line_exits_2_with_the_error_as_its_last_line(denoised, tmp_path, case_id):
    case = next(case for case in CASES if case.id == case_id)
    argv = case_folder(tmp_path, denoised, case)
    before = snapshot(tmp_path)
    result = run_script(f"{STAGES[case.stage].__name__}.py", argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and case.message in result.stderr
    assert snapshot(tmp_path) == before


def test_configs_are_written_as_strict_json(tmp_path):
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_config(tmp_path, {"guidance_scale": float("nan")})
    assert not any(tmp_path.iterdir())
    assert strict_json({"a": 1.5}) == '{"a": 1.5}'


def test_ctrl_c_is_one_line_and_status_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        run_cli(interrupted)
    assert exit_info.value.code == INTERRUPTED_EXIT_STATUS
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["stopped: interrupted (Ctrl-C); no partial file was written"]
