"""Stage 3's decode in frame chunks on torchax (tpu_video/models/wan/vae.py: one latent frame per call;
tpu_video/models/cogvideox/vae.py: the stock frame batches; tpu_video/models/hunyuanvideo15/vae.py: chunks of any
length) against diffusers' `vae.decode` run eagerly in PyTorch, fp32: the frames within 1e-5 relative, on 1 and 8 CPU
devices, for the Wan 2.1, Wan 2.2 (TI2V-5B), CogVideoX 1.5 and 1.0 and HunyuanVideo-1.5 VAEs; through the real stage-3
CLI, where it is the torchax default. Also Wan's encode the same way (tpu_video/models/wan/vae_encode.py)."""

from __future__ import annotations

import pytest
import torch

import sharding
import stage3_vae_decoder
from helpers import expect_user_error, relative_error, run_stage
from tpu_video import models
from tpu_video.engine.decode import LATENTS_WIDTH_SPLIT, decode
from tpu_video.engine.meta import meta_module
from tpu_video.models.wan import vae as wan_vae
from tpu_video.models.wan import vae_encode as wan_vae_encode
from tpu_video.runtime import placement
from tpu_video.runtime.interface import Timer, TorchRuntime
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from utils import read_config, read_tensors

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "preset, frames, chunk, devices",
    [
        ("tiny-wan2.1", 5, 1, 8),  # programs first, second, steady x3
        ("tiny-wan2.1", 5, 1, 1),  # the latents kept whole (one device)
        ("tiny-wan2.2-ti2v", 4, 1, 8),
        ("tiny-cogvideox", 5, 2, 8),  # batches of 3 (the remainder joins the first) and 2
        ("tiny-cogvideox1.0", 6, 2, 8),  # batches of 2, 2, 2
        ("tiny-hunyuanvideo15", 5, 2, 8),  # chunks of 1 (the remainder), 2, 2
        ("tiny-hunyuanvideo15", 6, 4, 8),  # chunks of 2, 4
    ],
)
def test_frame_programs_equal_the_stock_decode(preset, frames, chunk, devices):
    """On 8 devices the latents split along width (16 latent columns: 2 per device): each chunk's programs and
    the split together equal the stock decode, so one family also runs on one device, where they are kept
    whole."""
    source, family = models.resolve_model(preset)
    config = source.load_config("vae")
    channels = config.get("z_dim") or config["latent_channels"]
    latents = torch.randn(1, channels, frames, 4, 16, generator=torch.Generator().manual_seed(3))
    normalization = family.latents_normalization(source)
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=devices)))
    got = decode(family, source, latents, normalization, torch.float32, runtime, Timer(), chunk)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= TOLERANCE
    assert len(runtime.placements) == 1  # the VAE's weights placed once for all three programs


def test_cache_layout_is_the_same_after_the_second_frame():
    """What the three programs rest on: the stock decoder's cache holds the same kinds of slots from the
    third call on (a fourth call on the meta device sees what the third saw)."""
    source, _ = models.resolve_model("Wan-AI/Wan2.1-T2V-14B-Diffusers", configs_only=True)
    vae = meta_module(source, "vae", torch.bfloat16)
    frame = torch.zeros(1, 16, 1, 60, 104, dtype=torch.bfloat16, device="meta")
    layout = wan_vae.decoder_layout(vae, frame)
    assert layout[0][0] == (None,) * len(layout[0][0]) and wan_vae.REP in layout[1][0]
    cache: list = [None] * len(layout[0][0])
    for index in range(4):
        vae.decoder(vae.post_quant_conv(frame), feat_cache=cache, feat_idx=[0], first_chunk=index == 0)
    assert wan_vae._slot_kinds(cache) == layout[2][0] and wan_vae.REP not in layout[2][0]


@pytest.mark.parametrize("model", ["Wan-AI/Wan2.1-T2V-14B-Diffusers", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"])
def test_encoder_cache_is_the_same_after_the_second_chunk(model):
    """What the encoder's three programs rest on (vae_encode.py): from the second call on, the stock encoder's
    cache has tensors in the same slots, and from the third on of the same shapes (a fourth call on the meta
    device sees what the third saw), where the second call's differ (one frame in a causal convolution's slot,
    not two)."""
    source, _ = models.resolve_model(model, configs_only=True)
    vae = meta_module(source, "vae", torch.bfloat16)
    layout = wan_vae_encode.encoder_layout(vae, (1, 3, 81, 64, 96))
    assert layout[0][0] == (None,) * len(layout[0][0]) and "tensor" in layout[1][0] and layout[1][0] == layout[2][0]
    shapes = [[tensor.shape for tensor in tensors] for _, tensors in layout]
    assert shapes[1] != shapes[2]
    chunk = torch.zeros(1, 3, wan_vae_encode.ENCODE_FRAMES, 64, 96, dtype=torch.bfloat16, device="meta")
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        chunk = patchify(chunk, patch_size=vae.config.patch_size)
    cache = list(layout[2][1])
    vae.encoder(chunk, feat_cache=cache, feat_idx=[0])
    assert [tensor.shape for tensor in cache] == shapes[2]


@pytest.mark.parametrize("preset, mesh", [("tiny-wan2.1", (2, 2, 2)), ("tiny-wan2.2-ti2v", (1, 1, 1))])
def test_coder_programs_equal_the_stock_encode_and_decode(preset, mesh):
    """Wan Animate's work between segments (vae_encode.py: coder_programs, one VAE placed for both): a video's
    encode one chunk of frames per call (the first frame, then 4 at a time: first, second, steady twice; the
    14th frame left out as the stock encode leaves it) equals `vae.encode`'s posterior, and the decode its
    `decode`, fp32, 1e-5 relative; on stage 2's dp/sp/tp mesh the pixels split along width over all 8 devices
    (48 columns; the 3 latent ones kept whole: the layout is the pixels' here, where a run takes the latents',
    so that the split is exercised at this size), on one device whole; the Wan 2.2 VAE patchifies first."""
    from tpu_video.engine.decode import split_over_mesh

    source, family = models.resolve_model(preset)
    vae = source.load("vae", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    pixels = torch.rand(1, 3, 14, 32, 48, generator=generator) * 2 - 1
    latents = torch.randn(1, vae.config.z_dim, 3, 2, 3, generator=generator)
    decoder = family.Decoder(vae, family.latents_normalization(source))
    with torch.no_grad():
        expected_posterior = vae.encode(pixels).latent_dist.parameters
        expected_video = decoder(latents)
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(*mesh)))
    layout = split_over_mesh(pixels.shape, runtime.mesh)
    decode, encode = wan_vae_encode.coder_programs(source, decoder, latents.shape, pixels.shape, runtime, layout)
    assert relative_error(encode(pixels), expected_posterior) <= TOLERANCE
    assert relative_error(decode(latents), expected_video) <= TOLERANCE
    assert len(runtime.placements) == 1


@pytest.fixture(scope="module")
def wan_latents(tmp_path_factory):
    """Stage 2 latents of tiny Wan 2.1 (stage 2 itself is tested elsewhere): stage 1 and 2 in this process."""
    import stage1_text_encoder
    import stage2_transformer

    out = tmp_path_factory.mktemp("wan")
    run_stage(
        stage1_text_encoder, ["--model", "tiny-wan2.1", "--prompt", "a cat", "--output_dir", out, "--dtype", "fp32"]
    )
    run_stage(stage2_transformer, ["--input_dir", out, "--num_inference_steps", 2])
    return out


def test_stage3_torchax_decodes_frame_by_frame_by_default(tmp_path, wan_latents):
    outputs = {}
    for backend in ("torch", "torchax"):
        out = tmp_path / backend
        run_stage(
            stage3_vae_decoder, ["--input_dir", wan_latents, "--output_dir", out, "--backend", backend, "--save_frames"]
        )
        config = read_config(out, needs="stage3")
        outputs[backend] = (read_tensors(out, config["stage3"]["frames_file"])["frames_float"], config["stage3"])
    (expected, torch_record), (got, jax_record) = outputs["torch"], outputs["torchax"]
    assert torch_record["chunk_frames"] is None and jax_record["chunk_frames"] == 1
    assert relative_error(got, expected) <= TOLERANCE


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backend", "torch", "--chunk_frames", 1], "--chunk_frames applies to --backend torchax"),
        (["--backend", "torchax", "--chunk_frames", 2], "exact in chunks of 1 (or 0)"),
        (["--backend", "torchax", "--chunk_frames", 1, "--tiling"], "--tiling is diffusers' tiled decode"),
    ],
)
def test_chunk_flag_errors(capsys, tmp_path, wan_latents, flags, message):
    expect_user_error(
        capsys, stage3_vae_decoder, ["--input_dir", wan_latents, "--output_dir", tmp_path, *flags], message
    )


@pytest.mark.parametrize("frames", [1, 2, 5])
def test_hunyuanvideo15_chunks_equal_the_stock_decoder_eagerly(frames):
    """The restructured forward (tpu_video/models/hunyuanvideo15/vae.py) in eager PyTorch, every chunk length from 1 to
    the whole clip, against the stock `HunyuanVideo15Decoder3D`. Two different programs, so fp32's 1e-5
    relative, not bit-identity: on this machine they agree to the bit, on other CPUs (an AMD EPYC) the
    kernels sum in another order and they differ by ~7e-7. The attention's buffers keep the seen keys in
    frame order."""
    from tpu_video.models.hunyuanvideo15 import vae as hv

    source, family = models.resolve_model("tiny-hunyuanvideo15")
    decoder = hv.Decoder(source.load("vae", dtype=torch.float32).eval(), family.latents_normalization(source))
    latents = torch.randn(1, 4, frames, 4, 6, generator=torch.Generator().manual_seed(5))
    programs = hv.FramePrograms(decoder, frames, TorchRuntime("cpu").constrain, ())
    with torch.no_grad():
        expected = decoder(latents)
        for chunk in range(1, frames + 1):
            pieces, state = [], ()
            for index, (start, end) in enumerate(hv.frame_batches(frames, chunk)):
                call = programs.first if index == 0 else programs.steady
                out, *state = call(latents[:, :, start:end], *state)
                pieces.append(out)
            assert relative_error(torch.cat(pieces, dim=2), expected) <= TOLERANCE, chunk


def test_hunyuanvideo15_stage3_torchax_decodes_in_chunks(capsys, tmp_path):
    """Through the CLIs: the default chunk (1 latent frame) equals the torch backend; 33 is refused."""
    import stage1_text_encoder
    import stage2_transformer

    argv = ["--model", "tiny-hunyuanvideo15", "--prompt", "a cat", "--output_dir", tmp_path, "--dtype", "fp32"]
    run_stage(stage1_text_encoder, argv)
    run_stage(stage2_transformer, ["--input_dir", tmp_path, "--num_inference_steps", 1])
    frames = {}
    for backend in ("torch", "torchax"):
        out = tmp_path / backend
        run_stage(
            stage3_vae_decoder, ["--input_dir", tmp_path, "--output_dir", out, "--backend", backend, "--save_frames"]
        )
        config = read_config(out, needs="stage3")
        frames[backend] = read_tensors(out, config["stage3"]["frames_file"])["frames_float"]
        assert config["stage3"]["chunk_frames"] == (1 if backend == "torchax" else None)
    assert relative_error(frames["torchax"], frames["torch"]) <= TOLERANCE
    argv = ["--input_dir", tmp_path, "--backend", "torchax", "--chunk_frames", 33]
    expect_user_error(capsys, stage3_vae_decoder, argv, "exact in chunks of 1 to 32 (or 0)")


@pytest.mark.parametrize(
    "preset, size, calls, split",
    [
        ("tiny-wan2.1", (32, 256, 17), {"first": 1, "second": 1, "steady": 3}, "width"),  # 5 latent frames
        # the tiny transformer's own size (its rotary grid): latent width 12 does not divide by 8, height 8 does
        ("tiny-cogvideox", (64, 96, 33), {"first": 1, "steady": 3}, "height"),  # 9 latent frames: 3, 2, 2, 2
        ("tiny-hunyuanvideo15", (32, 128, 17), {"first": 1, "steady": 4}, "width"),  # 5 latent frames
    ],
)
def test_plan_compiles_each_frame_program(tmp_path, preset, size, calls, split):
    """--plan compiles each program the video calls for the TPU; the decode's FLOPs add up every call."""
    import json

    out = tmp_path / "plan.json"
    argv = ["--input_dir", tmp_path, "--model", preset, "--plan", "v6e-8", "--plan_json", out]
    height, width, frames = size
    run_stage(stage3_vae_decoder, [*argv, "--height", height, "--width", width, "--num_frames", frames])
    report = json.loads(out.read_text())
    assert report["stage"] == 3 and report["mesh"] == {"dp": 1, "sp": 8, "tp": 1}
    assert report["fits"] and report["split"] == split and report["calls"] == calls
    assert report["hbm_bytes_per_device"]["arguments"] > 0
    per_call = report["flops_per_call"]
    assert report["flops_per_device"]["total"] == sum(per_call[name] * count for name, count in calls.items())
    assert max(report["hbm_bytes_per_program"].values()) == report["hbm_bytes_per_device"]["total"]


def test_hunyuanvideo15_steady_call_gathers_only_the_chunk_keys_and_values():
    """The attention's key and value buffers stay whole on every device and only the chunk's new keys and
    values are gathered: a steady call's all-gathers (8 devices, width split) move the same bytes for a video
    of 5 latent frames as for one of 9."""
    from sharding import REPLICATED_TABLE
    from tpu_video.planning.plan import compile_module

    source, family = models.resolve_model("tiny-hunyuanvideo15")
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=8)))
    decoder = family.Decoder(meta_module(source, "vae", torch.float32), family.latents_normalization(source))
    gathered = {}
    for frames in (5, 9):
        shape = (1, decoder.vae.config.latent_channels, frames, 4, 16)
        module, inputs, _ = family.frame_plan(source, decoder, shape, runtime, LATENTS_WIDTH_SPLIT, 1)
        steady = compile_module(module, REPLICATED_TABLE, inputs["steady"], runtime.mesh, runtime.env, "steady")
        gathered[frames] = steady.collectives["all-gather"]["bytes"]
    assert gathered[5] == gathered[9] > 0, gathered


def test_plan_with_chunk_frames_0_compiles_the_one_program_decode(tmp_path):
    """5 frames, two latent frames (the first, and one that reads the causal cache): the one program unrolls
    every latent frame, so its TPU compile grows with the video (4.8 s at 1 latent frame, 16.4 s at 2, 28 s at
    the preset's 3)."""
    import json

    out = tmp_path / "plan.json"
    argv = ["--input_dir", tmp_path, "--model", "tiny-wan2.1", "--plan", "v6e-8", "--plan_json", out]
    run_stage(stage3_vae_decoder, [*argv, "--chunk_frames", 0, "--num_frames", 5])
    report = json.loads(out.read_text())
    assert report["fits"] and "calls" not in report and report["chunk_frames"] is None


def test_height_split_where_the_width_does_not_divide():
    """12 latent columns do not divide by 8 devices, 8 rows do: the frames split along height, still exact."""
    from tpu_video.engine.decode import LATENTS_HEIGHT_SPLIT, latents_split

    source, family = models.resolve_model("tiny-cogvideox")
    latents = torch.randn(1, 4, 5, 8, 12, generator=torch.Generator().manual_seed(4))
    assert latents_split(latents.shape, 8) == ("height", LATENTS_HEIGHT_SPLIT)
    normalization = family.latents_normalization(source)
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=8)))
    got = decode(family, source, latents, normalization, torch.float32, runtime, Timer(), chunk_frames=2)
    assert relative_error(got, expected) <= TOLERANCE


@pytest.mark.parametrize("preset, chunk", [("tiny-hunyuanvideo15", 2), ("tiny-cogvideox", 2), ("tiny-wan2.1", 1)])
def test_uneven_width_split_is_exact(preset, chunk):
    """13 latent columns and 6 rows divide by 8 devices along neither side (HunyuanVideo-1.5 480p's 30 x 53
    and CogVideoX-5b's 60 x 90 neither): the frame programs split the width unevenly inside (XLA pads the
    last shards), exact to the stock decode."""
    from tpu_video.engine.decode import UNEVEN_WIDTH, latents_split

    source, family = models.resolve_model(preset)
    config = source.load_config("vae")
    channels = config.get("z_dim") or config["latent_channels"]
    latents = torch.randn(1, channels, 5, 6, 13, generator=torch.Generator().manual_seed(3))
    assert latents_split(latents.shape, 8)[0] == UNEVEN_WIDTH
    normalization = family.latents_normalization(source)
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(sp=8)))
    got = decode(family, source, latents, normalization, torch.float32, runtime, Timer(), chunk)
    assert relative_error(got, expected) <= TOLERANCE


def test_an_uneven_constraint_splits_the_dimension_it_does_not_divide():
    """placement.constraint_spec(uneven=True) keeps the axis on a dimension it does not divide (13 over 8), where
    the default drops it, and XLA partitions by it: each device computes 2 of the 13 columns (the last
    shards padded). A dimension smaller than the axis stays whole either way."""
    import jax
    import numpy as np

    mesh = placement.make_mesh(sharding.MeshShape(sp=8))
    spec = placement.P(None, "sp")
    assert placement.constraint_spec(spec, (4, 13), mesh, uneven=True) == spec
    assert placement.constraint_spec(spec, (4, 13), mesh, uneven=False) == placement.P(None, None)
    assert placement.constraint_spec(spec, (4, 5), mesh, uneven=True) == placement.P(None, None)

    def doubled(x):
        pinned = placement.NamedSharding(mesh, placement.constraint_spec(spec, x.shape, mesh, uneven=True))
        return jax.lax.with_sharding_constraint(x * 2, pinned) + 1

    hlo = jax.jit(doubled).lower(np.zeros((4, 13), np.float32)).compile().as_text()
    assert "f32[4,2]" in hlo


@pytest.mark.parametrize("preset", ["tiny-wan2.1", "tiny-hunyuanvideo15"])
def test_height_by_width_split_is_exact(preset):
    """The 2D split benchmarks/vae_split.py compares on the TPU compiler (height over dp 2, width over sp 4)
    decodes exactly too."""
    from tpu_video.engine.decode import LATENTS_GRID_SPLIT

    source, family = models.resolve_model(preset)
    config = source.load_config("vae")
    channels = config.get("z_dim") or config["latent_channels"]
    latents = torch.randn(1, channels, 3, 4, 16, generator=torch.Generator().manual_seed(6))
    normalization = family.latents_normalization(source)
    expected = decode(family, source, latents, normalization, torch.float32, TorchRuntime("cpu"), Timer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(dp=2, sp=4)))
    decoder = family.Decoder(source.load("vae", dtype=torch.float32).eval(), normalization)
    chunk = family.CHUNK_FRAMES[0]
    with torch.no_grad():
        video = family.frame_programs(source, decoder, latents.shape, runtime, LATENTS_GRID_SPLIT, chunk)(latents)
    frames = family.video_processor(source).postprocess_video(video=video.float(), output_type="np")
    assert relative_error(torch.from_numpy(frames[0]), expected) <= TOLERANCE
