"""The collective counts docs/sharding.md states, read from compiled HLO at real widths (tpu_video/planning/hlo.py).

Counts are exact integers from the partitioner, not timings: a rule-table or patch change that adds a
weight gather or an extra all-reduce fails here. The blocks carry the attention processors stage 2
installs (`make_jit_safe`), so the counts describe what stage 2 runs.
"""

from __future__ import annotations

import pytest

from sharding import MeshShape
from tpu_video.models import hunyuanvideo15
from tpu_video.planning import hlo
from tpu_video.runtime import placement

# One all-reduce op of two f32 tensors and one all-gather, as XLA:CPU prints them after the partitioner.
HLO_SAMPLE = """
  %all-reduce.1 = (f32[2,128]{1,0}, f32[4]{0}) all-reduce(f32[2,128]{1,0} %a, f32[4]{0} %b), replica_groups={}
  %all-gather-start.2 = bf16[8,64]{1,0} all-gather-start(bf16[2,64]{1,0} %c), dimensions={0}
  %all-gather-done.2 = bf16[8,64]{1,0} all-gather-done(bf16[8,64]{1,0} %all-gather-start.2)
  %add.3 = f32[4]{0} add(f32[4]{0} %d, f32[4]{0} %e)
"""


def test_count_collectives_reads_ops_tensors_and_bytes():
    found = hlo.count_collectives(HLO_SAMPLE)
    assert found["all-reduce"] == {"count": 1, "tensors": 2, "bytes": (2 * 128 + 4) * 4}
    assert found["all-gather"] == {"count": 1, "tensors": 1, "bytes": 8 * 64 * 2}  # start counted, done not
    assert found["all-to-all"]["count"] == found["collective-permute"]["count"] == 0


@pytest.mark.parametrize(
    "family, model, tensors",
    [
        ("cogvideox", "cogvideox1.5-5b", 4),  # after attention, after the MLP, 2 AdaLN modulations
        ("hunyuanvideo15", "hunyuanvideo1.5", 6),  # the same for the image and the text stream, 2 modulations
        # after self-attention, cross-attention and the MLP; 4 small sums for the q/k RMS norms, which span
        # all heads; modulation is local (the shared time_proj's all-reduce is once per step, outside)
        ("wan", "wan2.1-14b", 7),
    ],
)
def test_transformer_block_has_the_megatron_minimum(family, model, tensors):
    mesh = placement.make_mesh(MeshShape(2, 1, 4))
    found = hlo.measure(family, "megatron", mesh, video_tokens=256, attention="xla")
    assert found["model"] == model
    assert found["collectives_per_block"].keys() == {"all-reduce"}  # no weight gathers, no resharding
    assert found["collectives_per_block"]["all-reduce"]["tensors"] == tensors


def test_the_families_with_a_published_block():
    """What benchmarks/collectives.py offers beside the text encoders; LTX-2 writes none (its --plan counts the
    blocks)."""
    assert hlo.measured_families() == ("cogvideox", "hunyuanvideo15", "wan")


def test_the_measured_hunyuanvideo15_block_runs_the_key_mask_processor():
    """What the block counts describe: the per-key-mask processor stage 2 installs, not the stock one."""
    block = hunyuanvideo15.published_block(16, 1, lambda shape, dtype, layout: None).model.transformer_blocks[0]
    assert type(block.attn.processor).__name__ == "KeyMaskHunyuanVideo15AttnProcessor"


@pytest.mark.parametrize("model, per_layer", [("t5-xxl", 2), ("qwen2.5-vl-7b", 1)])
def test_text_encoder_layer_collectives(model, per_layer):
    found = hlo.measure_text_encoder(model, placement.make_mesh(MeshShape(tp=8)))
    assert found["collectives_per_layer"].keys() == {"all-reduce"}
    assert found["collectives_per_layer"]["all-reduce"]["tensors"] == per_layer
    assert found["collectives_outside_layers"] == {}


def test_wan_block_moves_three_activations_and_four_norm_statistics():
    """The 7 Wan tensors: 3 of (batch, tokens, width) and 4 of (batch, tokens or text tokens, 1)."""
    mesh = placement.make_mesh(MeshShape(2, 1, 4))
    found = hlo.measure("wan", "megatron", mesh, video_tokens=256, attention="xla")
    width, text = 5120, 512
    activations = 3 * 256 * width * 4  # per device: one sample (dp=2), f32
    statistics = (2 * 256 + 256 + text) * 4  # q and k of self-attention, q and k of cross-attention
    assert found["collectives_per_block"]["all-reduce"]["bytes"] == activations + statistics


@pytest.mark.parametrize("sp_mode", ["auto", "ring", "gather"])
def test_wan_block_under_ulysses_has_exactly_its_all_to_alls(sp_mode):
    """sp=8 at real width (40 heads, tp=1). Ulysses: 8 all-to-alls per block, q, k and v in and the
    output back for self- and for cross-attention, and nothing else (no K/V gather, no all-reduce with
    tp=1). Ring: 21 permutes, keys, values and their validity passed on 7 times in self-attention (the
    512 text keys of cross-attention are whole on every device already). The gather scheme instead
    all-gathers the self-attention keys and values (2 all-gathers)."""
    mesh = placement.make_mesh(MeshShape(1, 8, 1))
    found = hlo.measure("wan", "megatron", mesh, video_tokens=256, attention="xla", sp_mode=sp_mode)
    counts = {op: value["count"] for op, value in found["collectives_per_block"].items()}
    if sp_mode == "auto":
        assert found["sp_mode"] == "ulysses" and counts == {"all-to-all": 8}
    elif sp_mode == "ring":
        assert found["sp_mode"] == "ring" and counts == {"collective-permute": 3 * (8 - 1)}
    else:
        assert found["sp_mode"] == "gather" and counts == {"all-gather": 2}


def test_cogvideox_block_under_ulysses_gathers_no_keys():
    """CogVideoX at sp=8: Ulysses drops the K/V all-gathers (one small one is left); the joint
    text+video sequence is still re-split around attention (all-to-alls and permutes beyond Ulysses' 4)."""
    mesh = placement.make_mesh(MeshShape(1, 8, 1))
    found = hlo.measure("cogvideox", "megatron", mesh, video_tokens=4096, attention="xla")
    gathers = found["collectives_per_block"]["all-gather"]
    assert found["sp_mode"] == "ulysses" and gathers["count"] == 1
    assert gathers["bytes"] < 4096 * 3072 * 4 / 8  # hundreds of tokens (5.4 MiB), not the video's K/V
