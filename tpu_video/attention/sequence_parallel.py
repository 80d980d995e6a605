"""Attention over a sequence split on the mesh's `sp` axis: which scheme one call runs (from the run's
attention plan, tpu_video/attention/plan.py), and the collectives of the two schemes that keep the split inside
attention (splash_attention and attention.xla use both).

Ulysses: q, k and v arrive split along the sequence; one all-to-all each trades that for a split of the
`tp`-local heads over `sp`, so each device attends over the whole sequence for its heads, and one
all-to-all trades the output back. Per attention that is 4 all-to-alls of about S x width / (tp x sp)
elements per device, where gathering keys and values moves about 2 x S x width / tp.

Ring: every device keeps its query chunk and passes its key/value chunk (with the chunk's key validity)
to the next device sp - 1 times, attending to each chunk as it passes; the partial results merge
exactly through their log-sum-exp. It needs no head split, so it runs where Ulysses cannot; each device
still receives all keys and values, but one chunk at a time (memory S / sp), and on TPU the permute
overlaps the next chunk's attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding import DP, SP, TP


def call_scheme(scheme: str, mesh: Mesh | None, heads: int, self_attention: bool) -> str | None:
    """The scheme one attention call runs, from the plan's `scheme` for the model's heads (AttentionPlan.
    sequence_parallel); None without a split sequence. Cross-attention to a short text never rings: its
    keys are whole on every device already, so `gather` moves nothing."""
    if mesh is None or mesh.shape[SP] == 1 or scheme == "none":
        return None
    if scheme == "ulysses":
        local = heads // mesh.shape[TP] if heads % mesh.shape[TP] == 0 else heads
        if local % mesh.shape[SP]:
            raise ValueError(
                f"ulysses was planned for the model's heads; this call's {local} heads per tp shard do not divide by sp"
            )
    return "gather" if scheme == "ring" and not self_attention else scheme


def mesh_axes(mesh: Mesh | None, batch: int, heads: int) -> tuple[str | None, str | None, int]:
    """Mesh axes for batch and heads (None where the axis does not divide them: that dimension is then
    computed whole on every device of the axis) and the number of query-sequence shards."""
    if mesh is None:
        return None, None, 1
    batch_axis = DP if batch % mesh.shape[DP] == 0 else None
    head_axis = TP if heads % mesh.shape[TP] == 0 else None
    return batch_axis, head_axis, mesh.shape[SP]


def ulysses(mesh: Mesh, batch_axis, head_axis, local_attention, masks_spec):
    """`local_attention(q, k, v, *masks)` (this device's heads, whole sequence) under shard_map with the
    two all-to-alls of Ulysses around it: q, k, v arrive split along the sequence on `sp` and leave as
    the output split the same way. `masks_spec` is the shard_map spec of each mask argument."""
    seq_spec = P(batch_axis, head_axis, SP, None)

    def attend(q, k, v, *masks):
        q, k, v = (jax.lax.all_to_all(x, SP, split_axis=1, concat_axis=2, tiled=True) for x in (q, k, v))
        out = local_attention(q, k, v, *masks)
        return jax.lax.all_to_all(out, SP, split_axis=2, concat_axis=1, tiled=True)

    return jax.shard_map(
        attend, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec, *masks_spec), out_specs=seq_spec, check_vma=False
    )


def merge_partials(out, lse, part, part_lse):
    """Softmax attention over keys A and B from its parts over A and over B: outputs (normalised, float32)
    weighted by exp(lse - combined lse). A part with no visible key has lse -inf and weight 0."""
    combined = jnp.logaddexp(lse, part_lse)
    safe = jnp.where(jnp.isfinite(combined), combined, 0.0)
    return out * jnp.exp(lse - safe)[..., None] + part * jnp.exp(part_lse - safe)[..., None], combined


def ring(mesh: Mesh, batch_axis, head_axis, local_attention, extra_spec=()):
    """`local_attention(q, k, v, key_valid, *extra)` -> (output, log-sum-exp over the given keys, -inf
    where none is valid) run as ring attention under shard_map: q, k, v and key_valid (B, S) arrive split
    along the sequence on `sp`, and the output leaves split the same way, in float32. `extra_spec` is the
    shard_map spec of each further argument (passed unchanged)."""
    sp = mesh.shape[SP]
    seq_spec = P(batch_axis, head_axis, SP, None)
    to_next = [(i, (i + 1) % sp) for i in range(sp)]

    def attend(q, k, v, key_valid, *extra):
        out = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        for step in range(sp):
            if step:
                k, v, key_valid = (jax.lax.ppermute(x, SP, to_next) for x in (k, v, key_valid))
            part, part_lse = local_attention(q, k, v, key_valid, *extra)
            out, lse = merge_partials(out, lse, part.astype(jnp.float32), part_lse)
        return out

    return jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(seq_spec, seq_spec, seq_spec, P(batch_axis, SP), *extra_spec),
        out_specs=seq_spec,
        check_vma=False,
    )
