"""Wan Animate (tpu_video/models/wan/animate.py; diffusers' WanAnimatePipeline and WanAnimateTransformer3DModel:
Wan 2.1 blocks, a motion encoder over the face frames, a face encoder, face adapters after every other block).

Its transformer under torchax: the stock module, jitted and laid out by Wan's rule table on the mesh, against
its eager forward (fp32, 1e-5 relative). The stages on the tiny Animate preset against the pipeline run eagerly
on the same components, folder, decoded videos and image: the latents where the pipeline returns them and the
final frames, 1e-4 relative (as tests/test_wan.py: the staged run batches [cond, uncond] where the pipeline
makes two calls).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import sharding
import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import (
    Sample,
    attention_plan,
    decoded_frames,
    expect_user_error,
    relative_error,
    run_stage,
    stop_stage2_after,
    write_image,
    write_video,
)
from tpu_video import models
from tpu_video.models import wan
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from utils import read_config, read_tensors

TOLERANCE = 1e-5  # fp32, relative (Frobenius)
STAGES_TOLERANCE = 1e-4
MODEL = "tiny-wan2.2-animate"
PROMPT, NEGATIVE, SEED = "a dancer on a stage", "blurry", 3
REQUEST = {"height": 32, "width": 48, "num_inference_steps": 4}
SEGMENT = 5  # frames: the pose video's 7 make two segments (1 carried over), padded (reflected) to 9, cut back to 7
LATENT_FRAMES = 3  # the segment's; the model also gets the reference image's frame first


def animate_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    """One denoiser call of a segment: the noisy latents with the reference and condition latents on channels,
    the prompt, CLIP tokens, the pose video's latents and the face frames (4 per latent frame after the first)."""
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 36, LATENT_FRAMES + 1, 4, 6, generator=generator),
        "timestep": torch.tensor([700] * batch),
        "encoder_hidden_states": torch.randn(batch, 8, 32, generator=generator),
        "encoder_hidden_states_image": torch.randn(batch, 5, 16, generator=generator),
        "pose_hidden_states": torch.randn(batch, 16, LATENT_FRAMES, 4, 6, generator=generator),
        "face_pixel_values": torch.rand(batch, 3, 4 * (LATENT_FRAMES - 1) + 1, 16, 16, generator=generator) * 2 - 1,
    }


def test_the_animate_transformer_jitted_equals_eager():
    """The motion encoder's QR, blur convolutions and the face adapter's per-frame cross-attention compile as
    they are (sharded, with Splash: through the stages below)."""
    with torch.no_grad():
        expected = wan.presets.tiny_animate_transformer()(**animate_inputs(), return_dict=False)[0]
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(1, 1, 1)))
    rules = wan.transformer_rules("megatron").nested("transformer.")
    compiled = runtime.compile(Sample(wan.presets.tiny_animate_transformer()), rules)
    plan = attention_plan("xla", runtime.mesh, heads=8)
    with attention_backend(runtime.env, plan, runtime.mesh):
        got = runtime.to_host(compiled(**runtime.to_device(animate_inputs())))
    assert relative_error(got, expected) <= TOLERANCE


def test_every_animate_weight_has_a_layout():
    """Wan's table (its Animate rules are optional, so the other Wan models still fit it): the face adapters'
    attention split like the blocks', the motion and face encoders whole on every device."""
    names = [name for name, _ in wan.presets.tiny_animate_transformer().named_parameters()]
    layouts = wan.transformer_rules("megatron").assign(names)
    assert layouts["face_adapter.1.to_q.weight"] == sharding.COLUMN
    assert layouts["face_adapter.1.to_out.weight"] == sharding.ROW
    assert layouts["motion_encoder.conv_in.weight"] == layouts["face_encoder.conv2.weight"] == sharding.REPLICATED
    assert wan.transformer_rules("replicated_out").assign(names)["face_adapter.1.to_out.weight"] == sharding.REPLICATED


def square(t, y, x):
    """A face video's frames: a bright square moving right on grey."""
    inside = (abs(y - 12) < 5) & (abs(x - 8 - t) < 5)
    return np.repeat((np.where(inside, 230, 90))[..., None], 3, axis=-1)


def person(t, y, x):
    """A mask video: white (redraw) on a block that moves a pixel a frame, black elsewhere."""
    return np.repeat((((abs(x - 20 - t) < 8) & (y > 6)) * 255)[..., None], 3, axis=-1)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("animate")
    write_video(folder / "pose.mp4", frames=7, height=32, width=48)
    write_video(folder / "face.mp4", frames=7, height=24, width=24, pattern=square)  # resized to the encoder's 16
    write_video(folder / "background.mp4", frames=7, height=32, width=48, pattern=lambda t, y, x: square(t, y, x) // 2)
    write_video(folder / "mask.mp4", frames=7, height=32, width=48, pattern=person)
    write_video(folder / "short_face.mp4", frames=5, height=16, width=16)
    write_image(folder / "character.png", 40, 56, seed=4)  # another size: resized with the pipeline's fill
    return folder


def animate_pipeline():
    from diffusers import WanAnimatePipeline

    return WanAnimatePipeline.from_pretrained(models.materialize_preset(MODEL), torch_dtype=torch.float32)


def reference(
    media, mode="animate", guidance_scale=1.0, pose="pose.mp4", pipe=None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """WanAnimatePipeline (the preset's saved folder, or `pipe`) on the media files and the test's request: each
    segment's final latents (before the pipeline de-normalises them for its decode: seen at each segment's last
    step) and the video's frames."""
    pipe = pipe or animate_pipeline()
    replace = {}
    if mode == "replace":
        replace = {
            name: decoded_frames(media / f"{name.split('_')[0]}.mp4") for name in ("background_video", "mask_video")
        }
    segments = []

    def keep(pipe, i, t, tensors):
        if i == REQUEST["num_inference_steps"] - 1:
            segments.append(tensors["latents"])
        return tensors

    frames = pipe(
        image=Image.open(media / "character.png").convert("RGB"),
        pose_video=decoded_frames(media / pose),
        face_video=decoded_frames(media / "face.mp4"),
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        segment_frame_length=SEGMENT,
        mode=mode,
        guidance_scale=guidance_scale,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(SEED),
        callback_on_step_end=keep,
        **replace,
        **REQUEST,
    ).frames
    return segments, torch.from_numpy(frames[0])


def stage1_argv(out, media, *extra) -> list[str]:
    argv = ["--model", MODEL, "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--seed", SEED, "--dtype", "fp32"]
    argv += ["--image", media / "character.png", "--pose_video", media / "pose.mp4", "--face_video", media / "face.mp4"]
    argv += ["--segment_frame_length", SEGMENT, "--output_dir", out]
    argv += [f"--{key}={value}" for key, value in REQUEST.items()]
    return [str(item) for item in (*argv, *extra)]


@pytest.mark.parametrize(
    "mode, guidance, mesh",
    [
        ("animate", 2.0, ["--attention", "splash", "--dp", 2, "--sp", 2, "--tp", 2, "--scan_blocks", "on"]),
        ("replace", 1.0, ["--attention", "xla", "--sp", 2, "--tp", 4]),
    ],
)
def test_animate_matches_the_pipeline(tmp_path, media, mode, guidance, mesh):
    """Two segments, the second conditioned on the first's decoded last frame. Animate with guidance (the face
    blanked in the unconditional branch) on a dp 2 x sp 2 x tp 2 Splash mesh with the blocks between face
    adapters scanned; replace (the background outside the mask) at the pipeline's default scale 1 on sp 2 x tp 4.
    Stage 3 decodes each segment, joins them and keeps the pose video's 7 frames."""
    out = tmp_path / mode
    extra = ["--mode", mode, "--guidance_scale", guidance]
    if mode == "replace":
        extra += ["--background_video", media / "background.mp4", "--mask_video", media / "mask.mp4"]
    run_stage(stage1_text_encoder, stage1_argv(out, media, *extra))
    run_stage(stage2_transformer, [str(item) for item in ["--input_dir", out, "--executables", "off", *mesh]])
    run_stage(stage3_vae_decoder, ["--input_dir", str(out), "--backend", "torch", "--save_frames"])
    config = read_config(out, needs="stage3")
    assert config["stage1"]["task"] == "animate" and config["mode"] == mode and config["num_frames"] == 7
    assert config["stage2"]["segments"] == {"count": 2, "overlap_frames": 1, "frames_kept": 7}
    assert config["stage3"]["frames"] == 7
    embeds = read_tensors(out, config["stage1"])
    assert embeds["animate_condition"].shape == (1, 20, 2, 4, 6)  # the first segment's 2 latent frames
    assert embeds["pose_latents"].shape == (2, 16, 2, 4, 6) and embeds["face_pixels"].shape == (1, 3, 9, 16, 16)
    pipe = animate_pipeline()
    if mode == "replace":  # kept as the 8-bit values the processors start from: their pixels again, bit for bit
        for name, processor in (("background", pipe.video_processor), ("mask", pipe.video_processor_for_mask)):
            padded = pipe.pad_video_frames(decoded_frames(media / f"{name}.mp4"), 9)
            processed = processor.preprocess_video(padded, height=32, width=48).float()
            stored = embeds[f"{name}_pixels"]
            assert stored.dtype == torch.uint8 and stored.shape == processed.shape
            assert torch.equal(wan.animate.processed_pixels(stored, name == "background"), processed)

    expected, expected_frames = reference(media, mode, guidance, pipe=pipe)
    latents = read_tensors(out, config["stage2"])["latents"]
    assert latents.shape == (2, 16, 2, 4, 6) and len(expected) == 2  # one segment per row, no character frame
    for row, segment in enumerate(expected):  # each (1, 16, 3, 4, 6)
        assert relative_error(latents[row : row + 1], segment[:, :, 1:]) <= STAGES_TOLERANCE
    frames = read_tensors(out, config["stage3"]["frames_file"])["frames_float"]
    assert frames.shape == expected_frames.shape == (7, 32, 48, 3)
    assert relative_error(frames, expected_frames) <= STAGES_TOLERANCE


def test_an_animate_run_stopped_in_its_second_segment_resumes_to_the_same_latents(tmp_path, media, monkeypatch):
    """SIGTERM after step 2 of the second segment: the checkpoint holds the first segment's latents too, and
    --resume rebuilds the second segment's condition from them and goes on from its step 2 (the same mesh and
    programs: bit-identical to the run that was not stopped)."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    run_stage(stage1_text_encoder, stage1_argv(out, media, "--guidance_scale", 2.0))
    run_stage(stage2_transformer, ["--input_dir", str(out), "--output_dir", str(whole), "--executables", "off"])
    stop_stage2_after(
        monkeypatch, ["--input_dir", out, "--executables", "off"], steps=6, said="after step 2 of 4 in segment 2 of 2"
    )
    run_stage(stage2_transformer, ["--input_dir", str(out), "--executables", "off", "--resume"])
    latents = read_tensors(out, read_config(out)["stage2"])["latents"]
    assert torch.equal(latents, read_tensors(whole, read_config(whole)["stage2"])["latents"])


def test_animate_videos_of_one_character_batch_as_the_pipeline_runs_each(tmp_path, media):
    """Two videos of the same character (its CLIP tokens the same: one row for the batch) with different pose
    videos (one row each), guidance 2, as one stage-2 batch of 2 on the default mesh: each video's segments equal
    the pipeline run alone."""
    entries = [
        {"name": "one", "pose_video": str(media / "pose.mp4")},
        {"name": "two", "pose_video": str(media / "background.mp4")},
    ]
    (tmp_path / "list.jsonl").write_text("".join(json.dumps({"prompt": PROMPT, **entry}) + "\n" for entry in entries))
    argv = stage1_argv(tmp_path / "out", media, "--guidance_scale", "2")
    at = argv.index("--pose_video")
    del argv[at : at + 2]
    at = argv.index("--prompt")
    argv[at : at + 2] = ["--prompts", str(tmp_path / "list.jsonl")]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", str(tmp_path / "out"), "--executables", "off", "--batch_size", "2"])
    for name, pose in (("one", "pose.mp4"), ("two", "background.mp4")):
        folder = tmp_path / "out" / name
        config = read_config(folder)
        assert config["stage2"]["batch"]["size"] == 2 and config["stage2"]["batch"]["padding"] == 0
        latents = read_tensors(folder, config["stage2"])["latents"]
        expected, _ = reference(media, guidance_scale=2.0, pose=pose)
        for row, segment in enumerate(expected):
            assert relative_error(latents[row : row + 1], segment[:, :, 1:]) <= STAGES_TOLERANCE, (name, row)


def test_animate_step_caches_equal_their_references_segment_by_segment(tmp_path, media, monkeypatch):
    """One stage-1 folder, two stage 2s on the default mesh of 8 devices, the blocks between face adapters
    scanned: MagCache against diffusers' hooks on WanAnimatePipeline's transformer (its block given Wan's
    registry entry, as our cache is given it), and the interval cache against its definition (the outer blocks
    run apart: blocks 1-2 scanned). Each segment starts its cache again, as diffusers' state resets after
    num_inference_steps calls; the face adapters still add to the video tokens after skipped blocks."""
    from diffusers.models.transformers import transformer_wan, transformer_wan_animate

    from cache_reference import IntervalReference, computed_calls, mag_config, register_block_as

    out = tmp_path / "run"
    run_stage(stage1_text_encoder, stage1_argv(out, media))
    (tmp_path / "ratios.json").write_text(json.dumps([1.0] * 4))
    caches = {  # MagCache skips at most one step in a row
        "magcache": ["--cache_mag_ratios", tmp_path / "ratios.json", "--cache_retention_ratio", 0],
        "interval": ["--cache_start_step", 1, "--cache_end_step", 4, "--cache_step_interval", 2],
    }
    caches["magcache"] += ["--cache_max_skip_steps", 1]
    sections = {}
    for kind, flags in caches.items():
        argv = ["--input_dir", out, "--output_dir", tmp_path / kind, "--executables", "off", "--cache", kind]
        run_stage(stage2_transformer, [str(item) for item in (*argv, *flags)])
        sections[kind] = read_config(tmp_path / kind)["stage2"]
        assert sections[kind]["scan_blocks"]["scanned"] == {"transformer": [1, 3]}
    assert sections["magcache"]["step_cache"]["schedule"] == "FCFC"  # each segment's
    assert {"median full step", "median cached step"} <= set(sections["magcache"]["step_cache"])  # both segments'
    assert "denoise" in sections["magcache"]["seconds"]
    assert sections["interval"]["step_cache"]["schedule"] == "FFCF"

    register_block_as(transformer_wan_animate.WanTransformerBlock, transformer_wan.WanTransformerBlock, monkeypatch)
    hooked = animate_pipeline()
    ran = computed_calls(hooked.transformer)
    hooked.transformer.enable_cache(mag_config([1.0] * 4, 4, retention_ratio=0, max_skip_steps=1))
    interval = animate_pipeline()
    IntervalReference(interval.transformer, 1, 4, 2, steps=4, text=False)
    plain, _ = reference(media)
    for kind, pipe in (("magcache", hooked), ("interval", interval)):
        expected, _ = reference(media, pipe=pipe)
        latents = read_tensors(tmp_path / kind, sections[kind])["latents"]
        for row, segment in enumerate(expected):
            assert relative_error(latents[row : row + 1], segment[:, :, 1:]) <= STAGES_TOLERANCE, (kind, row)
            assert relative_error(segment, plain[row]) > 10 * STAGES_TOLERANCE, (kind, row)  # the cache acts
    assert ran == [True, False] * 4  # two segments of 4 steps, one call each


def test_animate_quantized_and_with_an_adapter_matches_the_pipeline_so_changed(tmp_path, media):
    """One stage-1 folder, two stage 2s on the default mesh of 8 devices: `--quantize int8_weight` converts every
    linear of the blocks and the face adapters, against the pipeline whose linears hold the same dequantized
    weights (tests/test_quantize.py's scheme); `--lora` with an adapter on the blocks' attention and FFN
    projections and the face adapters' projections, against WanAnimatePipeline.load_lora_weights of the file."""
    from helpers import dequantize_linears, diffusers_file

    out = tmp_path / "run"
    run_stage(stage1_text_encoder, stage1_argv(out, media))
    targets = (
        r"blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))|face_adapter\.\d+\.to_[qkv]"
    )
    adapter = diffusers_file(tmp_path, "animate.safetensors", MODEL, seed=11, targets=targets)
    for name, flags in {"quantized": ["--quantize", "int8_weight"], "adapter": ["--lora", str(adapter)]}.items():
        argv = ["--input_dir", str(out), "--output_dir", str(tmp_path / name), "--executables", "off", *flags]
        run_stage(stage2_transformer, argv)
    plain, _ = reference(media)
    quantized = animate_pipeline()
    names = dequantize_linears(quantized.transformer, r"(blocks|face_adapter)\.\d+\.", "int8_weight")
    assert len([name for name in names if name.startswith("face_adapter")]) == 2 * 4  # q, k, v, out in each
    with_adapter = animate_pipeline()
    with_adapter.load_lora_weights(adapter)
    for name, pipe in (("quantized", quantized), ("adapter", with_adapter)):
        latents = read_tensors(tmp_path / name, read_config(tmp_path / name)["stage2"])["latents"]
        expected, _ = reference(media, pipe=pipe)
        for row, segment in enumerate(expected):
            error = relative_error(latents[row : row + 1], segment[:, :, 1:])
            assert error <= STAGES_TOLERANCE, (name, row)
            assert relative_error(latents[row : row + 1], plain[row][:, :, 1:]) > 10 * error, (name, row)  # it acts


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--face_video", "short_face.mp4"], "--face_video has 5 frames and --pose_video 7"),
        (["--mode", "replace", "--mask_video", "mask.mp4"], "--mode replace: give --background_video and --mask_video"),
        (["--background_video", "background.mp4"], "--background_video: only --mode replace uses it"),
        (["--segment_frame_length", 8], "--segment_frame_length 8 must be 4n+1"),
        (["--prev_segment_conditioning_frames", 2], "must be 1 or 5"),
        (["--prev_segment_conditioning_frames", 5], "must exceed twice --prev_segment_conditioning_frames 5"),
        (["--num_frames", 1], "1 frame(s) (--num_frames) must be more than --prev_segment_conditioning_frames 1"),
        (["--image", None], "is Wan Animate: give the character with --image PATH"),
    ],
    ids=["face-length", "replace-without-background", "background-when-animating", "segment-length",
         "conditioning-frames", "segment-too-short", "one-frame", "no-image"],
)  # fmt: skip
def test_bad_animate_requests_are_refused_before_loading(capsys, tmp_path, media, extra, message):
    """One error line, exit 2, nothing written, before any weights load."""
    argv = stage1_argv(tmp_path / "out", media)
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in argv:  # the test's own value replaced (None: the flag left out)
            at = argv.index(flag)
            del argv[at : at + 2]
        if value is not None:
            argv += [flag, str(media / value) if str(value).endswith(".mp4") else str(value)]
    expect_user_error(capsys, stage1_text_encoder, argv, message)
    assert not (tmp_path / "out").exists()


def test_the_plan_between_segments_compiles_each_program_a_segment_calls():
    """`--plan`'s view of the work between segments (wan/vae_encode.py: coder_plan; planning/between_loops.py): the six
    programs compile from the planned meta inputs on stage 2's 8-device mesh (XLA:CPU here; the TPU compiler's
    numbers for the 14B are in docs/planning.md#wan-animate), each program beside the step's arguments, the later
    segments' steps beside the VAE's weights, with the calls one 77-frame segment makes (20 latent frames: 1, 1,
    18; encoded as 1 frame then 19 chunks of 4)."""
    import functools
    from types import SimpleNamespace

    from tpu_video.engine.decode import split_over_mesh
    from tpu_video.engine.meta import meta_module
    from tpu_video.planning.between_loops import plan_between_loops
    from tpu_video.planning.plan import Compiled, compile_module
    from tpu_video.planning.tpus import parse_target

    source, family = models.resolve_model(MODEL)
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(2, 2, 2)))
    decoder = family.Decoder(meta_module(source, "vae", torch.float32), family.latents_normalization(source))
    latents_shape, pixels_shape = (1, 16, 20, 4, 16), (1, 3, 77, 32, 128)
    layout = split_over_mesh(latents_shape, runtime.mesh)
    module, inputs, calls = wan.vae_encode.coder_plan(decoder, latents_shape, pixels_shape, runtime, layout)
    loop = SimpleNamespace(between_plan=lambda runtime: (module, inputs, calls, wan.animate.VAE_ATTENTION))
    step = Compiled(seconds=0.0, memory={"arguments": 3 * 2**30, "total": 4 * 2**30})
    compiling = functools.partial(
        compile_module, rules=sharding.REPLICATED_TABLE, mesh=runtime.mesh, env=runtime.env
    )  # as stage 2's plan compiles them (planning/plan.py: plan_stage2)
    report = plan_between_loops(loop, runtime, parse_target("v6e-8"), step, compiling)
    assert report["calls"] == {
        "first": 1, "second": 1, "steady": 18, "encode_first": 1, "encode_second": 1, "encode_steady": 18
    }  # fmt: skip
    assert report["fits"] and report["resident_bytes"] == 3 * 2**30
    assert all(need > 3 * 2**30 for need in report["hbm_bytes_per_program"].values())
    weights = sum(parameter.numel() * 4 for parameter in decoder.vae.parameters())  # float32, on every device
    assert report["weights_bytes"] == weights and report["later_steps_hbm_bytes_per_device"] == 4 * 2**30 + weights
    assert report["flops_per_device"] > 0
