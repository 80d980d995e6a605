"""The device side of stage 2's step caches (tpu_video/engine/step_cache.py runs them): a span of transformer blocks
replaced by its input plus a kept residual, traced into the compiled programs.

Programs: `forward` is the full step; it also returns the span's new residual and, per branch, the
MagCache magnitude ratio (used when calibrating), and takes a per-branch `reuse` flag so that a state
that skips while its batch neighbour computes gets diffusers' result. `cached` is the cached step.
"""

from __future__ import annotations

import contextlib

import torch

from sharding import DP, SP
from tpu_video.cli import UserError
from tpu_video.engine.cache_schedule import CacheSettings
from tpu_video.workarounds.diffusers import register_hunyuanvideo15_block

HIDDEN_LAYOUT = (DP, SP, None)  # the residuals' layouts: the blocks' own (batch on dp, video tokens on sp)
TEXT_LAYOUT = (DP, None, None)


# The device side -----------------------------------------------------------------------------------


class _Probed(Exception):
    """Raised while tracing the probe: the span's input shapes, found without compiling anything."""

    def __init__(self, shapes) -> None:
        super().__init__("probe")
        self.shapes = shapes


def block_list(transformer: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer's one list of blocks, found as diffusers' cache hooks find it."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    lists = [
        child
        for name, child in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
    ]
    if len(lists) != 1:
        raise ValueError(f"{type(transformer).__name__}: expected one list of transformer blocks, found {len(lists)}")
    return lists[0]


class BlockCache:
    """Installed on one transformer's blocks: while a CachedDenoiser method traces, the blocks of `span`
    (first, end) either run and report their residual (`full`) or are replaced by the cached one
    (`cached`). Outside those methods the blocks run as they are. `branches` equal chunks of the batch
    keep separate states (diffusers' cache contexts); `cache_text` also caches the text tokens' residual
    where the blocks return them (the interval cache; MagCache passes them through as diffusers does).
    `metadata`: the blocks' streams where diffusers' registry has no entry (LTX-2: video and audio, the audio
    in the text tokens' place), else the registry's."""

    def __init__(self, transformer, span, branches: int, cache_text: bool, constrain, metadata=None) -> None:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        register_hunyuanvideo15_block()
        blocks = block_list(transformer)
        self.metadata = metadata or TransformerBlockRegistry.get(type(blocks[0]))
        self.span = span
        self.branches = branches
        self.cache_text = cache_text and self.metadata.return_encoder_hidden_states_index is not None
        self.constrain = constrain
        self.mode = self.entry = None
        self.found = {}
        for index, block in enumerate(blocks):
            block.forward = _BlockForward(self, index, block.forward)

    @contextlib.contextmanager
    def tracing(self, mode: str, state=(None, None), reuse=None):
        self.mode, self.state, self.reuse, self.found = mode, state, reuse, {}
        try:
            yield self.found
        finally:  # no tracer stays on the module: the next program's key describes it (runtime.program_key)
            self.mode = self.state = self.reuse = self.entry = None
            self.found = {}

    def _inputs(self, args, kwargs):
        meta = self.metadata
        hidden = meta._get_parameter_from_args_kwargs(meta.hidden_states_argument_name, args, kwargs)
        if meta.return_encoder_hidden_states_index is None:
            return hidden, None
        return hidden, meta._get_parameter_from_args_kwargs(meta.encoder_hidden_states_argument_name, args, kwargs)

    def _pack(self, hidden, text, output=None):
        meta = self.metadata
        if meta.return_encoder_hidden_states_index is None:
            return hidden
        values = list(output) if output is not None else [None] * 2
        values[meta.return_hidden_states_index] = hidden
        values[meta.return_encoder_hidden_states_index] = text
        return tuple(values)

    def block(self, index: int, forward, args, kwargs):
        first, end = self.span
        if self.mode is None or not first <= index < end:
            return forward(*args, **kwargs)
        hidden, text = self._inputs(args, kwargs)
        if self.mode == "probe":
            raise _Probed([(tuple(t.shape), t.dtype) if t is not None else None for t in (hidden, text)])
        if index == first:
            self.entry = (hidden, text)
        if self.mode == "cached":
            if index == first:
                hidden = hidden + self.state[0]
                text = text + self.state[1] if self.cache_text else text
            return self._pack(hidden, text)
        output = forward(*args, **kwargs)
        if index == end - 1:
            meta = self.metadata
            out_hidden = (
                output if meta.return_encoder_hidden_states_index is None else output[meta.return_hidden_states_index]
            )
            out_text = (
                None
                if meta.return_encoder_hidden_states_index is None
                else output[meta.return_encoder_hidden_states_index]
            )
            hidden, text = self._finish(out_hidden, out_text)
            output = self._pack(hidden, text, output)
        return output

    def _finish(self, out_hidden, out_text):
        """The span's new residuals, the magnitude ratios, and the output with reusing branches replaced."""
        entry_hidden, entry_text = self.entry
        previous_hidden, previous_text = self.state
        residual = self.constrain(out_hidden - entry_hidden, HIDDEN_LAYOUT)
        # MagCache calibration: mean over tokens of |residual| / |previous residual|, per branch
        norms = torch.linalg.norm(residual.float(), dim=-1) / (
            torch.linalg.norm(previous_hidden.float(), dim=-1) + 1e-8
        )
        self.found["ratios"] = norms.reshape(self.branches, -1).mean(-1)
        batch = residual.shape[0]
        reuse = self.reuse.reshape(self.branches, 1).expand(self.branches, batch // self.branches).reshape(batch, 1, 1)
        self.found["hidden"] = torch.where(reuse, previous_hidden, residual)
        hidden = torch.where(reuse, entry_hidden + previous_hidden, out_hidden)
        text = out_text
        if out_text is not None:
            text = torch.where(reuse, entry_text, out_text)  # diffusers' skip returns the text tokens unchanged
        if self.cache_text:
            text_residual = self.constrain(out_text - entry_text, TEXT_LAYOUT)
            self.found["text"] = torch.where(reuse, previous_text, text_residual)
        return hidden, text


class _BlockForward:
    """A block's forward routed through its BlockCache (an object, so the block's state dict is unchanged)."""

    def __init__(self, cache: BlockCache, index: int, forward) -> None:
        self.cache, self.index, self.forward = cache, index, forward

    def __call__(self, *args, **kwargs):
        return self.cache.block(self.index, self.forward, args, kwargs)


class CachedDenoiser(torch.nn.Module):
    """A guided denoiser (the family's module) with a step cache. `forward(hidden_residual, text_residual,
    reuse, *inputs)` is the full step: (noise prediction, (new residuals), per-branch ratios).
    `cached(hidden_residual, text_residual, *inputs)` is the cached step. `probe(*inputs)` only traces up
    to the span (raises _Probed with its input shapes). The guided module is the only child, so
    parameter names are the guided module's under `guided.`."""

    def __init__(self, guided: torch.nn.Module, cache: BlockCache) -> None:
        super().__init__()
        self.guided = guided
        self.cache = cache

    def forward(self, hidden_residual, text_residual, reuse, *inputs):
        with self.cache.tracing("full", (hidden_residual, text_residual), reuse) as found:
            noise = self.guided(*inputs)
        return noise, (found["hidden"], found.get("text")), found["ratios"]

    def cached(self, hidden_residual, text_residual, *inputs):
        with self.cache.tracing("cached", (hidden_residual, text_residual)):
            return self.guided(*inputs)

    def probe(self, *inputs):
        with self.cache.tracing("probe"):
            self.guided(*inputs)
        raise RuntimeError("the cached span's first block was never called")


def cache_span(kind: str, blocks: int) -> tuple[int, int]:
    """The blocks whose residual is cached: all of them (MagCache), or all but the first and the last
    (the interval cache's outer blocks, which every step runs)."""
    if kind == "interval":
        if blocks < 3:
            raise UserError(
                f"--cache interval needs at least 3 transformer blocks (outer, deep, outer); this model has {blocks}"
            )
        return 1, blocks - 1
    return 0, blocks


def settings_kind(settings: CacheSettings) -> str:
    """The cache a run's programs hold: MagCache while calibrating, else the chosen one."""
    return "magcache" if settings.calibrate else settings.kind


def cached_span(settings: CacheSettings, blocks: int) -> tuple[int, int]:
    """The span a run with `settings` caches (tpu_video/engine/scanned_blocks.py scans the same one)."""
    return cache_span(settings_kind(settings), blocks)


def cached_denoiser(guided, settings: CacheSettings, branches: int, constrain) -> CachedDenoiser:
    """Wrap a family's guided denoiser (its transformer is `guided.transformer`; its `block_streams`, where it
    has one, names the blocks' streams for the cache)."""
    kind = settings_kind(settings)
    span = cached_span(settings, len(block_list(guided.transformer)))
    streams = getattr(guided, "block_streams", None)
    cache = BlockCache(guided.transformer, span, branches, kind == "interval", constrain, streams)
    return CachedDenoiser(guided, cache)


def probe_shapes(call) -> list:
    """Run `call` (which traces a CachedDenoiser.probe) and return the span's input shapes."""
    try:
        call()
    except _Probed as found:
        return found.shapes
    raise RuntimeError("the probe did not reach the cached span")
