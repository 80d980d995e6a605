"""Classifier-free guidance as one compiled program: both branches in one batch (on the mesh's `dp` axis)
and the combination, where the diffusers pipelines make two calls or concatenate on the host.

The CFG families' `GuidedTransformer` subclasses `Guided`, names its pipeline's batch order (`CFG_ORDER`:
CogVideoX batches [uncond, cond]; HunyuanVideo-1.5 and Wan run [cond, uncond]) and says how to call its
transformer and how its pipeline combines the two predictions. The family's denoise loop concatenates the
stage-1 embeddings in the same order. LTX-2, with up to four guidance passes over two streams, has a guided
module of its own (tpu_video/models/ltx2/transformer.py) on the same `BATCH` layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sharding import DP

BATCH = (DP,)  # the CFG batch on dp


def cfg_combination(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale) -> torch.Tensor:
    """The pipelines' guidance expression: uncond + scale * (cond - uncond)."""
    return uncond + guidance_scale * (cond - uncond)


class Guided(torch.nn.Module):
    """The shared half of a family's guided transformer: doubling the input, its layout, splitting the output."""

    CFG_ORDER: tuple[str, str]  # the family pipeline's batch order of the two branches

    def __init__(self, transformer: torch.nn.Module, do_cfg: bool, constrain=None) -> None:
        super().__init__()
        self.transformer = transformer
        self.do_cfg = do_cfg
        self.constrain = constrain or (lambda tensor, spec: tensor)

    def guided(
        self,
        model_input: torch.Tensor,
        predict: Callable[[torch.Tensor], torch.Tensor],
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`predict` on the input (doubled under CFG, batch on dp), then `combine(cond, uncond)` under CFG."""
        if self.do_cfg:
            model_input = torch.cat([model_input] * 2)
        noise_pred = predict(self.constrain(model_input, BATCH))
        if not self.do_cfg:
            return noise_pred
        branches = dict(zip(self.CFG_ORDER, noise_pred.chunk(2), strict=True))
        return combine(branches["cond"], branches["uncond"])
