"""The dp/sp/tp mesh shape of a stage-2 run: the one default choice every run and plan makes, and the
checks on axis sizes given as flags. Plain arithmetic over `ModelFacts` (heads, the weight dimensions the
rule table splits on tp, weight bytes), so it needs no JAX and no compile.

The default, for the axes the user left unset:
- `dp` takes the guidance batch (its branches: 2 with classifier-free guidance, LTX-2 up to 4; times the
  videos of a batch, stage 2's `--batch_size`), its largest divisor that divides the devices, since the
  samples need no traffic until the branches are combined;
- `tp` is the largest divisor of the attention heads and of every weight dimension the rule table splits
  on tp that fits within one host (its all-reduces run twice per block and want the fastest links);
- `sp` takes the remaining devices, attention over it by Ulysses where the heads per tp shard divide by
  sp, else by ring (sp_mode_choice).
A candidate whose estimated memory per device (its weights, plus the family's activation estimate for
the samples and tokens it holds: `Activations`) would pass MEMORY_SHARE of the device's memory is passed
over for the next (dp 1, so tp may grow; sp larger); if none fits, the one needing least is returned and
its reason says so (`--plan` then reports exactly by how much, and names the smallest slice that fits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sharding import DP, SP, TP, MeshShape
from tpu_video.attention.sp_modes import sp_mode_choice

GIB = 2**30
# Of each device's memory, the share the estimate (weights and activations) may take by default: the
# compiled program, its outputs, XLA's scratch and the estimate's error need the rest (the plan's compile
# gives the exact peak).
MEMORY_SHARE = 0.85


@dataclass(frozen=True)
class Activations:
    """An estimate of the activation memory of one sample (a video's CFG branch) at a block's peak, in
    copies of its [tokens, width] hidden states: `whole` copies every tp device holds entire (the residual
    stream, norms, modulation), `split` copies tp divides (attention heads, the MLP's hidden width), `fp32`
    copies in float32 whatever the run's dtype (Wan TI2V's per-token modulation); sp divides the tokens of
    all of them. Each family's copies are fitted to the TPU compiler's temporaries (docs/planning.md)."""

    tokens: int  # video tokens per sample
    width: int  # the blocks' hidden width
    element_bytes: int  # of the run's dtype
    whole: float
    split: float
    fp32: float = 0.0

    def bytes_per_device(self, samples: int, sp: int, tp: int) -> int:
        cells = samples * math.ceil(self.tokens / sp) * self.width
        return int(cells * (self.element_bytes * (self.whole + self.split / tp) + 4 * self.fp32))


@dataclass(frozen=True)
class ModelFacts:
    """What the mesh choice needs to know of a model's stage-2 weights and, for one request, its
    activations (engine.meta.model_facts; None: weights only)."""

    heads: int
    split_bytes: tuple[tuple[int, int], ...] = ()  # (size of a dimension split on tp, bytes of its tensors)
    replicated_bytes: int = 0
    activations: Activations | None = None

    @property
    def tp_dims(self) -> tuple[int, ...]:
        return tuple(sorted({dim for dim, _ in self.split_bytes}))

    def weight_bytes(self, tp: int) -> int:
        """Weight bytes per device with `tp` devices on tp (a dimension tp does not divide stays whole)."""
        split = sum(size // tp if dim % tp == 0 else size for dim, size in self.split_bytes)
        return self.replicated_bytes + split

    def bytes_per_device(self, shape: MeshShape, batch: int) -> int:
        """The estimate for one device of `shape` running a batch of `batch` samples: its weights and the
        activations of the batch / dp samples it holds."""
        activations = (
            self.activations.bytes_per_device(batch // shape.dp, shape.sp, shape.tp) if self.activations else 0
        )
        return self.weight_bytes(shape.tp) + activations


@dataclass(frozen=True)
class MeshChoice:
    shape: MeshShape
    why: str
    fits: bool = True  # False: the estimate passes MEMORY_SHARE of the device memory on every valid mesh
    estimate: int = 0  # bytes per device: weights and estimated activations (ModelFacts.bytes_per_device)

    def record(self) -> dict:
        return {**self.shape.as_dict(), "why": self.why, "fits_estimate": self.fits, "estimated_bytes": self.estimate}


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _candidates(devices: int, dp, sp, tp, batch: int, model: ModelFacts, per_host: int):
    """Valid meshes for the given axes, in order of preference: dp the batch first, then tp largest."""
    for d in [dp] if dp else [d for d in _divisors(batch) if devices % d == 0]:
        if devices % d:
            continue
        rest = devices // d
        if sp:
            tps = [tp] if tp else ([rest // sp] if rest % sp == 0 else [])
        else:
            tps = [tp] if tp else _divisors(rest)
        for t in tps:
            whole = all(dim % t == 0 for dim in (model.heads, *model.tp_dims))
            if rest % t or per_host % t or not (tp or whole):
                continue
            s = sp or rest // t
            if d * s * t == devices:
                yield MeshShape(d, s, t)


def default_mesh(
    devices: int,
    dp: int | None = None,
    sp: int | None = None,
    tp: int | None = None,
    *,
    branches: int,
    model: ModelFacts,
    devices_per_host: int | None = None,
    device_memory: int | None = None,
    videos: int = 1,
    sequence_split: bool = True,
) -> MeshChoice:
    """The mesh for `devices` with the axes given (None: chosen as the module docstring says) and why.

    Raises ValueError, naming a mesh that works where there is one, when the given sizes cannot work:
    their product is not the device count, tp does not divide the heads or spans hosts, or dp is larger
    than the batch (`videos` times the guidance `branches` of one step). `sequence_split` False: a default sp
    is 1 (attention that does not run on a split sequence).
    """
    for name, value in ((DP, dp), (SP, sp), (TP, tp)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    per_host = min(devices_per_host or devices, devices)
    batch = videos * branches
    defaults = list(_candidates(devices, None, None, None, batch, model, per_host))
    hint = f"; a mesh that works: {defaults[0]}" if defaults else ""
    _check_given(devices, (dp, sp, tp), batch, model.heads, per_host, hint)
    options = list(_candidates(devices, dp, sp or (None if sequence_split else 1), tp, batch, model, per_host))
    if not options:
        wanted = _given(dp, sp, tp) or "its defaults"
        raise ValueError(f"no mesh of {devices} devices has {wanted}{'' if sequence_split else ' and sp 1'}{hint}")
    budget = device_memory * MEMORY_SHARE if device_memory else None
    fitting = [shape for shape in options if budget is None or model.bytes_per_device(shape, batch) <= budget]
    shape = fitting[0] if fitting else min(options, key=lambda option: model.bytes_per_device(option, batch))
    why = _why(shape, (dp, sp, tp), branches, model, device_memory, bool(fitting), videos, sequence_split)
    if fitting and shape != options[0]:
        first = model.bytes_per_device(options[0], batch) / GIB
        why += f"; {options[0]} would need {first:.2f} GiB per device (estimated), more than {MEMORY_SHARE:.0%} of it"
    return MeshChoice(shape, why, bool(fitting), model.bytes_per_device(shape, batch))


def default_batch(videos: int, devices: int, *, branches: int, model: ModelFacts, **mesh) -> tuple[int, str]:
    """Stage 2's default videos per batch for a group of `videos`, and why: the largest number whose default
    mesh (`mesh`: default_mesh's axis and memory arguments) gives every device at most one sample (a video's
    CFG branch) and its estimate within MEMORY_SHARE of its memory. More samples per device is left to
    `--batch_size`, which `--plan --batch_size` measures exactly."""
    for size in range(min(videos, devices // branches), 1, -1):
        try:
            choice = default_mesh(devices, branches=branches, model=model, videos=size, **mesh)
        except ValueError:  # axes given as flags that cannot hold this batch
            continue
        if choice.fits and size * branches <= choice.shape.dp:
            return size, f"{size} videos: one sample per device on {choice.shape}"
    if videos == 1:
        return 1, "one video"
    return 1, "one video: two would put a second sample on a device, or pass the memory estimate"


def _given(dp, sp, tp) -> str:
    return ", ".join(f"{name} {value}" for name, value in ((DP, dp), (SP, sp), (TP, tp)) if value)


def _check_given(devices: int, given, batch: int, heads: int, per_host: int, hint: str) -> None:
    dp, sp, tp = given
    product = (dp or 1) * (sp or 1) * (tp or 1)
    if dp and sp and tp and product != devices:
        raise ValueError(
            f"dp {dp} x sp {sp} x tp {tp} = {product} devices, but {devices} are available; "
            f"their product must equal the device count{hint}"
        )
    if devices % product:
        raise ValueError(
            f"{_given(dp, sp, tp).replace(',', ' x')} = {product} does not divide the {devices} devices{hint}"
        )
    if tp and heads % tp:
        raise ValueError(f"tp {tp} does not divide the transformer's {heads} attention heads{hint}")
    if tp and per_host % tp:
        raise ValueError(
            f"tp {tp} would span hosts ({per_host} devices each): keep tp within a host and put "
            f"the hosts on dp or sp{hint}"
        )
    if dp and dp > batch:
        what = {1: "one sample (CFG is off)", 2: "the two CFG branches"}.get(batch, "videos times guidance branches")
        raise ValueError(
            f"dp {dp} is more than the batch of {batch}, {what}: devices would hold identical copies doing "
            f"identical work{hint}"
        )


def _why(
    shape: MeshShape,
    given,
    branches: int,
    model: ModelFacts,
    device_memory: int | None,
    fits: bool,
    videos: int,
    sequence_split: bool = True,
) -> str:
    """One line: which axes were given, and why each default axis got its size."""
    dp, sp, tp = given
    parts = []
    if not dp:
        samples = videos * branches
        passes = "2 CFG branches" if branches == 2 else f"{branches} guidance passes"
        if videos == 1:  # one video: its guidance branches
            what = f"the {passes} of one video"
        else:
            what = f"the {samples} samples of {videos} videos" + (f" x {passes}" if branches > 1 else " (CFG is off)")
        if samples == 1:
            parts.append("dp 1: one sample (CFG is off)")
        elif shape.dp == samples:
            parts.append(f"dp {shape.dp}: {what}")
        else:
            parts.append(f"dp {shape.dp}: the largest divisor of {what} a mesh here allows")
    if not tp:
        parts.append(
            f"tp {shape.tp}: the largest divisor of the {model.heads} heads and the split weight dimensions "
            "that fits in one host"
        )
    if not (sp or sequence_split):
        parts.append("sp 1: the attention backend does not run on a split sequence")
    elif not sp:
        scheme = sp_mode_choice("auto", shape.as_dict(), model.heads)[0]
        parts.append(f"sp {shape.sp}: the rest" + (f" ({scheme} attention)" if shape.sp > 1 else ""))
    batch = videos * branches
    estimate = f"weights {model.weight_bytes(shape.tp) / GIB:.2f} GiB"
    if model.activations:
        activations = model.bytes_per_device(shape, batch) - model.weight_bytes(shape.tp)
        estimate += f" + activations {activations / GIB:.2f} GiB (estimated)"
    memory = f" of {device_memory / GIB:.1f} GiB" if device_memory else ""
    parts.append(f"{estimate} per device{memory}")
    if not fits:
        parts.append(f"more than {MEMORY_SHARE:.0%} of it on every mesh of these devices")
    if given != (None, None, None):
        parts.insert(0, f"given {_given(*given)}")
    return "; ".join(parts)
