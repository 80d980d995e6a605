"""The collective counts the README states, read from compiled HLO at real widths (benchmarks/collectives.py).

Counts are exact integers from the partitioner, not timings: a rule-table or patch change that adds a
weight gather or an extra all-reduce fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import sharding
from sharding import MeshShape

spec = importlib.util.spec_from_file_location(
    "collectives", Path(__file__).resolve().parents[1] / "benchmarks" / "collectives.py"
)
collectives = importlib.util.module_from_spec(spec)
spec.loader.exec_module(collectives)


@pytest.mark.parametrize(
    "model, tensors",
    [
        ("cogvideox1.5-5b", 4),  # after attention, after the MLP, 2 AdaLN modulations
        ("hunyuanvideo1.5", 6),  # the same for the image and the text stream, 2 modulations
    ],
)
def test_transformer_block_has_the_megatron_minimum(model, tensors):
    mesh = sharding.make_mesh(MeshShape(2, 1, 4))
    found = collectives.measure(model, "megatron", mesh, video_tokens=256, attention="xla")
    assert found["collectives_per_block"].keys() == {"all-reduce"}  # no weight gathers, no resharding
    assert found["collectives_per_block"]["all-reduce"]["tensors"] == tensors


@pytest.mark.parametrize("model, per_layer", [("t5-xxl", 2), ("qwen2.5-vl-7b", 1)])
def test_text_encoder_layer_collectives(model, per_layer):
    found = collectives.measure_text_encoder(model, sharding.make_mesh(MeshShape(tp=8)))
    assert found["collectives_per_layer"].keys() == {"all-reduce"}
    assert found["collectives_per_layer"]["all-reduce"]["tensors"] == per_layer
    assert found["collectives_outside_layers"] == {}
