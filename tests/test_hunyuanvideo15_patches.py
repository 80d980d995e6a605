"""HunyuanVideo-1.5's traceable transformer forward against the stock forward, and under torchax.

Eager tolerance: exact (the same operations on the same values; only the reorder's indexing differs).
Under torchax (fp32, XLA) and sharded: 1e-5 relative to the stock eager forward.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import sharding
from helpers import (
    BYT5,
    IMAGE,
    ROOT,
    TEXT,
    Sample,
    attention_plan,
    hunyuan_inputs,
    relative_error,
    tiny_hunyuan_transformer,
)
from tpu_video.models import hunyuanvideo15
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime


def test_reorder_matches_boolean_indexing():
    generator = torch.Generator().manual_seed(2)
    states = [torch.randn(2, n, 3, generator=generator) for n in (4, 5, 6)]
    masks = [torch.rand(2, n, generator=generator) > 0.5 for n in (4, 5, 6)]
    hidden, mask = hunyuanvideo15.transformer.reorder_text_tokens(states, masks)
    for row in range(2):
        s, m = [x[row] for x in states], [x[row] for x in masks]
        expected = torch.cat(
            [
                s[0][m[0]],
                s[1][m[1]],
                s[2][m[2]],
                s[0][~m[0]],
                torch.zeros_like(s[1][~m[1]]),
                torch.zeros_like(s[2][~m[2]]),
            ]
        )
        assert torch.equal(hidden[row], expected)
        assert torch.equal(
            mask[row], torch.cat([m[0][m[0]], m[1][m[1]], m[2][m[2]], m[0][~m[0]], m[1][~m[1]], m[2][~m[2]]])
        )


def test_traceable_forward_equals_stock_forward_in_eager_pytorch():
    stock = tiny_hunyuan_transformer()
    patched = hunyuanvideo15.transformer.make_jit_safe(tiny_hunyuan_transformer())
    with torch.no_grad():
        expected = stock(**hunyuan_inputs(), return_dict=False)[0]
        got = patched(**hunyuan_inputs(), return_dict=False)[0]
    assert relative_error(got, expected) <= 1e-5  # two programs: other CPUs may sum them in another order


def test_blocks_pass_per_key_masks_never_dense_ones(monkeypatch):
    """The joint attention of every block gets a (B, 1, 1, S) mask; only the short text refiner is dense."""
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        shapes.append(tuple(attn_mask.shape) if attn_mask is not None else None)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        hunyuanvideo15.transformer.make_jit_safe(tiny_hunyuan_transformer())(**hunyuan_inputs(), return_dict=False)
    joint = 3 * 4 * 6 + TEXT + BYT5 + IMAGE
    joint_shapes = [shape for shape in shapes if shape and shape[-1] == joint]
    assert len(joint_shapes) == 2 and all(shape == (2, 1, 1, joint) for shape in joint_shapes)
    assert all(shape[-1] == TEXT for shape in shapes if shape and shape[-1] != joint)


@pytest.mark.parametrize("attention", ["xla", "splash"])
@pytest.mark.parametrize(
    "mesh, sp_mode",
    [
        ((1, 1, 1), "auto"),
        ((2, 1, 4), "auto"),
        ((1, 2, 4), "auto"),
        ((2, 2, 2), "auto"),
        ((1, 4, 2), "auto"),
        ((1, 4, 2), "ring"),
    ],
    ids=lambda v: "dp{}-sp{}-tp{}".format(*v) if isinstance(v, tuple) else v,
)
def test_jitted_sharded_forward_matches_stock_eager(attention, mesh, sp_mode):
    with torch.no_grad():
        expected = tiny_hunyuan_transformer()(**hunyuan_inputs(), return_dict=False)[0]
    transformer = hunyuanvideo15.transformer.make_jit_safe(tiny_hunyuan_transformer())
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(*mesh)))
    plan = attention_plan(attention, runtime.mesh, heads=transformer.config.num_attention_heads, sp_mode=sp_mode)
    compiled = runtime.compile(Sample(transformer), hunyuanvideo15.transformer_rules().nested("transformer."))
    with attention_backend(runtime.env, plan, runtime.mesh):
        got = runtime.to_host(compiled(**runtime.to_device(hunyuan_inputs())))
    assert torch.isfinite(got).all()
    assert relative_error(got, expected) <= 1e-5


# VAE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_frame, n_hw, batch", [(1, 1, None), (3, 4, None), (5, 6, 2)])
def test_frame_causal_mask_equals_the_loop(n_frame, n_hw, batch):
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    expected = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n_frame, n_hw, torch.float32, "cpu", batch)
    got = hunyuanvideo15.vae.frame_causal_mask(n_frame, n_hw, torch.float32, "cpu", batch)
    assert got.shape == expected.shape and torch.equal(got, expected)


def tiny_vae():
    return hunyuanvideo15.presets.tiny_vae(seed=3)


def test_vae_decode_with_the_patch_equals_stock_and_runs_under_torchax():
    latents = torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = tiny_vae().decode(latents, return_dict=False)[0]
        patched = hunyuanvideo15.vae.make_vae_jit_safe(tiny_vae())
        got = patched.decode(latents, return_dict=False)[0]
        assert relative_error(got, expected) <= 1e-5  # two programs: other CPUs may sum them in another order

    runtime = TorchaxRuntime()
    decode = runtime.compile(Decode(hunyuanvideo15.vae.make_vae_jit_safe(tiny_vae())))
    got = runtime.to_host(decode(runtime.to_device(latents)))
    assert relative_error(got, expected) <= 1e-5


class Decode(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents):
        return self.vae.decode(latents, return_dict=False)[0]


def test_guided_call_runs_under_torch_compile():
    """benchmarks/gpu_step.py's torch.compile baselines compile our guided call: dynamo builds the guider's
    GuiderOutput without its `.pred` attribute (tests/test_upstream_bugs.py), so the combination is read by key.
    Dynamo alone (backend "eager": no inductor build), in a process without torchax (once imported, torch.compile
    fails: "PyTorch is not linked with support for jax devices")."""
    code = """
import torch
from diffusers import ClassifierFreeGuidance
from helpers import hunyuan_inputs, relative_error, tiny_hunyuan_transformer
from tpu_video.models import hunyuanvideo15

guided = hunyuanvideo15.transformer.GuidedTransformer(tiny_hunyuan_transformer(), ClassifierFreeGuidance(6.0), True)
inputs = hunyuan_inputs()
latents = inputs["hidden_states"][:1, :4]
arguments = (latents, torch.tensor([700.0]), inputs["encoder_hidden_states"], inputs["encoder_attention_mask"])
arguments += (inputs["encoder_hidden_states_2"], inputs["encoder_attention_mask_2"], inputs["image_embeds"])
with torch.no_grad():
    expected = guided(*arguments)
    got = torch.compile(guided, backend="eager")(*arguments)
assert got.shape == latents.shape and relative_error(got, expected) <= 1e-6, relative_error(got, expected)
"""
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
