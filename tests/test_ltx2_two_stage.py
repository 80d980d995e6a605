"""LTX-2's production path (tpu_video/models/ltx2: the `--sigmas` schedules, `start_from`, the upsampler): the
distilled schedule and the two-stage pipeline (a first pass, the x2 latent upsampler, a refine at twice the size)
through the CLIs, each step against diffusers' own call on the same tiny components; image-to-video's is in
tests/test_ltx2_i2v.py. Tolerances as in tests/test_ltx2.py: fp32, 1e-5 relative (Frobenius).
"""

from __future__ import annotations

import torch

import stage1_text_encoder
import stage2_transformer
import stage3_vae_decoder
from helpers import expect_user_error, pipeline, relative_error, run_stage
from helpers import ltx2_reference as reference
from tpu_video import models
from utils import Request, read_config, read_tensors

TOLERANCE = 1e-5
PROMPT, NEGATIVE, SEED = "a robot dancing", "blurry", 7
OFF = {"stg_scale": 0.0, "audio_stg_scale": 0.0}
NO_CFG = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0}
NO_MODALITY = {"modality_scale": 1.0, "audio_modality_scale": 1.0}


def test_a_schedule_brings_its_defaults_once():
    """`--sigmas distilled` brings its step count and turns the guidance off where not given; a later stage that
    repeats the stored value brings nothing again (stage 1's given scales stay)."""
    from tpu_video.cli.options import with_implied

    options = models.ltx2.OPTIONS
    brought = with_implied(options, {"sigmas": "distilled", "audio_guidance_scale": 7.0})
    assert brought["num_inference_steps"] == 8 and brought["guidance_scale"] == 1.0
    assert brought["audio_guidance_scale"] == 7.0 and brought["stg_scale"] == 0.0
    base = {"model_family": "ltx2", "model_id": "tiny-ltx2.3", "prompt": "p", "negative_prompt": "", "dtype": "fp32"}
    base |= {"height": 64, "width": 64, "num_frames": 9, "fps": 24, "num_inference_steps": 8, "guidance_scale": 1.0}
    stored = Request(**base, seed=0, options={"sigmas": "distilled", "audio_guidance_scale": 7.0})
    assert with_implied(options, {"sigmas": "distilled"}, stored) == {"sigmas": "distilled"}
    assert with_implied(options, {"sigmas": "distilled_refine"}, stored)["noise_scale"] == 0.909375


def test_the_two_stage_pipeline_matches_diffusers_pass_by_pass(tmp_path):
    """Diffusers' two-stage example through the CLIs, on tiny LTX-2.3 in fp32, compared after every step:

    1. stage 1 `--sigmas distilled` alone, stage 2: 8 steps of DISTILLED_SIGMA_VALUES (through the scheduler
       config's dynamic shift, as the pipeline's own call), guidance off, one pass per step; the reference is
       LTX2Pipeline called with `sigmas=DISTILLED_SIGMA_VALUES` and every guidance term off;
    2. stage 2 `--upsample` with the preset's own tiny x2 upsampler (its `latent_upsampler` subfolder):
       LTX2LatentUpsamplePipeline with `latents=` the first call's, AdaIN 0.5 and tone map 0.3;
    3. stage 2 `--start_latents` from the upsampled folder at twice the size, `--sigmas distilled_refine` (3
       sigmas as given, renoised by 0.909375 from seed 11), Splash on sp 2 x tp 4: LTX2Pipeline with its
       scheduler rebuilt (use_dynamic_shifting=False, shift_terminal=None), `latents=` the upsampled,
       `audio_latents=` the first call's, `noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0]`;
    4. stage 3 (torch) of the refined folder: frames and waveform against that call's output_type="np"."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES, STAGE_2_DISTILLED_SIGMA_VALUES

    first, up, second = tmp_path / "first", tmp_path / "up", tmp_path / "second"
    argv = ["--model", "tiny-ltx2.3", "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, [*argv, "--seed", SEED, "--sigmas", "distilled", "--output_dir", first])
    run_stage(stage2_transformer, ["--input_dir", first, "--executables", "off"])
    config = read_config(first, needs="stage2")
    assert config["num_inference_steps"] == len(DISTILLED_SIGMA_VALUES) == 8 and config["sigmas"] == "distilled"
    assert config["stage2"]["guidance"]["branches"] == ["cond"] and config["stage2"]["mesh"]["dp"] == 1
    tensors = read_tensors(first, config["stage2"])
    off = {**NO_CFG, **OFF, **NO_MODALITY}
    pipe = pipeline("tiny-ltx2.3")
    video, audio = reference(pipe, config, "latent", sigmas=DISTILLED_SIGMA_VALUES, **off)
    assert relative_error(tensors["latents"], video) <= TOLERANCE
    assert relative_error(tensors["audio_latents"], audio) <= TOLERANCE

    # The preset's own upsampler (its latent_upsampler subfolder, where the published repositories keep it).
    location = models.materialize_preset("tiny-ltx2.3") / "latent_upsampler"
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(location).eval()
    filters = {"adain_factor": 0.5, "tone_map_compression_ratio": 0.3}
    step = ["--input_dir", first, "--upsample", "--output_dir", up]
    run_stage(stage2_transformer, [*step, "--adain_factor", 0.5, "--tone_map_compression_ratio", 0.3])
    upsampled = read_config(up, needs="stage2")
    height, width = 2 * config["height"], 2 * config["width"]
    assert (upsampled["height"], upsampled["width"]) == (height, width)
    assert upsampled["stage2"]["upsampled"]["sha256"] == config["stage2"]["sha256"]
    upsample_pipe = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)
    larger = upsample_pipe(latents=video, output_type="latent", return_dict=False, **filters)[0]
    ours = read_tensors(up, upsampled["stage2"])
    assert ours["latents"].shape == larger.shape and larger.shape[-2:] == (2 * video.shape[-2], 2 * video.shape[-1])
    assert relative_error(ours["latents"], larger) <= TOLERANCE
    assert torch.equal(ours["audio_latents"], tensors["audio_latents"])  # passed through
    run_stage(stage3_vae_decoder, ["--input_dir", up, "--backend", "torch", "--preview_frames", 0])  # a preview
    assert read_config(up, needs="stage3")["stage3"]["height"] == height

    refine = ["--input_dir", first, "--start_latents", up, "--output_dir", second, "--executables", "off"]
    refine += ["--attention", "splash", "--sp", 2, "--tp", 4]  # the refine with the Splash kernel on a mesh
    run_stage(stage2_transformer, [*refine, "--sigmas", "distilled_refine", "--seed", 11])
    run_stage(stage3_vae_decoder, ["--input_dir", second, "--backend", "torch", "--save_frames"])
    refined = read_config(second, needs="stage3")
    assert (refined["height"], refined["width"]) == (height, width)
    overrides = refined["stage2"]["overrides"]
    assert overrides["num_inference_steps"] == [8, 3] and overrides["noise_scale"] == [None, 0.909375]
    start = refined["stage2"]["start_latents"]
    assert start["folder"] == "up" and start["upsampled"] == {"from_sha256": config["stage2"]["sha256"], "scale": 2}
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None
    )
    again = {**config, "num_inference_steps": 3, "seed": 11, "height": height, "width": width}
    noise_scale = STAGE_2_DISTILLED_SIGMA_VALUES[0]
    extra = {"sigmas": STAGE_2_DISTILLED_SIGMA_VALUES, "noise_scale": noise_scale, "audio_latents": audio, **off}
    video_2, audio_2 = reference(pipe, again, "latent", latents=larger, **extra)
    ours = read_tensors(second, refined["stage2"])
    assert relative_error(ours["latents"], video_2) <= TOLERANCE
    assert relative_error(ours["audio_latents"], audio_2) <= TOLERANCE
    frames, waveform = reference(pipe, again, "np", latents=larger, **extra)
    saved = read_tensors(second, refined["stage3"]["frames_file"])
    assert relative_error(saved["frames_float"], torch.from_numpy(frames[0])) <= TOLERANCE
    assert relative_error(saved["waveform"], waveform[0]) <= TOLERANCE


def test_the_upsample_step_plans_for_a_tpu_and_refuses_a_family_without_one(tmp_path, capsys):
    """`--upsample --plan` compiles the step's one program for v6e-8 (libtpu) from the model and the first pass's
    request flags: the preset's own upsampler built from its config on the meta device, the first pass's latent
    grid in, float32, every device on sp; a Wan model has no upsampler to plan."""
    import json

    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    out = tmp_path / "plan.json"
    request = ["--height", 64, "--width", 96, "--num_frames", 9]
    plan = ["--upsample", "--plan", "v6e-8", "--model", "tiny-ltx2.3", *request, "--plan_json", out]
    run_stage(stage2_transformer, plan)
    report = json.loads(out.read_text())
    config = LTX2LatentUpsamplerModel.load_config(models.materialize_preset("tiny-ltx2.3") / "latent_upsampler")
    assert report["fits"] and report["stage"] == 2 and report["mesh"] == {"dp": 1, "sp": 8, "tp": 1}
    recorded = {"upsampler": "tiny-ltx2.3/latent_upsampler", "adain_factor": 0.0, "tone_map_compression_ratio": 0.0}
    assert report["upsample"] == {**recorded, "mid_channels": config["mid_channels"]}
    assert report["programs"] == ["Upsample ([1, 8, 3, 4, 6])"] and report["dtype"] == "float32"  # the latent grid
    assert report["upsampled_video"] == {"height": 128, "width": 192}
    weights = sum(p.numel() for p in LTX2LatentUpsamplerModel.from_config(config).parameters()) * 4  # fp32
    latents = 8 * 3 * 4 * 6 * 4
    # Replicated on every device; the TPU's tiled layouts pad these small tensors (2.19 MB for 0.65 MB here).
    assert report["hbm_bytes_per_device"]["arguments"] >= weights + latents
    assert report["upsample_seconds_lower_bound"] > 0 and "--upsample:" in capsys.readouterr().out
    for flags, message in (
        (["--model", "tiny-ltx2.3", "--seed", 3], "--seed does not apply"),
        (["--model", "tiny-ltx2.3", "--save_executables", tmp_path / "x"], "--save_executables is not supported"),
        (["--model", "tiny-ltx2.3", "--lora", tmp_path / "x.safetensors"], "--lora belongs to a denoise"),
    ):
        expect_user_error(capsys, stage2_transformer, ["--upsample", "--plan", "v6e-8", *flags], message)
    expect_user_error(
        capsys, stage2_transformer, ["--upsample", "--plan", "v6e-8", "--model", "tiny-wan2.1"], "wan has no latent"
    )


def test_the_upsampler_split_over_the_devices_equals_it_eagerly():
    """The step's program (the upsampler and both filters) with the latents split along width over 8 CPU devices,
    as the step places a latent width that 8 divides, against the same module run eagerly (fp32, 1e-5); the
    two-stage test above holds the module to diffusers' upsample pipeline."""
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    from sharding import SP
    from tpu_video.engine.decode import split_over_mesh
    from tpu_video.models.ltx2.upsampler import Upsample, split_layout
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    location = models.materialize_preset("tiny-ltx2.3") / "latent_upsampler"
    module = Upsample(LTX2LatentUpsamplerModel.from_pretrained(location).eval(), 0.5, 0.3)
    runtime = TorchaxRuntime.on_all_devices(SP, compile_cache=False, executables="off")
    latents = torch.randn(1, 8, 3, 4, 16, generator=torch.Generator().manual_seed(2)) * 1.7 + 0.3
    layout = split_layout(latents.shape, runtime)
    assert layout == split_over_mesh(latents.shape, runtime.mesh) and layout[-1] is not None  # along width
    assert split_layout((1, 8, 3, 4, 6), runtime) == ()  # 8 divides neither 4 nor 6: whole on every device
    with torch.no_grad(), runtime.precision(torch.float32):
        expected = module(latents)  # before placing moves the module's weights to the devices
        split = runtime.to_host(runtime.compile(module)(runtime.to_device(latents, layout)))
    assert split.shape == (1, 8, 3, 8, 32)
    assert relative_error(split, expected) <= TOLERANCE
