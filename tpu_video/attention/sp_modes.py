"""How attention uses a sequence split on the mesh's `sp` axis: the schemes a run may ask for and the one it
runs for its model's heads. Plain Python (no torch, no JAX), so the stages' parsers and the default mesh
choice (runtime.mesh) read it too."""

from __future__ import annotations

from sharding import SP, TP

# How attention uses a sequence split on `sp` (sp_mode_choice). ulysses: an all-to-all
# turns the sequence split into a head split, attention runs over the whole sequence for the device's
# heads, one all-to-all turns the output back (DeepSpeed-Ulysses). ring: queries stay split and key/value
# chunks pass round the sp devices, merged exactly by log-sum-exp. gather: queries stay split and every
# device gathers all keys and values. auto: ulysses where the heads per tp shard divide by sp, else ring
# (gather with a Splash local window, which ring cannot shift).
SP_MODES = ("auto", "ulysses", "ring", "gather")


def sp_mode_choice(sp_mode: str, mesh_shape: dict[str, int], heads: int, local_window: bool = False) -> tuple[str, str]:
    """The sequence-parallel scheme ("none", "ulysses", "ring" or "gather") a run uses for its model's
    attention heads, and why; ValueError where the scheme asked for cannot run."""
    sp, tp = mesh_shape[SP], mesh_shape[TP]
    if sp == 1:
        return "none", "sp=1: the sequence is not split"
    local = heads // tp if heads % tp == 0 else heads
    fits = local % sp == 0
    if sp_mode == "ulysses" and not fits:
        raise ValueError(
            f"sp_mode ulysses: the {local} heads per tp shard do not divide by sp={sp} ({heads} heads, tp={tp}); "
            "use a smaller sp or tp, or sp_mode ring"
        )
    if sp_mode == "ring" and local_window:
        raise ValueError(
            "sp_mode ring cannot run a local window (each chunk's window moves as keys pass round the ring); "
            "use sp_mode ulysses or gather"
        )
    if sp_mode in ("ring", "gather"):
        return sp_mode, "asked for"
    if fits:
        return "ulysses", f"{sp_mode}: {local} heads per tp shard, {local // sp} per device inside attention"
    if local_window:
        return "gather", f"auto: {local} heads per tp shard do not divide by sp={sp}, and ring has no local window"
    return "ring", f"auto: {local} heads per tp shard do not divide by sp={sp}"
