"""torchax 0.0.13: importing it on torch 2.13, its `Tensor.type_as` and `__setitem__`, its `aten.gather` lowering, and
the private op table that its public override API lacks a getter and an undo for, and the int8 matmul
(`aten._int_mm`) it has no lowering for.

torchax 0.0.13 looks up about twenty ``aten.<op>.<Dimname overload>`` attributes while it is imported
and while its default environment is first built (AMP cast tables, decomposition lists). torch 2.13
removed those overloads, so the lookup raises AttributeError and ``import torchax`` fails. We never
call a named-dimension op, so during that window a missing overload resolves to an inert placeholder;
the original lookup is restored right after. ``tests/test_upstream_bugs.py`` fails loudly once a
torchax release no longer needs this, so it can be deleted (``tests/test_torchax_compat.py`` tests the shim).

torchax 0.0.13's `Tensor.type_as` casts the wrapped JAX array in place and returns `self`, so the
tensor's torch-level dtype stays the old one: the next op that checks dtypes sees a mismatch (the Wan
VAE's `WanUpsample` does `upsample(x.float()).type_as(x)` before a bf16 conv, which then fails with
"Input type (float) and bias type (c10::BFloat16) should be the same"). `cast_type_as` is torch's
meaning, a new tensor; tests/test_upstream_bugs.py checks the stock method still misbehaves.

torchax 0.0.13's `Tensor.__setitem__` turns a strided slice assignment into a scatter (strided_slice_set).

torchax 0.0.13's `JittableModule` passes a tied weight once only if it is a Parameter that requires grad;
our placed weights are plain tensors, which it lists among the buffers under every name, so a T5 encoder's
embedding (`shared` and `encoder.embed_tokens`) was two arguments of every program and the TPU compiler
counted it twice (UMT5-XXL: 1.96 GiB per device too many in a plan). `dedup_tied_buffers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch._ops


class MissingOverload:
    """Stands in for an op overload that this torch build no longer has; hashable, never callable."""

    def __init__(self, qualified_name: str) -> None:
        self.qualified_name = qualified_name

    def __repr__(self) -> str:
        return f"<missing overload {self.qualified_name}>"


MISSING_OVERLOADS: list[str] = []
"""Qualified names the last shimmed import had to stand in for (empty if none were needed)."""


@contextlib.contextmanager
def tolerate_missing_overloads() -> Iterator[list[str]]:
    """Within the block, ``torch.ops.aten.<op>.<missing overload>`` yields a MissingOverload."""
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__
    missing: list[str] = []

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            missing.append(f"{self._qualified_op_name}.{key}")
            return MissingOverload(missing[-1])

    packet.__getattr__ = lookup
    try:
        yield missing
    finally:
        packet.__getattr__ = original


def cast_type_as(self, other):
    """torch's `Tensor.type_as`: `self` cast to `other`'s dtype, as a new tensor."""
    return self if self.dtype == other.dtype else self.to(other.dtype)


STOCK_TYPE_AS: list = []  # torchax's own Tensor.type_as, kept for the canary test


def strided_slice_set(array, key, value):
    """`array.at[key].set(value)` without a scatter where `key` takes every `step`-th element from `start`
    (below `step`) to the end of one dimension, whose size `step` divides, and all of the others (`...`
    allowed); else None.

    torchax 0.0.13's `Tensor.__setitem__` is JAX's `.at[key].set`, which lowers a strided slice to
    `stablehlo.scatter`. Wan's attention writes its rotary embedding that way (`out[..., 0::2] = ...`,
    `out[..., 1::2] = ...`), and on an H200 those two scatters of q and k took 0.31 s of a 1.41 s step
    (Wan 2.1 14B, 8 blocks, 480x832x81; docs/gpus.md). Here the dimension is viewed as (size / step, step)
    and the value chosen where the second index is `start`: a reshape and a select, the same values.
    (Spreading the value with `lax.pad`'s interior padding instead also avoids the scatter, but the TPU
    compiler then took over 15 minutes on Wan 2.1 14B's 720p program, which compiles in 90 s.)"""
    import jax.numpy as jnp
    from jax import lax

    key = key if isinstance(key, tuple) else (key,)
    if key.count(Ellipsis) > 1 or not all(k is Ellipsis or isinstance(k, slice) for k in key):
        return None
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = key[:at] + (slice(None),) * (array.ndim - len(key) + 1) + key[at + 1 :]
    key = key + (slice(None),) * (array.ndim - len(key))
    if len(key) != array.ndim or not all(
        v is None or isinstance(v, int) for k in key for v in (k.start, k.stop, k.step)
    ):
        return None
    ranges = [range(*k.indices(size)) for k, size in zip(key, array.shape, strict=True)]
    whole = [r == range(size) for r, size in zip(ranges, array.shape, strict=True)]
    if whole.count(False) != 1:
        return None
    dim = whole.index(False)
    size, start, step = array.shape[dim], ranges[dim].start, ranges[dim].step
    if step < 2 or size % step or not 0 <= start < step or len(ranges[dim]) != size // step:
        return None
    blocks = (*array.shape[:dim], size // step, step, *array.shape[dim + 1 :])
    value = jnp.broadcast_to(jnp.asarray(value, array.dtype), tuple(len(r) for r in ranges))
    value = value.reshape(*array.shape[:dim], size // step, 1, *array.shape[dim + 1 :])
    chosen = (
        lax.broadcasted_iota(jnp.int32, (1,) * (dim + 1) + (step,) + (1,) * (array.ndim - dim - 1), dim + 1) == start
    )
    return jnp.where(chosen, value, array.reshape(blocks)).reshape(array.shape)


def scatter_free_setitem(stock_setitem):
    """torchax's `Tensor.__setitem__` with strided static slices written by strided_slice_set."""

    def setitem(self, key, val):
        jax_key, jax_val = self._env.t2j_iso((key, val))
        updated = strided_slice_set(self._elem, jax_key, jax_val)
        if updated is None:
            return stock_setitem(self, key, val)
        self._elem = updated

    setitem.stock_setitem = stock_setitem
    return setitem


def import_torchax():
    """Return the torchax module with its default environment built (the shim covers both steps).

    Building it starts JAX's backends, so they are set up for this host first (workarounds.libtpu.libtpu_off_tpu,
    workarounds.jax.keep_cpu_backend)."""
    from tpu_video.workarounds.jax import keep_cpu_backend
    from tpu_video.workarounds.libtpu import libtpu_off_tpu

    libtpu_off_tpu()
    keep_cpu_backend()
    with tolerate_missing_overloads() as missing:
        import torchax

        torchax.default_env()
    if missing:
        MISSING_OVERLOADS[:] = missing
    if torchax.tensor.Tensor.type_as is not cast_type_as:
        STOCK_TYPE_AS[:] = [torchax.tensor.Tensor.type_as]
        torchax.tensor.Tensor.type_as = cast_type_as
    if not hasattr(torchax.tensor.Tensor.__setitem__, "stock_setitem"):
        torchax.tensor.Tensor.__setitem__ = scatter_free_setitem(torchax.tensor.Tensor.__setitem__)
    return torchax


def op_definition(env, op):
    """The torchax environment's current lowering of `op`, or None. Private table (`env._ops`): the public
    `override_op_definition` has no getter."""
    return env._ops.get(op)


def restore_op_definition(env, op, previous) -> None:
    """Undo `override_op_definition` (which has no undo) by putting back what op_definition returned."""
    if previous is None:
        env._ops.pop(op, None)
    else:
        env._ops[op] = previous


def take_along_axis_gather(stock_gather):
    """`aten.gather` as `jnp.take_along_axis` when the index has the input's shape outside `dim`.

    torchax 0.0.13 lowers gather to advanced indexing over a full index grid. On a batch sharded over
    `dp`, XLA's partitioner then adds 2 all-reduces and 2 collective-permutes to HunyuanVideo-1.5's
    per-sample token reorder, which `take_along_axis` (the same values) compiles without. Other index
    shapes keep torchax's lowering (`stock_gather`, a JAX function). tests/test_torchax_compat.py shows
    both the values and the collectives; tests/test_upstream_bugs.py fails once torchax's own lowering
    stops adding them (then delete this and install_gather).
    """
    import jax
    from torchax.interop import call_jax

    def gather(input, dim, index, *, sparse_grad=False):
        dim = dim % max(input.ndim, 1)
        outside = [d for d in range(input.ndim) if d != dim]
        if input.ndim and input.ndim == index.ndim and all(input.shape[d] == index.shape[d] for d in outside):
            return call_jax(lambda x, i: jax.numpy.take_along_axis(x, i, axis=dim), input, index)
        return call_jax(stock_gather, input, dim, index)

    gather.stock_gather = stock_gather
    return gather


def install_gather(env) -> None:
    """Put take_along_axis_gather into torchax environment `env`, once."""
    current = op_definition(env, torch.ops.aten.gather)
    if not hasattr(current.func, "stock_gather"):  # installed once per environment
        env.override_op_definition(torch.ops.aten.gather, take_along_axis_gather(current.func))


def zero_unattended_rows_sdpa(stock_sdpa):
    """SDPA whose query rows with no key admitted by a boolean mask come out as zeros, as torch >= 2.5's
    SDPA gives them: torchax 0.0.13's reference softmax over all -inf gives NaN there. transformers counts
    on the zeros for left-padded prompts (the padding's queries see no key under the causal mask): Gemma 3
    in LTX-2's stage 1. Other masks and rows keep the stock values. Canary in tests/test_upstream_bugs.py."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = stock_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if attn_mask is None or attn_mask.dtype != torch.bool:
            return out
        return torch.where(attn_mask.any(dim=-1, keepdim=True), out, torch.zeros_like(out))

    sdpa.stock_sdpa = stock_sdpa
    return sdpa


def install_zero_unattended_rows_sdpa(env) -> None:
    """Put zero_unattended_rows_sdpa into torchax environment `env`, once (stage 2's attention plans
    override SDPA in their own blocks and put this back after)."""
    op = torch.nn.functional.scaled_dot_product_attention
    current = op_definition(env, op)
    if not hasattr(current.func, "stock_sdpa"):
        env.override_op_definition(op, zero_unattended_rows_sdpa(current.func))


def layout_keeping_group_norm(input, weight, bias, N, C, HxW, group, eps=1e-5):
    """`aten.native_group_norm` with the statistics taken over the group's channels and every other
    dimension in place, not over one flattened dimension.

    torchax 0.0.13 reshapes the input to (1, N * groups, C / groups * frames * height * width) and maps over
    the groups; with the activations split along width (stage 3's VAE decode) that reshape merges the split
    dimension into others, so XLA's partitioner all-gathers every normalised activation whole (CogVideoX's
    VAE: 25.5 GB per frame batch at 768x1360 on v6e-8, docs/planning.md). Here only the channel dimension is
    reshaped; the means are the same numbers up to summation order. tests/test_upstream_bugs.py fails once
    torchax's lowering stops gathering (then delete this and install_group_norm).
    """
    import jax
    import jax.numpy as jnp
    from torchax.interop import call_jax

    def norm(x, weight, bias):
        grouped = x.reshape(N, group, C // group, *x.shape[2:])
        axes = tuple(range(2, grouped.ndim))
        mean = jnp.mean(grouped, axis=axes, keepdims=True)
        var = jnp.var(grouped, axis=axes, keepdims=True)
        rstd = jax.lax.rsqrt(var + eps)
        out = ((grouped - mean) * rstd).reshape(x.shape)
        affine = (1, -1) + (1,) * (x.ndim - 2)
        if weight is not None:
            out = out * weight.reshape(affine)
        if bias is not None:
            out = out + bias.reshape(affine)
        return out, mean.reshape(N, group), rstd.reshape(N, group)

    return call_jax(norm, input, weight, bias)


def install_group_norm(env) -> None:
    """Put layout_keeping_group_norm into torchax environment `env`."""
    env.override_op_definition(torch.ops.aten.native_group_norm, layout_keeping_group_norm)


NEAREST_UPSAMPLES = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d")
NEAREST_UPSAMPLES += tuple(f"_upsample_nearest_exact{dims}d" for dims in (1, 2, 3))


def repeat_upsample(stock, overload: str):
    """Nearest (and nearest-exact) upsampling by whole factors as `jnp.repeat` along each spatial dimension.

    torchax 0.0.13 decomposes these ops into an index gather (`_unsafe_index`), which XLA's partitioner
    cannot split along a sharded spatial dimension: it all-gathers the whole input of every upsampler
    (the Wan VAE's 3, CogVideoX's 4 per frame program on 8 CPU devices). For a whole factor k both modes
    pick input i // k for output i, which `repeat` computes without a gather. Other sizes keep torchax's
    decomposition (`stock`). tests/test_upstream_bugs.py fails once the decomposition stops gathering.
    """
    import jax.numpy as jnp
    from torchax.interop import call_jax

    def upsample(input, output_size=None, *scales):
        dims = len(output_size) if output_size is not None else len(scales[0])
        spatial = input.shape[-dims:]
        if overload == "vec":  # (input, output_size or None, scale_factors or None)
            factors = scales[0] if scales and scales[0] is not None else [None] * dims
            sizes = output_size or [int(size * factor) for size, factor in zip(spatial, factors, strict=True)]
        else:  # (self, output_size, scales per dimension or None)
            factors = list(scales) + [None] * (dims - len(scales))
            sizes = output_size
        whole = [out // size if out % size == 0 else 0 for out, size in zip(sizes, spatial, strict=True)]
        given = all(f is None or f == k for f, k in zip(factors, whole, strict=True))
        if not all(whole) or not given:
            return stock(input, output_size, *scales)

        def repeated(x):
            for axis, factor in zip(range(x.ndim - dims, x.ndim), whole, strict=True):
                x = jnp.repeat(x, factor, axis=axis) if factor > 1 else x
            return x

        return call_jax(repeated, input)

    upsample.stock = stock
    return upsample


def install_repeat_upsample(env) -> None:
    """Put repeat_upsample into torchax environment `env` for both overloads of every nearest upsampling,
    once."""
    for name in NEAREST_UPSAMPLES:
        for overload in ("default", "vec"):
            op = getattr(getattr(torch.ops.aten, name), overload)
            current = env._get_op_or_decomp(op)
            if not hasattr(current.func, "stock"):
                env.override_op_definition(op, repeat_upsample(current.func, overload))


def repeat_interleave_by_int(stock):
    """`repeat_interleave` by a whole number as `jnp.repeat` with that number alone.

    torchax 0.0.13 hands `jnp.repeat` the output's length too (`Tensor.repeat_interleave`'s `output_size`,
    which diffusers passes) or turns the number into an array of repeats (the `aten.repeat_interleave.self_int`
    op); either way JAX leaves its broadcast-and-reshape path for one that builds the result with a scatter.
    HunyuanVideo-1.5 repeats its rotary table's channels so in every stage-2 step (diffusers'
    `get_1d_rotary_pos_embed`). The same values; tensors of repeats keep torchax's path (`stock`, a JAX
    function). tests/test_upstream_bugs.py fails once torchax repeats by a number without the scatter (then
    delete this and install_repeat_interleave)."""
    import jax.numpy as jnp
    from torchax.interop import call_jax

    def repeat_interleave(input, repeats, dim=None, *, output_size=None):
        if isinstance(repeats, int):
            return call_jax(lambda x: jnp.repeat(x, repeats, axis=dim), input)
        return call_jax(stock, input, repeats, dim, output_size=output_size)

    repeat_interleave.stock = stock
    return repeat_interleave


def install_repeat_interleave(env) -> None:
    """Put repeat_interleave_by_int into torchax environment `env` for the tensor method and the aten op, once."""
    for op in (torch.Tensor.repeat_interleave, torch.ops.aten.repeat_interleave.self_int):
        current = env._ops[op]
        if not hasattr(current.func, "stock"):
            env.override_op_definition(op, repeat_interleave_by_int(current.func))


def int_mm(a, b):
    """`aten._int_mm` (int8 x int8 matrices, int32 sums: `--quantize int8`'s matmul) as one
    `jax.lax.dot_general` with int32 accumulation, which the TPU runs on its int8 path.

    torchax 0.0.13 has no lowering for it (the op fails under torchax), and its `aten.mm` lowering would sum
    int8 products in int8. tests/test_upstream_bugs.py fails once torchax lowers `_int_mm` itself (then
    delete this and install_int_mm)."""
    import jax
    import jax.numpy as jnp
    from torchax.interop import call_jax

    def matmul(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)

    return call_jax(matmul, a, b)


def install_int_mm(env) -> None:
    """Put int_mm into torchax environment `env`."""
    env.override_op_definition(torch.ops.aten._int_mm.default, int_mm)


@contextlib.contextmanager
def quiet_attribute_scan():
    """torchax 0.0.13's JittableModule finds a module's tensors by reading every attribute of every
    submodule (`dir` + `getattr`). On a transformers model that evaluates two properties that only
    warn: `is_gradient_checkpointing` (a FutureWarning) and `loss_function` (a "loss_type=None" log
    line). Neither matters for inference; silence exactly those two while torchax scans."""
    import warnings

    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        transformers_logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers_logging.set_verbosity(verbosity)


def split_rotary_emb(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers 0.42.1's LTX-2 `apply_split_rotary_emb` (the same expressions in the same order) without
    its in-place `addcmul_` on two slices of one tensor: torchax 0.0.13 drops an in-place update made
    through a view, so the stock function returns the unrotated `x * cos` under torchax."""
    cos, sin = freqs
    dtype = x.dtype
    reshaped = x.ndim != 4 and cos.ndim == 4
    if reshaped:  # cos is (b, h, t, r): x to (b, h, t, dim per head)
        b, h, t, _ = cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
    last = x.shape[-1]
    if last % 2:
        raise ValueError(f"Expected x.shape[-1] to be even for split rotary, got {last}.")
    split = x.reshape(*x.shape[:-1], 2, last // 2).float()
    first, second = split[..., :1, :], split[..., 1:, :]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.cat([first * cos + -sin * second, second * cos + sin * first], dim=-2).reshape(*x.shape[:-1], last)
    if reshaped:
        out = out.swapaxes(1, 2).reshape(b, t, -1)
    return out.to(dtype)


@contextlib.contextmanager
def functional_split_rotary() -> Iterator[None]:
    """While tracing LTX-2's modules: diffusers' transformer_ltx2 module calls `split_rotary_emb` (its
    attention processors look the function up there at call time); restored after."""
    from diffusers.models.transformers import transformer_ltx2

    stock = transformer_ltx2.apply_split_rotary_emb
    transformer_ltx2.apply_split_rotary_emb = split_rotary_emb
    try:
        yield
    finally:
        transformer_ltx2.apply_split_rotary_emb = stock


def dedup_tied_buffers(jittable) -> None:
    """Keep one name per tensor among an `interop.JittableModule`'s buffers, the others re-added inside
    `functional_call` from its `_extra_dumped_weights`, as torchax already does for Parameters."""
    names: dict[int, list[str]] = {}
    for name, tensor in jittable.buffers.items():
        names.setdefault(id(tensor), []).append(name)
    for first, *others in names.values():
        if others:
            jittable._extra_dumped_weights.setdefault(first, []).extend(others)
            for name in others:
                del jittable.buffers[name]
