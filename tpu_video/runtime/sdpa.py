"""The torchax SDPA override: `torch.nn.functional.scaled_dot_product_attention` inside the torchax
environment runs the backend an AttentionPlan (tpu_video/attention/plan.py) resolved, under the plan's
sequence-parallel scheme. It reads the plan and never the flags."""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
import torch
from jax.sharding import Mesh

from splash_attention import splash_attention
from tpu_video.attention.calls import in_cross_attention
from tpu_video.attention.cudnn import fused_attention
from tpu_video.attention.masks import masks_from_attn_mask
from tpu_video.attention.plan import AttentionPlan
from tpu_video.attention.sequence_parallel import call_scheme
from tpu_video.attention.xla import xla_attention, xla_sequence_parallel_attention
from tpu_video.workarounds.torchax import op_definition, restore_op_definition


def make_sdpa(plan: AttentionPlan, mesh: Mesh | None = None, fused_implementation: str | None = "cudnn"):
    """A torch-level `scaled_dot_product_attention` (diffusers' keyword names) running the plan's backend
    (`fused_implementation` None runs the cudnn backend's call on XLA: how CPU tests exercise it)."""
    from torchax.interop import call_jax

    backend = plan.backend

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if dropout_p or is_causal or enable_gqa:
            raise ValueError(f"{backend} attention supports neither dropout, is_causal nor enable_gqa")

        cross = in_cross_attention()  # read at trace time, where the family's marks are set
        splash = plan.splash
        if cross and splash is not None and splash.local_window is not None:
            splash = dataclasses.replace(splash, local_window=None)  # a window over positions of one sequence

        def jax_attention(q, k, v, mask):
            self_attention = q.shape[2] == k.shape[2] and not cross
            scheme = call_scheme(plan.sequence_parallel, mesh, q.shape[1], self_attention)
            if backend == "xla":
                boolean = mask is None or mask.dtype == jnp.bool_
                if boolean and scheme in ("ulysses", "ring"):
                    return xla_sequence_parallel_attention(q, k, v, mask, scale=scale, mesh=mesh, scheme=scheme)
                return xla_attention(q, k, v, mask, scale=scale)
            key_valid, query_valid = masks_from_attn_mask(mask, q.shape[0], q.shape[2], k.shape[2])
            if backend == "cudnn":
                return fused_attention(
                    q, k, v, key_valid, query_valid, scale=scale, implementation=fused_implementation
                )
            return splash_attention(
                q, k, v, key_valid, query_valid=query_valid, scale=scale, config=splash, mesh=mesh, scheme=scheme
            )

        return call_jax(jax_attention, query, key, value, attn_mask)

    return scaled_dot_product_attention


@contextlib.contextmanager
def attention_backend(env, plan: AttentionPlan, mesh: Mesh | None = None, fused_implementation: str | None = "cudnn"):
    """Within the block, SDPA in the torchax environment `env` runs the plan's backend on `mesh`: "splash"
    (the kernel), "xla" (`xla_attention`) or "cudnn" (`fused_attention`).

    The previous lowering is put back on exit (workarounds.torchax.restore_op_definition), which keeps
    tests and repeated in-process runs independent.
    """
    op = torch.nn.functional.scaled_dot_product_attention
    previous = op_definition(env, op)
    env.override_op_definition(op, make_sdpa(plan, mesh, fused_implementation))
    try:
        yield
    finally:
        restore_op_definition(env, op, previous)
