"""A family added from outside: tests/toy_family holds a toy family (its own request option, media-input
kind and preset) and the dist-info that registers it in the `tpu_video.families` entry-point group, as an
installed package would. With that folder on PYTHONPATH the three stage CLIs, run as the user runs them,
take its flags and produce its video; no module of tpu_video names it. Its output is checked against the
pipeline it is built from: WanPipeline on the captioned prompt, its latents times the gain."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest
import torch

from helpers import relative_error, run_script
from tpu_video.cli.options import Option
from utils import read_config, read_tensors

TOY = Path(__file__).parent / "toy_family"
REQUEST = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 3, "seed": 5, "guidance_scale": 4.0}


def run(script: str, argv: list, with_toy: bool = True):
    return run_script(script, argv, extra_pythonpath=TOY if with_toy else None, timeout=600)


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    """The toy's three stages, as subprocesses: gain 2 asked in stage 1, overridden to 3 in stage 2."""
    root = tmp_path_factory.mktemp("toy")
    (root / "caption.txt").write_text("on a mat\n", encoding="utf-8")
    flags = [f"--{key}={value}" for key, value in REQUEST.items()]
    out = root / "out"
    argv = ["--model", "tiny-toy", "--prompt", "a cat", "--caption_file", root / "caption.txt", "--dtype", "fp32"]
    for script, args in (
        ("stage1_text_encoder.py", [*argv, "--latent_gain", "2", "--output_dir", out, *flags]),
        ("stage2_transformer.py", ["--input_dir", out, "--latent_gain", "3"]),
        ("stage3_vae_decoder.py", ["--input_dir", out]),
    ):
        done = run(script, args)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_toy_family_runs_through_the_three_clis(toy_folder):
    from diffusers import WanPipeline

    from tpu_video import models

    config = read_config(toy_folder, needs="stage2")
    assert config["model_family"] == "toy" and config["latent_gain"] == 3.0  # an option, stored as a top-level key
    assert config["stage2"]["overrides"] == {"latent_gain": [2.0, 3.0]}
    caption = config["stage1"]["inputs"]["caption_file"]
    assert caption["kind"] == "text" and caption["file"] == "caption.txt" and caption["characters"] == 8
    assert config["stage1"]["task"] == "t2v" and len(caption["sha256"]) == 64

    pipe = WanPipeline.from_pretrained(models.materialize_preset("tiny-wan2.1"), dtype=torch.float32)
    kwargs = {key: value for key, value in REQUEST.items() if key != "seed"}
    generator = torch.Generator("cpu").manual_seed(REQUEST["seed"])
    expected = pipe(prompt="a cat on a mat", generator=generator, output_type="latent", **kwargs).frames
    latents = read_tensors(toy_folder, config["stage2"])["latents"]
    assert relative_error(latents, 3.0 * expected) <= 1e-5
    assert (toy_folder / "output_video.mp4").stat().st_size > 0


def test_other_families_refuse_the_toys_option_and_without_it_the_flag_is_unknown(tmp_path):
    argv = ["--model", "tiny-wan2.1", "--prompt", "x", "--latent_gain", "2", "--output_dir", tmp_path]
    refused = run("stage1_text_encoder.py", argv)
    assert refused.returncode == 2 and "error: --latent_gain is an option of toy" in refused.stderr
    unknown = run("stage1_text_encoder.py", argv, with_toy=False)
    assert unknown.returncode == 2 and "unrecognized arguments: --latent_gain 2" in unknown.stderr


def test_the_toys_folder_without_the_toy_installed_says_so(toy_folder, tmp_path):
    done = run("stage3_vae_decoder.py", ["--input_dir", toy_folder, "--output_dir", tmp_path], with_toy=False)
    assert done.returncode == 2 and "from the model family 'toy', which is not installed here" in done.stderr


def fake_family(**changes):
    """Wan's members under another name, with `changes`: a family as a plugin module provides one."""
    from tpu_video.models import wan
    from tpu_video.models.family import family_members

    members = {name: getattr(wan, name) for name in family_members()}
    return types.SimpleNamespace(**{**members, "NAME": "fake", "PRESETS": {}, "PIPELINE_CLASSES": (), **changes})


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"NAME": "wan"}, "the name 'wan' is taken"),
        ({"PRESETS": {"tiny-wan2.1": None}}, "the presets ['tiny-wan2.1'] are taken"),
        ({"PIPELINE_CLASSES": ("WanPipeline",)}, "the pipeline classes ['WanPipeline'] are taken"),
        ({"OPTIONS": (Option("dtype", "str", "x"),)}, "['dtype'] are reserved names or declared twice"),
        ({"OPTIONS": (Option("stage9", "str", "x"),)}, "['stage9'] are reserved names"),
        ({"OPTIONS": (Option("gain", "float", "x"), Option("gain", "float", "x"))}, "['gain'] are reserved names or"),
        ({"OPTIONS": (Option("scheduler", "str", "another help"),)}, "['scheduler'] are declared otherwise before it"),
    ],
)
def test_a_family_that_clashes_is_left_out_with_its_reason(changes, why):
    from tpu_video.models import registry

    assert registry._clash(fake_family(), list(registry.FAMILIES.values())) is None
    assert why in registry._clash(fake_family(**changes), list(registry.FAMILIES.values()))
    incomplete = fake_family()
    del incomplete.Decoder
    assert registry._clash(incomplete, []) == "it lacks Decoder (tpu_video.models.family.Family)"


def test_a_family_flag_a_stage_already_has_is_left_out_with_a_warning(monkeypatch, capsys):
    from tpu_video import models
    from tpu_video.stages import request

    family = fake_family(OPTIONS=(Option("lora", "str", "x"), Option("gain", "float", "y")))
    monkeypatch.setattr(models, "FAMILIES", {"fake": family})
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora")
    request.add_request_arguments(parser, for_later_stage=False)
    assert "warning: --lora of the model family fake is left out" in capsys.readouterr().out
    args = parser.parse_args(["--gain", "2", "--lora", "x.safetensors"])
    assert request.request_flags(args)["gain"] == 2.0
    assert "lora" not in request.request_flags(args)  # the stage's own --lora is not read as the family's
