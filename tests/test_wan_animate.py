"""Wan Animate's transformer (diffusers' WanAnimateTransformer3DModel: Wan 2.1 blocks, a motion encoder over the
face frames, a face encoder, face adapters after every other block) under torchax: the stock module, jitted and
laid out by Wan's rule table on the mesh, against its eager forward. The stages do not run Animate yet (issue
notes); this holds what they will build on: no patch is needed, and every new weight has a layout."""

from __future__ import annotations

import pytest
import torch

import sharding
from helpers import Sample, attention_plan, relative_error
from tpu_video.models import wan
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend
from tpu_video.runtime.torchax_runtime import TorchaxRuntime

TOLERANCE = 1e-5  # fp32, relative (Frobenius)
LATENT_FRAMES = 3  # the segment's; the model also gets the reference image's frame first


def animate_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    """One denoiser call of a segment: the noisy latents with the reference and condition latents on channels,
    the prompt, CLIP tokens, the pose video's latents and the face frames (4 per latent frame after the first)."""
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 36, LATENT_FRAMES + 1, 4, 6, generator=generator),
        "timestep": torch.tensor([700] * batch),
        "encoder_hidden_states": torch.randn(batch, 8, 32, generator=generator),
        "encoder_hidden_states_image": torch.randn(batch, 5, 12, generator=generator),
        "pose_hidden_states": torch.randn(batch, 16, LATENT_FRAMES, 4, 6, generator=generator),
        "face_pixel_values": torch.rand(batch, 3, 4 * (LATENT_FRAMES - 1) + 1, 16, 16, generator=generator) * 2 - 1,
    }


@pytest.mark.parametrize(
    "mesh, attention", [((1, 1, 1), "xla"), ((1, 2, 4), "splash"), ((2, 1, 4), "xla")], ids=lambda value: str(value)
)
def test_the_animate_transformer_jitted_and_sharded_equals_eager(mesh, attention):
    """The motion encoder's QR, blur convolutions and the face adapter's per-frame cross-attention compile as
    they are; the face adapters' attention is split on tp like the blocks'."""
    with torch.no_grad():
        expected = wan.presets.tiny_animate_transformer()(**animate_inputs(), return_dict=False)[0]
    runtime = TorchaxRuntime(placement.make_mesh(sharding.MeshShape(*mesh)))
    rules = wan.transformer_rules("megatron").nested("transformer.")
    compiled = runtime.compile(Sample(wan.presets.tiny_animate_transformer()), rules)
    plan = attention_plan(attention, runtime.mesh, heads=8)
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
