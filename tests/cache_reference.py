"""The references the step caches are compared with (tpu_video/engine/step_cache.py): diffusers' MagCache hooks
on an eager pipeline's transformer, and the interval cache written from its definition as hooks on the
pipeline's blocks."""

from __future__ import annotations

import copy
import itertools

from tpu_video.engine import cached_blocks


def mag_config(ratios, steps: int, **settings):
    from diffusers.hooks import MagCacheConfig

    return MagCacheConfig(num_inference_steps=steps, mag_ratios=list(ratios), **settings)


def computed_calls(transformer) -> list[bool]:
    """Record, per call of `transformer`, whether its last block really ran (diffusers' skips do not)."""
    calls = []
    transformer.register_forward_pre_hook(lambda module, args: calls.append(False))
    blocks = cached_blocks.block_list(transformer)

    def ran(module, args):
        calls[-1] = True

    blocks[-1].norm1.register_forward_pre_hook(ran)
    return calls


def per_context_configs(transformer, configs: dict) -> None:
    """Give each diffusers cache context of `transformer` its own MagCacheConfig (diffusers shares one)."""

    class ByContext:
        def __init__(self, manager) -> None:
            self.manager = manager

        def __getattr__(self, key):
            return getattr(configs[self.manager.context.name], key)

    transformer.enable_cache(next(iter(configs.values())))
    for block in cached_blocks.block_list(transformer):
        for hook in block._diffusers_hook.hooks.values():
            if hasattr(hook, "state_manager"):
                hook.config = ByContext(hook.state_manager)


def in_contexts(transformer, names=("cond", "uncond")) -> None:
    """Run the calls of `transformer` in the cache contexts `names` in turn, as WanPipeline names its cond and
    uncond calls (WanVideoToVideoPipeline names none, so its two calls would share one cache state)."""
    forward, calls = transformer.forward, itertools.count()

    def named(*args, **kwargs):
        with transformer.cache_context(names[next(calls) % len(names)]):
            return forward(*args, **kwargs)

    transformer.forward = named


def register_block_as(block_class, registered_class, monkeypatch) -> None:
    """Give `block_class` the block-registry entry of `registered_class` for one test (Wan Animate's copy of Wan's
    block, which diffusers' registry leaves out, as its guided module's `block_streams` does for our cache)."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    entry = copy.copy(TransformerBlockRegistry.get(registered_class))
    entry._cls = block_class
    monkeypatch.setitem(TransformerBlockRegistry._registry, block_class, entry)


class IntervalReference:
    """The interval cache from its definition, as hooks on an eager transformer's blocks: every call runs the
    first and last block; on reusing steps the deep blocks' output is their input plus the residuals (video
    tokens, and text tokens where the blocks return them: `text`) from the last step that ran them. Step i is
    the i-th call that runs block 0, counted again from 0 after `steps` (each of Wan Animate's segments)."""

    def __init__(self, transformer, start: int, end: int, interval: int, steps: int, text: bool = True) -> None:
        self.blocks = cached_blocks.block_list(transformer)
        self.start, self.end, self.interval, self.steps, self.text = start, end, interval, steps, text
        self.step, self.residual = -1, None
        for index, block in enumerate(self.blocks):
            block.forward = self.wrap(index, block.forward)

    def pair(self, hidden, text):
        return (hidden, text) if self.text else hidden

    def wrap(self, index, forward):
        def call(hidden_states, encoder_hidden_states, *args, **kwargs):
            last = len(self.blocks) - 1
            if index == 0:
                self.step += 1
            i = self.step % self.steps
            full = i < self.start or i >= self.end or (i - self.start) % self.interval == 0
            if index in (0, last):
                return forward(hidden_states, encoder_hidden_states, *args, **kwargs)
            if not full:
                if index == 1:
                    text = encoder_hidden_states + self.residual[1] if self.text else None
                    return self.pair(hidden_states + self.residual[0], text)
                return self.pair(hidden_states, encoder_hidden_states)
            if index == 1:
                self.entry = (hidden_states, encoder_hidden_states)
            out = forward(hidden_states, encoder_hidden_states, *args, **kwargs)
            if index == last - 1:
                hidden, text = out if self.text else (out, None)
                self.residual = (hidden - self.entry[0], text - self.entry[1] if self.text else None)
            return out

        return call
