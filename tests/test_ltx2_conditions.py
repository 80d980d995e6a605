"""LTX-2's conditions (tpu_video/models/ltx2/conditions.py) against diffusers' LTX2ConditionPipeline run eagerly
on the tiny text-to-video preset's components: images and clips at latent frames (a clip replacing the first
frames, keyframe images and a keyframe clip appended as tokens of their own), with strengths below 1; and the
placement checks made before any weights load.

Tolerances as in tests/test_ltx2.py: fp32, 1e-5 relative (Frobenius) for the video and audio latents, the
frames and the waveform. The tiny VAE compresses time 4x, so latent frame k > 0 is pixel frame 4(k-1)+1.
"""

from __future__ import annotations

import functools

import pytest
import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import decoded_frames, pipeline, relative_error, run_stage, write_image, write_video
from helpers import ltx2_reference as reference
from tpu_video.cli import UserError
from tpu_video.models.ltx2.conditions import check_condition_size
from tpu_video.models.ltx2.declarations import GUIDANCE_OFF
from utils import Request, read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED, STEPS, FRAMES = "a robot dancing", "blurry", 7, 4, 17  # 17 frames: 5 latent frames


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Odd-sized images (resized and centre-cropped by the pipeline; one-frame conditions go through H.264), a
    5-frame mp4 clip and a 5-frame folder of frames."""
    folder = tmp_path_factory.mktemp("ltx2-conditions")
    frames = folder / "frames"
    frames.mkdir()
    for number in range(5):
        write_image(frames / f"{number:02d}.png", 70, 90, seed=10 + number)
    write_video(folder / "clip.mp4", frames=5, height=48, width=80)
    return {
        "first": write_image(folder / "first.png", 45, 61),
        "last": write_image(folder / "last.png", 80, 50, seed=4),
        "clip": folder / "clip.mp4",
        "frames": frames,
    }


@functools.cache
def condition_pipeline():
    from diffusers import LTX2ConditionPipeline

    return LTX2ConditionPipeline.from_pipe(pipeline("tiny-ltx2"))


def refine_pipeline():
    """The condition pipeline with the two-stage example's refine scheduler (the sigmas as given)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ConditionPipeline

    config = condition_pipeline().scheduler.config
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, use_dynamic_shifting=False, shift_terminal=None)
    return LTX2ConditionPipeline.from_pipe(condition_pipeline(), scheduler=scheduler)


def frames_of(path):
    from PIL import Image

    if path.is_dir():
        return [Image.open(file).convert("RGB") for file in sorted(path.iterdir())]
    return decoded_frames(path) if path.suffix == ".mp4" else Image.open(path).convert("RGB")


# case: ([(media name, latent index, strength)], stage-1 flags, stage-2 flags)
CASES = {
    "clip-extended-two-keyframes": (
        [("clip", 0, 1.0), ("first", 3, 0.6), ("last", -1, 0.9)],
        [],
        [],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_conditions_match_the_condition_pipeline(tmp_path, capsys, media, case):
    """Stage 1's prepared and encoded conditions, stage 2's loop with the video's tokens held to them and the
    keyframe tokens appended, the latents without them, a pass from those latents, stage 3's decode."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    conditions, stage1_flags, stage2_flags = CASES[case]
    out = tmp_path / "run"
    argv = ["--model", "tiny-ltx2", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--seed", SEED, "--num_inference_steps", STEPS, "--num_frames", FRAMES, "--output_dir", out]
    argv += ["--condition", *(media[name] for name, _, _ in conditions)]
    argv += ["--condition_index", *(index for _, index, _ in conditions)]
    argv += ["--condition_strength", *(strength for _, _, strength in conditions), *stage1_flags]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *stage2_flags])
    config = read_config(out, needs="stage2")
    assert config["stage1"]["task"] == "conditions"
    tensors = read_tensors(out, config["stage2"])
    crf = config["image_crf"]
    arguments = {
        "conditions": [
            LTX2VideoCondition(frames=frames_of(media[name]), index=index, strength=strength, crf=crf)
            for name, index, strength in conditions
        ]
    }
    video, audio = reference(condition_pipeline(), config, "latent", **arguments)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE
    # A pass from these latents, the two-stage pipeline's refine (at the same size here; one from upsampled
    # latents needs the conditions encoded at its size): LTX2ConditionPipeline called with `latents=` and
    # `audio_latents=` the first call's, the conditions applied to them and the noise scaled around them by the
    # refine's first sigma (its default noise_scale), the scheduler as the two-stage example rebuilds it.
    again = tmp_path / "again"
    argv = ["--input_dir", out, "--start_latents", out, "--output_dir", again, "--executables", "off"]
    run_stage(stage2_transformer, [*argv, "--sigmas", "distilled_refine", "--seed", 11])
    refined = read_tensors(again, read_config(again, needs="stage2")["stage2"])
    refine = refine_pipeline()
    second = {**config, "num_inference_steps": 3, "seed": 11}
    sigmas = {"sigmas": STAGE_2_DISTILLED_SIGMA_VALUES, **GUIDANCE_OFF}
    again_video, again_audio = reference(
        refine, second, "latent", latents=video, audio_latents=audio, **arguments, **sigmas
    )
    assert relative_error(refined["latents"], again_video) <= TOLERANCE
    assert relative_error(refined["audio_latents"], again_audio) <= TOLERANCE
    assert relative_error(again_video, video) > 100 * TOLERANCE  # the refine moved them
    with pytest.raises(UserError, match="stage 1 encoded the conditions for a 2x3 latent grid; this pass runs 4x6"):
        check_condition_size([torch.zeros(1, 4, 1, 2, 3)], 4, 6)  # a pass at twice the size

    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    saved = read_tensors(out, config["stage3"]["frames_file"])
    frames, waveform = reference(condition_pipeline(), config, "np", **arguments)
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE


def test_the_noise_scale_of_a_conditioned_video():
    """LTX2ConditionPipeline's noise_scale: the schedule's first sigma (1 with the pipeline's own), also with given
    latents; --noise_scale only in a pass from given latents, where 0 is a value (a pass from noise refuses it)."""
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES as REFINE

    from tpu_video.models.ltx2.conditions import noise_scale

    base = {"model_family": "ltx2", "model_id": "tiny-ltx2", "prompt": "p", "negative_prompt": "", "dtype": "fp32"}
    base |= {"height": 64, "width": 64, "num_frames": 9, "fps": 24, "num_inference_steps": 8, "guidance_scale": 1.0}
    own, refine = Request(**base, seed=0), Request(**base, seed=0, options={"sigmas": "distilled_refine"})
    zero = Request(**base, seed=0, options={"sigmas": "distilled_refine", "noise_scale": 0.0})
    assert noise_scale(own, given=False) == noise_scale(own, given=True) == 1.0
    assert noise_scale(refine, given=False) == noise_scale(refine, given=True) == REFINE[0] != 1.0
    assert noise_scale(zero, given=True) == 0.0 and noise_scale(zero, given=False) == REFINE[0]


def test_a_distilled_batch_of_conditioned_videos_matches_the_pipeline_video_by_video(tmp_path, media):
    """Two videos of a --prompts list, each with its own image at latent frame 0 (strength 0.8) and its own
    5-frame clip appended at 2, the distilled schedule (guidance off; the pipeline's noise_scale is its first
    sigma), one stage-2 batch on 8 devices with Splash on sp 2 x tp 4: each folder against LTX2ConditionPipeline
    called for that video alone with sigmas=DISTILLED_SIGMA_VALUES."""
    import json

    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    from tpu_video.engine import batch_folders
    from tpu_video.models.ltx2.declarations import GUIDANCE_OFF

    names = [("first", "frames"), ("last", "clip")]  # each video's image at 0, clip at 2
    entries = [
        {"prompt": prompt, "seed": seed, "condition": [str(media[name]) for name in pair]}
        for prompt, seed, pair in zip((PROMPT, "a red kite"), (3, 4), names, strict=True)
    ]
    listing = tmp_path / "list.jsonl"
    listing.write_text("\n".join(json.dumps(entry) for entry in entries) + "\n")
    out = tmp_path / "batch"
    argv = ["--model", "tiny-ltx2", "--prompts", listing, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--num_frames", FRAMES, "--sigmas", "distilled", "--image_crf", 0, "--output_dir", out]
    run_stage(stage1_text_encoder, [*argv, "--condition_index", 0, 2, "--condition_strength", 0.8, 1.0])
    stage2 = ["--attention", "splash", "--sp", "2", "--tp", "4", "--batch_size", "2", "--executables", "off"]
    run_stage(stage2_transformer, ["--input_dir", out, *stage2])
    for folder, pair in zip(batch_folders.expand_folders([str(out)]), names, strict=True):
        config = read_config(folder, needs="stage2")
        assert config["stage2"]["batch"]["size"] == 2 and config["num_inference_steps"] == 8
        tensors = read_tensors(folder, config["stage2"])
        conditions = [
            LTX2VideoCondition(frames=frames_of(media[name]), index=index, strength=strength, crf=0)
            for name, index, strength in zip(pair, (0, 2), (0.8, 1.0), strict=True)
        ]
        arguments = {"conditions": conditions, "sigmas": DISTILLED_SIGMA_VALUES, **GUIDANCE_OFF}
        video, audio = reference(condition_pipeline(), config, "latent", **arguments)
        assert relative_error(tensors["latents"], video) <= TOLERANCE, folder.name
        assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE, folder.name


def test_stage1_plans_the_condition_encodes_for_a_tpu(tmp_path, media):
    """Stage 1's --plan with a keyframe compiles the VAE's encode of the image on v6e-8 (libtpu) beside Gemma and
    the connectors; the normalisation after it reads the checkpoint's statistics, not the meta VAE's (a traceback
    before 2026-11-28, as for image-to-video). One image keeps the compile short: a clip is the same program at
    its frame count."""
    import json

    out = tmp_path / "plan.json"
    argv = ["--model", "tiny-ltx2", "--prompt", PROMPT, "--num_frames", FRAMES, "--plan", "v6e-8"]
    argv += ["--condition", media["last"], "--condition_index", -1, "--plan_json", out]
    run_stage(stage1_text_encoder, [*argv, "--output_dir", tmp_path / "unused"])
    report = json.loads(out.read_text())
    encodes = {name: calls for name, calls in report["calls"].items() if name.startswith("AutoencoderKLLTX2Video")}
    assert report["fits"] and "images" not in report
    assert encodes == {"AutoencoderKLLTX2Video ([1, 3, 1, 64, 96])": 1}
