"""Attention over a sequence split on the mesh's `sp` axis: which scheme runs (runtime.SP_MODES) and
DeepSpeed-Ulysses' two all-to-alls around any per-device attention (splash_attention uses both).

Ulysses: q, k and v arrive split along the sequence; one all-to-all each trades that for a split of the
`tp`-local heads over `sp`, so each device attends over the whole sequence for its heads, and one
all-to-all trades the output back. Per attention that is 4 all-to-alls of about S x width / (tp x sp)
elements per device, where gathering keys and values moves about 2 x S x width / tp.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from runtime import SP, TP


def ulysses_applies(sp_mode: str, mesh: Mesh | None, heads: int) -> bool:
    """Whether attention with `heads` heads runs Ulysses on `mesh` (see SP_MODES): `sp` > 1, not
    `gather`, and the heads a device keeps after `tp` divide by `sp`."""
    if mesh is None or mesh.shape[SP] == 1 or sp_mode == "gather":
        return False
    tp = mesh.shape[TP] if heads % mesh.shape[TP] == 0 else 1
    return (heads // tp) % mesh.shape[SP] == 0


def sp_mode_choice(sp_mode: str, mesh_shape: dict[str, int], heads: int) -> tuple[str, str]:
    """The sequence-parallel scheme a run uses for its model's attention heads, and why; ValueError
    where `ulysses` is asked for and the heads do not allow it."""
    sp, tp = mesh_shape[SP], mesh_shape[TP]
    if sp == 1:
        return "none", "sp=1: the sequence is not split"
    local = heads // tp if heads % tp == 0 else heads
    fits = local % sp == 0
    if sp_mode == "ulysses" and not fits:
        raise ValueError(
            f"sp_mode ulysses: the {local} heads per tp shard do not divide by sp={sp} ({heads} heads, tp={tp}); "
            "use a smaller sp or tp, or sp_mode gather"
        )
    if sp_mode == "gather" or not fits:
        why = "asked for" if sp_mode == "gather" else f"auto: {local} heads per tp shard do not divide by sp={sp}"
        return "gather", why
    return "ulysses", f"{sp_mode}: {local} heads per tp shard, {local // sp} per device inside attention"


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
