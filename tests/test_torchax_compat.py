"""torchax 0.0.13 workarounds: the import shim for torch 2.13 and the gather lowering. Each changes no
values; tests/test_upstream_bugs.py holds the canaries that fail once torchax no longer needs them."""

import jax
import pytest
import torch

from helpers import collectives_in, relative_error
from sharding import MeshShape
from tpu_video.models.hunyuanvideo15.transformer import reorder_text_tokens
from tpu_video.runtime.placement import make_mesh
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from tpu_video.workarounds.torchax import (
    MISSING_OVERLOADS,
    import_torchax,
    strided_slice_set,
    tolerate_missing_overloads,
)


def test_shimmed_import_works_and_names_what_was_missing():
    torchax = import_torchax()
    assert any("Dimname" in name for name in MISSING_OVERLOADS)
    with torchax.default_env():
        total = (torch.arange(4.0, device="jax") * 2).sum().to("cpu")
    assert float(total) == 12.0


def test_shim_restores_normal_lookup_after_the_block():
    with tolerate_missing_overloads() as missing:
        placeholder = torch.ops.aten.prod.dim_Dimname
    assert missing == ["aten::prod.dim_Dimname"] and not callable(placeholder)
    try:
        _ = torch.ops.aten.prod.dim_Dimname
    except AttributeError:
        pass
    else:
        raise AssertionError("the overload lookup was not restored")
    assert float(torch.ops.aten.prod.default(torch.tensor([2.0, 3.0]))) == 6.0  # a real op resolves and runs


# torch.gather's lowering (workarounds.torchax.take_along_axis_gather) --------------------------------------

GATHER_CASES = [
    ((2, 7, 5), 1, (2, 7, 5)),  # take_along_axis: a permutation along dim 1
    ((2, 7, 5), -2, (2, 3, 5)),  # take_along_axis: fewer picks along dim
    ((2, 7, 5), 2, (1, 7, 2)),  # smaller outside dim: torchax's own lowering
    ((6,), 0, (4,)),
]


@pytest.mark.parametrize("input_shape, dim, index_shape", GATHER_CASES)
def test_gather_lowering_equals_torch_gather(input_shape, dim, index_shape):
    runtime = TorchaxRuntime(make_mesh(MeshShape()))
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(input_shape, generator=generator)
    index = torch.randint(0, input_shape[dim], index_shape, generator=generator)
    with runtime.env:
        actual = torch.gather(runtime.to_device(values), dim, runtime.to_device(index))
    assert torch.equal(runtime.to_host(actual), torch.gather(values, dim, index))


def test_token_reorder_needs_no_collectives_on_a_dp_sharded_batch():
    """With take_along_axis_gather the reorder compiles without collectives (tests/test_upstream_bugs.py
    shows torchax's own lowering adds them)."""
    from torchax import interop

    runtime = TorchaxRuntime(make_mesh(MeshShape(2, 1, 4)))
    f32, boolean = jax.numpy.float32, jax.numpy.bool_

    def reorder(first, second, first_mask, second_mask):
        return reorder_text_tokens([first, second], [first_mask, second_mask])

    shapes = [((2, 100, 64), f32), ((2, 30, 64), f32), ((2, 100), boolean), ((2, 30), boolean)]
    assert collectives_in(interop.jax_view(reorder), shapes, runtime.mesh) == []


def test_group_norm_lowering_equals_torch_and_keeps_the_width_split():
    """layout_keeping_group_norm: torch's GroupNorm values (affine, 5-D video activations) within 1e-6, and
    on activations split along width only all-reduces of the statistics (tests/test_upstream_bugs.py shows
    torchax's own lowering all-gathers them)."""
    from torchax import interop

    runtime = TorchaxRuntime(make_mesh(MeshShape(1, 8, 1)))
    norm = torch.nn.GroupNorm(8, 32, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    values = torch.randn(2, 32, 3, 8, 64, generator=torch.Generator().manual_seed(0))
    with runtime.env, torch.no_grad():
        placed = runtime.to_device(values, (None, None, None, None, "sp"))
        actual = torch.nn.functional.group_norm(placed, 8, *runtime.to_device((norm.weight, norm.bias)), 1e-6)
        expected = norm(values)
    assert relative_error(runtime.to_host(actual), expected) <= 1e-6

    def normalise(x):
        return torch.nn.functional.group_norm(x, 8, None, None, 1e-6)

    shapes = [((1, 32, 2, 8, 64), jax.numpy.float32)]
    found = collectives_in(interop.jax_view(normalise), shapes, runtime.mesh, layout=(None, None, None, None, "sp"))
    assert found == ["all-reduce"]


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize(
    "shape, resize",
    [
        ((2, 3, 8), {"scale_factor": 2.0}),
        ((2, 3, 4, 8), {"scale_factor": 2.0}),
        ((2, 3, 2, 4, 8), {"scale_factor": (1.0, 2.0, 2.0)}),  # CogVideoX's upsampler keeping frames
        ((2, 3, 4, 8), {"size": (12, 16)}),  # whole factors 3 and 2 from a size
        ((2, 3, 4, 8), {"size": (6, 12)}),  # not whole: torchax's own decomposition
        ((2, 3, 4, 8), {"scale_factor": 1.5}),
    ],
)
def test_repeat_upsample_equals_torch_interpolate(mode, shape, resize):
    """workarounds.torchax.repeat_upsample: F.interpolate's values exactly, whole factors or not."""
    runtime = TorchaxRuntime(make_mesh(MeshShape()))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with runtime.env:
        actual = torch.nn.functional.interpolate(runtime.to_device(values), mode=mode, **resize)
    assert torch.equal(runtime.to_host(actual), torch.nn.functional.interpolate(values, mode=mode, **resize))


def test_upsampling_keeps_the_width_split():
    """With repeat_upsample a 2x nearest upsampling of activations split along width compiles without
    collectives (tests/test_upstream_bugs.py shows torchax's decomposition all-gathers them)."""
    from torchax import interop

    runtime = TorchaxRuntime(make_mesh(MeshShape(1, 8, 1)))

    def upsampled(x):
        return torch.nn.functional.interpolate(x, scale_factor=2.0)

    shapes = [((2, 4, 8, 64), jax.numpy.float32)]
    assert collectives_in(interop.jax_view(upsampled), shapes, runtime.mesh, layout=(None, None, None, "sp")) == []


# Strided slice assignment (workarounds.torchax.strided_slice_set) -----------------------------------------

E = Ellipsis
SETITEM_CASES = [  # (shape, key, value shape, written by strided_slice_set rather than torchax's own path)
    ((2, 6, 8), (E, slice(0, None, 2)), (2, 6, 4), True),  # Wan's rotary embedding: even channels
    ((2, 6, 8), (E, slice(1, None, 2)), (2, 6, 4), True),  # and odd ones
    ((5, 9, 4), (slice(None), slice(2, None, 3)), (5, 3, 4), True),  # a middle dimension, step 3
    ((9, 4, 7), (slice(None, None, 3), E), (1, 7), True),  # a value broadcast to (3, 4, 7)
    ((9, 4, 7), (slice(1, 8, 3), slice(None), slice(None, None, 2)), (3, 4, 4), False),  # steps on two dimensions
    ((9, 4, 7), slice(None, None, 4), (3, 4, 7), False),  # 4 does not divide 9
    ((8, 3), (slice(3, 3, 2), E), (0, 3), False),  # nothing selected
    ((6, 5), (slice(2, 4), slice(None)), (2, 5), False),  # unit steps
    ((6, 5), (1, slice(None, None, 2)), (3,), False),  # an integer index
]


class SetItem(torch.nn.Module):
    def __init__(self, key):
        super().__init__()
        self.key = key

    def forward(self, base, value):
        out = base.clone()
        out[self.key] = value
        return out


@pytest.mark.parametrize("shape, key, value_shape, ours", SETITEM_CASES)
def test_strided_slice_assignment_equals_torch(shape, key, value_shape, ours):
    """Pure data movement: bit-identical to torch's own assignment, on either path."""
    generator = torch.Generator().manual_seed(0)
    base, value = torch.randn(shape, generator=generator), torch.randn(value_shape, generator=generator)
    assert torch.equal(jitted(SetItem(key), base, value), SetItem(key)(base, value))
    assert (strided_slice_set(jax.numpy.zeros(shape), key, jax.numpy.ones(value_shape)) is not None) == ours


def jitted(module: torch.nn.Module, *args: torch.Tensor, program: list | None = None) -> torch.Tensor:
    """`module(*args)` through torchax under jax.jit (its StableHLO appended to `program`)."""
    from torchax import extract_jax

    env = import_torchax().default_env()
    states, function = extract_jax(module, env)
    inputs = env.t2j_copy(args)
    if program is not None:
        program.append(jax.jit(function).lower(states, inputs).as_text())
    return torch.from_numpy(jax.device_get(jax.jit(function)(states, inputs)).copy())


def test_wan_attention_writes_its_rotary_embedding_without_a_scatter():
    """diffusers' WanAttnProcessor writes the rotated q and k into even and odd channels
    (`out[..., 0::2] = ...`); torchax's own __setitem__ made each a stablehlo.scatter (0.31 s of a 1.41 s
    step on an H200, docs/gpus.md). Patched: none, and the attention's values unchanged."""
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    class RotatedAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = WanAttention(dim=32, heads=2, dim_head=16, processor=WanAttnProcessor())

        def forward(self, x, cos, sin):
            return self.attention(x, rotary_emb=(cos, sin))

    torch.manual_seed(0)
    module = RotatedAttention().eval()
    x, cos, sin = torch.randn(1, 12, 32), torch.randn(1, 12, 1, 16), torch.randn(1, 12, 1, 16)
    with torch.no_grad():
        expected = module(x, cos, sin)
    program = []
    got = jitted(module, x, cos, sin, program=program)
    assert "stablehlo.scatter" not in program[0]
    assert relative_error(got, expected) <= 1e-6


# repeat_interleave by a number (workarounds.torchax.repeat_interleave_by_int) --------------------------------


class RepeatInterleave(torch.nn.Module):
    def __init__(self, repeats, dim, output_size):
        super().__init__()
        self.repeats, self.dim, self.output_size = repeats, dim, output_size

    def forward(self, x):
        if self.output_size is None:  # the aten op, as torch.repeat_interleave reaches it
            return torch.ops.aten.repeat_interleave.self_int(x, self.repeats, self.dim)
        return x.repeat_interleave(self.repeats, dim=self.dim, output_size=self.output_size)


@pytest.mark.parametrize(
    "repeats, dim, output_size", [(2, 1, 8), (3, -1, 12), (1, 0, 2), (2, 1, None), (3, None, None)]
)
def test_repeat_interleave_by_a_number_equals_torch_without_a_scatter(repeats, dim, output_size):
    """diffusers' rotary tables (`repeat_interleave(2, dim=1, output_size=...)`): torchax's own lowering
    built these with a scatter (tests/test_upstream_bugs.py); the values are torch's bit for bit."""
    TorchaxRuntime()  # installs the workarounds into the default environment
    x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
    program = []
    got = jitted(RepeatInterleave(repeats, dim, output_size), x, program=program)
    assert torch.equal(got, x.repeat_interleave(repeats, dim=dim))
    assert "stablehlo.scatter" not in program[0]
