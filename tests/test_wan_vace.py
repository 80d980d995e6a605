"""Wan VACE (tpu_video/models/wan/vace.py): the stages on the tiny VACE preset (2 VACE layers feeding both main
blocks) against diffusers' WanVACEPipeline run eagerly on the same components, loaded from the same folder,
given the same decoded frames and images.

Tolerance, fp32, relative: 1e-4 for the latents (the reference frames dropped, as the pipeline drops them
before its decode) and the decoded frames, as tests/test_wan.py (the staged run batches [cond, uncond] where
the pipeline makes two calls).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import decoded_frames, expect_user_error, relative_error, run_script, run_stage, write_image, write_video
from tpu_video import models
from utils import read_config, read_tensors

TOLERANCE = 1e-4
ONE_DEVICE = "--xla_force_host_platform_device_count=1"
MODEL = "tiny-wan2.1-vace"
PROMPT, NEGATIVE, SEED = "a fox in the snow", "blurry", 5
REQUEST = {"height": 32, "width": 48, "num_inference_steps": 4, "guidance_scale": 4.0}


def moving_edge(t, y, x):
    """A mask video: white (redraw) right of an edge that moves 2 pixels a frame, black (keep) left of it."""
    return np.repeat(((x > 10 + 2 * t) * 255)[..., None], 3, axis=-1)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vace")
    write_video(folder / "control.mp4", height=32, width=48)
    write_video(folder / "mask.mp4", height=32, width=48, pattern=moving_edge)
    write_video(folder / "short_mask.mp4", frames=5, height=32, width=48, pattern=moving_edge)
    write_video(folder / "wide.mp4", height=40, width=56)
    write_video(folder / "small.mp4", height=16, width=32)
    write_image(folder / "ref1.png", 32, 48, seed=7)
    write_image(folder / "ref2.png", 20, 40, seed=8)  # another shape: letterboxed on white by the pipeline
    Image.fromarray(((np.mgrid[0:32, 0:48][1] > 20) * 255).astype(np.uint8)).save(folder / "mask.png")
    return folder


def vace_pipeline():
    from diffusers import WanVACEPipeline

    return WanVACEPipeline.from_pretrained(models.materialize_preset(MODEL), torch_dtype=torch.float32)


def reference(
    media,
    output_type,
    video=True,
    mask="mask.mp4",
    references=("ref1.png", "ref2.png"),
    scale=1.0,
    seed=SEED,
    pipe=None,
):
    """WanVACEPipeline (the tiny preset's, or `pipe`) on the media files, 9 frames, the test's request."""
    pipe = pipe or vace_pipeline()
    mask_frames = None
    if mask is not None:
        mask_frames = decoded_frames(media / mask) if mask.endswith(".mp4") else [Image.open(media / mask)] * 9
    return pipe(
        prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=9, conditioning_scale=scale, output_type=output_type,
        video=decoded_frames(media / "control.mp4") if video else None, mask=mask_frames,
        reference_images=[Image.open(media / name).convert("RGB") for name in references] or None,
        generator=torch.Generator("cpu").manual_seed(seed), **REQUEST,
    ).frames  # fmt: skip


def media_paths(media, items) -> list[str]:
    """Flags with the media files' names (ending .mp4 or .png) as paths in the `media` folder."""
    return [str(media / item) if str(item).endswith((".mp4", ".png")) else str(item) for item in items]


def stage1(out, media, *extra):
    prompt = [] if "--prompts" in extra else ["--prompt", PROMPT, "--seed", SEED]  # a list: each entry's
    argv = ["--model", MODEL, *prompt, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    argv += ["--output_dir", out, *[f"--{key}={value}" for key, value in REQUEST.items()], *extra]
    run_stage(stage1_text_encoder, [str(item) for item in argv])


def test_vace_matches_the_pipeline(tmp_path, media):
    """A control video, a mask video and two reference images, a scale per VACE layer; stage 2 with Splash on
    a dp 2 x sp 2 x tp 2 mesh and again in a process of one CPU device; stage 3 decodes (torch)."""
    out = tmp_path / "run"
    inputs = ["--control_video", media / "control.mp4", "--mask", media / "mask.mp4", "--conditioning_scale", 0.7, 1.3]
    stage1(out, media, *inputs, "--reference_images", media / "ref1.png", media / "ref2.png")
    mesh = ["--attention", "splash", "--dp", 2, "--sp", 2, "--tp", 2, "--scan_blocks", "on"]
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *mesh])
    run_stage(stage3_vae_decoder, ["--input_dir", out, "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    assert config["stage1"]["task"] == "vace" and config["conditioning_scale"] == [0.7, 1.3]
    assert config["stage2"]["scan_blocks"]["scanned"] == {"transformer": [1, 3]}  # blocks 1-2: hint after 2
    assert config["num_frames"] == 9  # the control video's frames
    records = config["stage1"]["inputs"]
    assert [item["size"] for item in records["reference_images"]["items"]] == [[32, 48], [20, 40]]
    assert records["mask"]["frames"] == 9 and records["control_video"]["processed_size"] == [32, 48]
    control = read_tensors(out, config["stage1"])["vace_control"]
    assert control.shape == (1, 96, 5, 4, 6)  # 2 reference frames + 3 latent frames; 16 + 16 + 64 channels

    expected = reference(media, "latent", scale=[0.7, 1.3])
    assert expected.shape == (1, 16, 5, 4, 6)  # the pipeline's latent output keeps the reference frames
    latents = read_tensors(out, config["stage2"])["latents"]
    assert latents.shape == (1, 16, 3, 4, 6)
    assert relative_error(latents, expected[:, :, 2:]) <= TOLERANCE
    # The scales matter: one scale for both layers moves the latents far beyond the tolerance.
    assert relative_error(reference(media, "latent", scale=1.0), expected) > 100 * TOLERANCE
    one = tmp_path / "one-device"
    argv_one = ["--input_dir", out, "--output_dir", one, "--executables", "off"]
    done = run_script("stage2_transformer.py", argv_one, env_overrides={"XLA_FLAGS": ONE_DEVICE})
    assert done.returncode == 0, done.stderr[-2000:]
    assert relative_error(read_tensors(one, read_config(one)["stage2"])["latents"], expected[:, :, 2:]) <= TOLERANCE
    assert read_config(one)["stage2"]["scan_blocks"]["scanned"] == {"transformer": None}  # auto: unrolled
    frames = read_tensors(out, config["stage3"]["frames_file"])["frames_float"]
    expected_frames = torch.from_numpy(reference(media, "np", scale=[0.7, 1.3])[0])
    assert frames.shape == expected_frames.shape == (9, 32, 48, 3)
    assert relative_error(frames, expected_frames) <= TOLERANCE


def test_vace_magcache_equals_diffusers_hooks_with_the_hints_added_on_cached_steps(tmp_path, media):
    """MagCache over the main blocks (the VACE blocks run every step and their hints are still added after
    blocks 0 and 2 when the blocks are skipped, as under diffusers' hooks), the blocks between hints scanned,
    on the default mesh of 8 devices, against WanVACEPipeline with `transformer.enable_cache`."""
    from cache_reference import computed_calls, mag_config

    out = tmp_path / "run"
    inputs = ["--control_video", media / "control.mp4", "--mask", media / "mask.mp4", "--conditioning_scale", 0.7, 1.3]
    stage1(out, media, *inputs, "--reference_images", media / "ref1.png", media / "ref2.png")
    (tmp_path / "ratios.json").write_text(json.dumps([1.0] * 4))
    cache = ["--cache", "magcache", "--cache_mag_ratios", tmp_path / "ratios.json", "--cache_retention_ratio", 0]
    cache += ["--cache_max_skip_steps", 1, "--scan_blocks", "on"]
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", *cache])
    section = read_config(out)["stage2"]
    assert section["step_cache"]["schedule"] == "FCFC"
    assert section["scan_blocks"]["scanned"] == {"transformer": [1, 3]}
    pipe = vace_pipeline()
    ran = computed_calls(pipe.transformer)
    pipe.transformer.enable_cache(mag_config([1.0] * 4, 4, retention_ratio=0, max_skip_steps=1))
    expected = reference(media, "latent", scale=[0.7, 1.3], pipe=pipe)[:, :, 2:]
    assert ran == [True, True, False, False] * 2  # cond, uncond per step
    latents = read_tensors(out, section)["latents"]
    assert relative_error(latents, expected) <= TOLERANCE
    assert relative_error(latents, reference(media, "latent", scale=[0.7, 1.3])[:, :, 2:]) > 100 * TOLERANCE


def test_vace_quantized_and_with_an_adapter_matches_the_pipeline_so_changed(tmp_path, media):
    """One stage-1 folder (a control video, one reference image), two stage 2s on the default mesh of 8
    devices: `--quantize int8_weight` converts every linear of the main and the VACE blocks (their projections
    too), against the pipeline whose linears hold the same dequantized weights (tests/test_quantize.py's
    scheme); `--lora` with an adapter on both lists of blocks' attention and FFN projections, against
    WanVACEPipeline.load_lora_weights of the same file."""
    from helpers import dequantize_linears, diffusers_file

    out = tmp_path / "run"
    stage1(out, media, "--control_video", media / "control.mp4", "--reference_images", media / "ref1.png")
    targets = r"(vace_)?blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))"
    adapter = diffusers_file(tmp_path, "vace.safetensors", MODEL, seed=11, targets=targets)
    runs = {"quantized": ["--quantize", "int8_weight"], "adapter": ["--lora", adapter]}
    for name, flags in runs.items():
        run_stage(
            stage2_transformer, ["--input_dir", out, "--output_dir", tmp_path / name, "--executables", "off", *flags]
        )
    call = {"mask": None, "references": ("ref1.png",)}
    plain = reference(media, "latent", **call)[:, :, 1:]

    quantized = vace_pipeline()
    names = dequantize_linears(quantized.transformer, r"(vace_)?blocks\.", "int8_weight")
    vace = [name for name in names if name.startswith("vace_blocks")]
    assert len(vace) == 2 * (10 + 1) + 1  # attention and FFN, proj_out in each, proj_in in the first
    with_adapter = vace_pipeline()
    with_adapter.load_lora_weights(adapter)
    for name, pipe in (("quantized", quantized), ("adapter", with_adapter)):
        latents = read_tensors(tmp_path / name, read_config(tmp_path / name)["stage2"])["latents"]
        expected = reference(media, "latent", pipe=pipe, **call)[:, :, 1:]
        assert relative_error(latents, expected) <= TOLERANCE, name
        assert relative_error(latents, plain) > 10 * relative_error(latents, expected), name  # it acts


def test_an_empty_list_of_reference_images_is_refused(tmp_path, media, capsys):
    entry = {"prompt": PROMPT, "control_video": "control.mp4", "reference_images": []}
    (media / "empty.jsonl").write_text(json.dumps(entry) + "\n")
    argv = ["--model", MODEL, "--prompts", media / "empty.jsonl", "--output_dir", tmp_path / "out"]
    expect_user_error(capsys, stage1_text_encoder, argv, "'reference_images' must be a path (a string) or a list")
    assert not (tmp_path / "out").exists()


def test_vace_videos_batch_by_their_shapes(tmp_path, media):
    """A prompt list of three VACE videos on the default mesh of 8 devices: a control video with a mask video
    and a reference image, a reference image alone (a zero control video and a mask of ones: the same shapes,
    one stage-2 batch of 2), and a control video with one mask image for every frame (one latent frame
    fewer: a group of its own); each video equals the pipeline run alone, as WanVACEPipeline runs one video
    at a time. `reference_images` as a JSON list of paths."""
    entries = [
        {
            "name": "edge",
            "control_video": "control.mp4",
            "mask": "mask.mp4",
            "reference_images": ["ref1.png"],
            "seed": SEED,
        },
        {"name": "refs", "reference_images": ["ref2.png"], "seed": SEED + 1},
        {"name": "plain", "control_video": "control.mp4", "mask": "mask.png", "seed": SEED},
    ]
    (media / "list.jsonl").write_text("".join(json.dumps({"prompt": PROMPT, **entry}) + "\n" for entry in entries))
    out = tmp_path / "batch"
    stage1(out, media, "--prompts", media / "list.jsonl", "--num_frames", 9)
    run_stage(stage2_transformer, ["--input_dir", out, "--executables", "off", "--batch_size", 2])
    calls = {
        "edge": {"references": ("ref1.png",)},
        "refs": {"video": False, "mask": None, "references": ("ref2.png",), "seed": SEED + 1},
        "plain": {"mask": "mask.png", "references": ()},
    }
    for name, call in calls.items():
        latents = read_tensors(out / name, read_config(out / name)["stage2"])["latents"]
        expected = reference(media, "latent", **call)
        assert relative_error(latents, expected[:, :, len(call["references"]) :]) <= TOLERANCE, name
    assert read_config(out / "edge")["stage2"]["batch"]["size"] == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "is a Wan VACE model: give --control_video (with --mask), --reference_images, or both"),
        (["--mask", "mask.mp4"], "--mask: a mask says where to redraw a --control_video; give the video too"),
        (["--control_video", "control.mp4", "--mask", "short_mask.mp4"], "--mask has 5 frames; the run takes 9"),
        (["--control_video", "wide.mp4"], "at 32x32 (its own size, shrunk to fit the request when larger, floored"),
        (["--control_video", "small.mp4"], "give --height 16 --width 32, its own size, or resize the video to 32x48"),
        (["--control_video", "control.mp4", "--num_frames", "13"], "--num_frames 13: --control_video has 9 frames"),
        (["--control_video", "not.mp4"], "is not a readable video"),
        (["--reference_images", *["ref1.png"] * 3], "3 images, more than the 2 latent frames of 5 frames"),
        (["--num_frames", "65", "--reference_images", *["ref1.png"] * 17], "more than the 32 the transformer's"),
        (["--control_video", "control.mp4", "--conditioning_scale", "1", "2", "3"], "one per VACE layer (2: layers"),
        (["--video", "control.mp4"], "takes no --video"),
        (["--tiny-wan2.1", "--conditioning_scale", "0.5"], "--conditioning_scale applies to Wan VACE models"),
    ],
    ids=[
        "no-inputs", "mask-without-video", "mask-length", "control-size", "control-own-size", "more-frames",
        "undecodable", "references-past-frames", "references-past-rope", "scales-per-layer", "v2v-flag", "not-vace",
    ],
)  # fmt: skip
def test_bad_vace_requests_are_refused_before_loading(capsys, tmp_path, media, extra, message):
    (media / "not.mp4").write_text("no video here")
    model = "tiny-wan2.1" if "--tiny-wan2.1" in extra else MODEL
    flags = media_paths(media, [item for item in extra if item != "--tiny-wan2.1"])
    argv = ["--model", model, "--prompt", PROMPT, "--output_dir", tmp_path / "out"]
    expect_user_error(capsys, stage1_text_encoder, [*argv, *flags], message)
    assert not (tmp_path / "out").exists()
