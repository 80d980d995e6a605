"""Identical transformer blocks run as one scan over their stacked weights (`--scan_blocks`), so tracing
and compiling a step do not grow with the model's depth.

The blocks stay where they are (the stock forward still loops over them), but the first block of the
scanned span runs every block of the span as one `runtime.scan` (jax.lax.scan under torchax) and the
others hand their input on unchanged. The span's weights are stacked before placement into the first
block's parameters, one (blocks, ...) tensor per name, filled one block at a time so the host never holds
two copies (weights not read yet, tpu_video/engine/direct_load.py, are stacked as sources, read at placement); the
other blocks keep no weights. The rule tables match the stacked names as
they are (`blocks.0.attn1.to_q.weight`): `RuleTable.with_stacked` lays them out as one block's weight
with the stacked dimension unsplit.

Each iteration runs the first block's own forward on its slice of the weights, with the block's hooks
(the layout pins and barrier of models.common.constrain_block_inputs), so a scanned step computes what
the unrolled one does. The step caches (tpu_video/engine/cached_blocks.py) wrap the blocks after this: the
scanned span is their cached span, so the interval cache's outer blocks run apart.
"""

from __future__ import annotations

import inspect
import json

import torch

from tpu_video.cli import UserError, log
from tpu_video.engine.cached_blocks import block_list, cached_span
from tpu_video.engine.direct_load import stacked_source
from tpu_video.workarounds.diffusers import register_hunyuanvideo15_block


def _description(block: torch.nn.Module) -> str:
    """What a program reads of a block apart from its weights' values (the executable key's description)."""
    from tpu_video.runtime import program_key

    arguments = {id(tensor) for tensor in (*block.parameters(), *block.buffers())}
    return json.dumps(program_key.Describer(arguments)(block), default=str)


def difference(blocks) -> str | None:
    """Why the blocks cannot run as one scan (None: they are identical but for their weights' values)."""
    from tpu_video.runtime.program_key import ProgramKeyError

    try:
        first = _description(blocks[0])
        for index, block in enumerate(blocks[1:], 1):
            if _description(block) != first:
                return f"block {index} differs from block 0"
    except ProgramKeyError as error:
        return f"the blocks cannot be compared: {error}"
    return None


class BlockScan:
    """Installed on one transformer: the blocks `span` (first, end) run as one `scan(body, carry, weights)`
    (Runtime.scan). The carry is what the blocks return (the video tokens, and the text tokens where a
    block returns them too, as diffusers' block registry says, or the guided module's `block_streams`:
    LTX-2's video and audio); every other input is the same for each, except those the guided module's
    `scan_block_arguments(first, end)` gives per block, stacked (LTX-2's STG perturbation mask)."""

    def __init__(self, transformer, span: tuple[int, int], scan, metadata=None, block_arguments=None) -> None:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        register_hunyuanvideo15_block()
        blocks = block_list(transformer)
        first, end = span
        self.list_name = next(name for name, child in transformer.named_children() if child is blocks)
        self.template, self.members = blocks[first], list(blocks[first:end])
        self.span = span
        self.scan = scan
        meta = metadata or TransformerBlockRegistry.get(type(self.template))
        self.carried = [meta.hidden_states_argument_name]
        self.returned = [meta.return_hidden_states_index]
        if meta.return_encoder_hidden_states_index is not None:
            self.carried.append(meta.encoder_hidden_states_argument_name)
            self.returned.append(meta.return_encoder_hidden_states_index)
        self.block_arguments = block_arguments
        self.block_forward = self.template.forward
        self.names = _stack_weights(self.members)
        self.template.forward = _ScannedSpan(self)
        for member in self.members[1:]:
            member.forward = _HandOn(self)
        transformer.block_scans = [*getattr(transformer, "block_scans", []), self]

    def stacked_names(self) -> list[str]:
        """The stacked tensors' names in the transformer (the rule tables' names of the span's first block)."""
        return [f"{self.list_name}.{self.span[0]}.{name}" for name in self.names]

    def bind(self, args, kwargs) -> inspect.BoundArguments:
        return inspect.signature(self.block_forward).bind(*args, **kwargs)

    def pack(self, carry: tuple):
        """The carry as the blocks return it."""
        if len(carry) == 1:
            return carry[0]
        values = [None] * len(carry)
        for index, value in zip(self.returned, carry, strict=True):
            values[index] = value
        return tuple(values)

    def run(self, args, kwargs):
        bound = self.bind(args, kwargs)
        carry = tuple(bound.arguments[name] for name in self.carried)
        weights = dict(self.template.named_parameters())
        weights.update(self.template.named_buffers())
        varying = self.block_arguments(*self.span) if self.block_arguments is not None else {}

        def body(carry, sliced):
            weights, own = sliced
            bound.arguments.update(zip(self.carried, carry, strict=True))
            bound.arguments.update(own)
            saved = self.template.__dict__.pop("forward")  # this object, or a step cache's wrapper of it
            self.template.forward = self.block_forward  # one block, with its hooks
            try:
                out = torch.func.functional_call(self.template, weights, bound.args, bound.kwargs)
            finally:
                self.template.forward = saved
            return tuple(out[index] for index in self.returned) if len(carry) > 1 else (out,)

        return self.pack(self.scan(body, carry, (weights, varying)))


class _ScannedSpan:
    """The span's first block: runs the whole span (an object, so the block's state dict is unchanged)."""

    def __init__(self, scan: BlockScan) -> None:
        self.owner = scan

    def __call__(self, *args, **kwargs):
        return self.owner.run(args, kwargs)


class _HandOn:
    """A later block of the span: its work is done by the scan, so it returns what it is given."""

    def __init__(self, scan: BlockScan) -> None:
        self.owner = scan

    def __call__(self, *args, **kwargs):
        bound = self.owner.bind(args, kwargs)
        return self.owner.pack(tuple(bound.arguments[name] for name in self.owner.carried))


def _stack_weights(members: list[torch.nn.Module]) -> list[str]:
    """Move the members' weights into the first member's, stacked along a new first dimension; each
    member's tensor is released once copied (the host holds one copy, plus one block's weight, at most).
    Returns the stacked names (relative to a block)."""
    template = members[0]
    names = []
    for store in ("_parameters", "_buffers"):
        for path, owner in template.named_modules():
            for leaf, value in list(getattr(owner, store).items()):
                if value is None:
                    continue
                stacked = torch.empty((len(members), *value.shape), dtype=value.dtype, device=value.device)
                sources = []  # where weights not read yet lie (tpu_video/engine/direct_load.py): stacked as sources
                for index, member in enumerate(members):
                    holder = getattr(member.get_submodule(path), store)
                    sources.append(holder[leaf])
                    with torch.no_grad():
                        stacked[index].copy_(holder[leaf])
                    if index:
                        del holder[leaf]
                stacked = torch.nn.Parameter(stacked, requires_grad=False) if store == "_parameters" else stacked
                if value.is_meta:
                    stacked.file_source = stacked_source(sources)
                del sources
                getattr(owner, store)[leaf] = stacked
                names.append(f"{path}.{leaf}" if path else leaf)
    return names


def cut(span: tuple[int, int], edges: tuple[int, int]) -> list[tuple[int, int]]:
    """`span` cut where an edge of the step cache's span falls inside it: a scan runs on one side of each edge
    (a cached step runs the blocks outside the cached span and skips those inside)."""
    first, end = span
    points = sorted({first, end, *(edge for edge in edges if first < edge < end)})
    return list(zip(points, points[1:], strict=False))


def install(loop, setting: str, cache, scan):
    """`--scan_blocks setting` on every transformer of a DenoiseLoop (before anything is placed), over all
    its blocks, the span of the step cache `cache` (CacheSettings: the interval cache runs its outer blocks
    apart), or the spans the guided module's `scan_spans(blocks)` names (Wan VACE: the blocks between two
    of its hints, each hint added after the last block of a span), cut at the cache's span. A guided module's
    `scan_when_asked` (why) keeps `auto` unrolled. Returns the loop's rule table with the stacked weights'
    layouts. `on` where the blocks differ is an error."""
    if setting == "off":
        return loop.rules
    names = set()
    for guided in loop.guided:
        transformer = guided.transformer
        blocks = block_list(transformer)
        try:
            span = cached_span(cache, len(blocks)) if cache.enabled else (0, len(blocks))
        except UserError:
            continue  # a cache this model cannot hold: the step cache says so, after its other checks
        if setting == "auto" and getattr(guided, "scan_when_asked", None):
            log(f"{type(transformer).__name__}: blocks unrolled ({guided.scan_when_asked}; --scan_blocks on scans)")
            continue
        if hasattr(guided, "scan_spans"):
            pieces = [piece for hinted in guided.scan_spans(len(blocks)) for piece in cut(hinted, span)]
            spans = [(first, end) for first, end in pieces if end - first >= 2]
            why = None if spans else "no two of its blocks run in a row between its hints"
        else:
            spans, count = [span], span[1] - span[0]
            why = f"only {count} block(s) to scan" if count < 2 else None
        if why is None:
            why = next((why for why in (difference(blocks[first:end]) for first, end in spans) if why), None)
        if why is not None:
            if setting == "on":
                raise UserError(f"--scan_blocks on: {type(transformer).__name__}: {why}")
            continue
        streams, varying = getattr(guided, "block_streams", None), getattr(guided, "scan_block_arguments", None)
        for first, end in spans:
            names.update(BlockScan(transformer, (first, end), scan, streams, varying).stacked_names())
        where = ", ".join(f"{first} to {end - 1}" for first, end in spans)
        log(f"{type(transformer).__name__}: blocks {where} run as {'one scan' if len(spans) == 1 else 'scans'}")
    return loop.rules.with_stacked(names)


def record(loop, setting: str) -> dict:
    """What the stage-2 section says: the flag, and per transformer the scanned blocks [first, end), a list of
    them where several spans are scanned (Wan VACE and Animate), or None."""
    spans = {}
    for name, guided in zip(loop.expert_names, loop.guided, strict=True):
        scans = [list(scan.span) for scan in getattr(guided.transformer, "block_scans", [])]
        spans[name] = (scans[0] if len(scans) == 1 else scans) or None
    return {"scan_blocks": {"setting": setting, "scanned": spans}}


def repeated_blocks(transformer) -> int:
    """How many blocks the transformer's scans run beyond their first (each scan's body is compiled once)."""
    return sum(scan.span[1] - scan.span[0] - 1 for scan in getattr(transformer, "block_scans", []))
