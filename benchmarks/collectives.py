"""Collectives per transformer block at real widths, read from the compiled HLO on an 8-device mesh.

Builds CogVideoX1.5-5B's and HunyuanVideo-1.5's transformers from their published configs on the meta
device (no weights, no download), compiles one block with abstract (shape-only) weights and inputs,
placed by sharding.py's rule tables, and counts the collectives XLA inserted. Prints one JSON line per
(model, tp_mode).

Stage 1's text encoders (T5-XXL v1.1 at 226 tokens, the Qwen2.5-VL-7B text model at 1108) are measured
on stage 1's mesh (every device on `tp`): the whole encoder compiled at 1 and at 2 layers, so the
difference is one layer's cost and the rest is the embedding and final norm.

    python benchmarks/collectives.py                      # 8 virtual CPU devices, mesh dp=2 sp=1 tp=4
    python benchmarks/collectives.py --dp 1 --tp 8 --video_tokens 8192
    python benchmarks/collectives.py --models t5-xxl qwen2.5-vl-7b

Bytes scale linearly with --video_tokens; counts do not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sharding  # noqa: E402
from models.cogvideox import COGVIDEOX15_5B_TRANSFORMER, T5_XXL_ENCODER, make_jit_safe  # noqa: E402
from models.hunyuanvideo15 import QWEN25_VL_7B_TEXT  # noqa: E402
from splash_attention import SplashConfig, attention_backend  # noqa: E402
from torchax_compat import import_torchax  # noqa: E402

torchax = import_torchax()
from torchax import interop  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Ops, tensors (a combined op moves several) and result bytes per device of each collective in
    compiled HLO text (async starts counted once)."""
    found = {name: {"count": 0, "tensors": 0, "bytes": 0} for name in COLLECTIVES}
    for match in _OP.finditer(hlo_text):
        shapes, name = match.groups()
        found[name]["count"] += 1
        for dtype, dims in _SHAPE.findall(shapes):
            found[name]["tensors"] += 1
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            found[name]["bytes"] += size * DTYPE_BYTES.get(dtype, 4)
    return found


def cogvideox15_5b():
    from diffusers import CogVideoXTransformer3DModel

    with torch.device("meta"):
        model = CogVideoXTransformer3DModel(**{**COGVIDEOX15_5B_TRANSFORMER, "num_layers": 1})
    return make_jit_safe(model)


def hunyuanvideo15():
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        return HunyuanVideo15Transformer3DModel(num_layers=1, num_refiner_layers=1, task_type="t2v")


def block_inputs(model_name: str, model, video_tokens: int, batch: int, make):
    """The block's positional inputs, each `make(shape, dtype, spec)`."""
    width = model.config.num_attention_heads * model.config.attention_head_dim
    head_dim = model.config.attention_head_dim
    f32 = jax.numpy.float32
    if model_name == "cogvideox1.5-5b":
        text = model.config.max_text_seq_length
        return [
            make((batch, video_tokens, width), f32, P("dp", "sp", None)),  # hidden_states
            make((batch, text, width), f32, P("dp", None, None)),  # encoder_hidden_states
            make((batch, model.config.time_embed_dim), f32, P("dp", None)),  # temb
            (make((video_tokens, head_dim), f32, P()), make((video_tokens, head_dim), f32, P())),  # rotary cos, sin
        ]
    text = 1000 + 256 + 729  # Qwen tokens + ByT5 tokens + image tokens, after the reorder
    return [
        make((batch, video_tokens, width), f32, P("dp", "sp", None)),
        make((batch, text, width), f32, P("dp", None, None)),
        make((batch, width), f32, P("dp", None)),
        make((batch, text), jax.numpy.bool_, P("dp", None)),  # encoder attention mask
        (make((video_tokens, head_dim), f32, P()), make((video_tokens, head_dim), f32, P())),
    ]


def measure(model_name: str, tp_mode: str, mesh, video_tokens: int, attention: str) -> dict[str, object]:
    model = cogvideox15_5b() if model_name == "cogvideox1.5-5b" else hunyuanvideo15()
    table = (
        sharding.cogvideox_transformer_rules(tp_mode)
        if model_name == "cogvideox1.5-5b"
        else sharding.hunyuanvideo15_transformer_rules(tp_mode)
    )
    params = dict(model.named_parameters())
    specs = table.assign(list(params))
    prefix = "transformer_blocks.0."
    block = model.transformer_blocks[0]
    block_specs = {name[len(prefix) :]: spec for name, spec in specs.items() if name.startswith(prefix)}

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding.fit_spec(spec, shape, mesh)))

    f32 = jax.numpy.float32
    weights = {name: abstract(tuple(params[prefix + name].shape), f32, spec) for name, spec in block_specs.items()}
    inputs = block_inputs(model_name, model, video_tokens, batch=2, make=abstract)
    outputs = NamedSharding(mesh, P("dp", "sp", None)), NamedSharding(mesh, P("dp", None, None))

    def run_block(weights, *inputs):
        return torch.func.functional_call(block, weights, tuple(inputs))

    jitted = jax.jit(interop.jax_view(run_block), out_shardings=outputs)
    env = torchax.default_env()
    splash = SplashConfig(interpret=jax.devices()[0].platform != "tpu")
    with env, attention_backend(env, attention, splash, mesh):
        hlo = jitted.lower(weights, *inputs).compile().as_text()
    weight_bytes = sum(
        int(np.prod(w.sharding.shard_shape(w.shape))) * w.dtype.itemsize for w in jax.tree.leaves(weights)
    )
    return {
        "model": model_name,
        "tp_mode": tp_mode,
        "mesh": dict(mesh.shape),
        "attention": attention,
        "video_tokens": video_tokens,
        "collectives_per_block": {k: v for k, v in count_collectives(hlo).items() if v["count"]},
        "block_weight_bytes_per_device": weight_bytes,
    }


TEXT_ENCODERS = {
    # name: (transformers config class, published config, tokens the pipeline feeds it)
    "t5-xxl": ("T5Config", T5_XXL_ENCODER, 226),
    "qwen2.5-vl-7b": ("Qwen2_5_VLTextConfig", QWEN25_VL_7B_TEXT, 1000 + 108),  # prompt + chat-template crop
}


def text_encoder_collectives(model_name: str, layers: int, mesh) -> tuple[dict, int, str]:
    """Collectives and weight bytes per device of the whole encoder at `layers` layers, bf16."""
    import transformers

    config_class, config, tokens = TEXT_ENCODERS[model_name]
    layer_key = "num_layers" if config_class == "T5Config" else "num_hidden_layers"
    config = getattr(transformers, config_class)(**{**config, layer_key: layers})
    model_class = transformers.T5EncoderModel if config_class == "T5Config" else transformers.Qwen2_5_VLTextModel
    with torch.device("meta"):
        model = model_class(config).eval()
    table = sharding.text_encoder_rules(config, mesh.shape["tp"])
    params = dict(model.named_parameters())
    specs = table.assign(list(params))

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding.fit_spec(spec, shape, mesh)))

    bf16, i32 = jax.numpy.bfloat16, jax.numpy.int32
    weights = {name: abstract(tuple(params[name].shape), bf16, spec) for name, spec in specs.items()}
    buffers = {name: abstract(tuple(b.shape), jax.numpy.float32, P()) for name, b in model.named_buffers()}
    input_ids, mask = abstract((1, tokens), i32, P()), abstract((1, tokens), i32, P())

    def run(weights, buffers, input_ids, mask):
        state = {**weights, **buffers}
        return torch.func.functional_call(model, state, (), {"input_ids": input_ids, "attention_mask": mask})[0]

    jitted = jax.jit(interop.jax_view(run), out_shardings=NamedSharding(mesh, P()))
    with torchax.default_env():
        hlo = jitted.lower(weights, buffers, input_ids, mask).compile().as_text()
    weight_bytes = sum(int(np.prod(w.sharding.shard_shape(w.shape))) * w.dtype.itemsize for w in weights.values())
    return count_collectives(hlo), weight_bytes, table.name


def measure_text_encoder(model_name: str, mesh) -> dict[str, object]:
    one, one_bytes, table = text_encoder_collectives(model_name, 1, mesh)
    two, two_bytes, _ = text_encoder_collectives(model_name, 2, mesh)
    per_layer = {name: {key: two[name][key] - one[name][key] for key in one[name]} for name in COLLECTIVES}
    outside = {name: {key: one[name][key] - per_layer[name][key] for key in one[name]} for name in COLLECTIVES}
    return {
        "model": model_name,
        "rule_table": table,
        "mesh": dict(mesh.shape),
        "tokens": TEXT_ENCODERS[model_name][2],
        "collectives_per_layer": {k: v for k, v in per_layer.items() if v["count"]},
        "collectives_outside_layers": {k: v for k, v in outside.items() if v["count"]},
        "layer_weight_bytes_per_device": two_bytes - one_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--video_tokens", type=int, default=4096, help="image-stream tokens (default: %(default)s)")
    parser.add_argument("--attention", choices=("xla", "splash"), default="xla")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["cogvideox1.5-5b", "hunyuanvideo1.5", *TEXT_ENCODERS],
        default=["cogvideox1.5-5b", "hunyuanvideo1.5", *TEXT_ENCODERS],
    )
    args = parser.parse_args()
    mesh = sharding.make_mesh(sharding.MeshShape(args.dp, args.sp, args.tp))
    for model_name in args.models:
        if model_name in TEXT_ENCODERS:  # stage 1's mesh: every device on tp
            stage1_mesh = sharding.make_mesh(sharding.MeshShape(tp=jax.device_count()))
            print(json.dumps(measure_text_encoder(model_name, stage1_mesh)), flush=True)
            continue
        for tp_mode in sharding.TP_MODES:
            print(json.dumps(measure(model_name, tp_mode, mesh, args.video_tokens, args.attention)), flush=True)


if __name__ == "__main__":
    main()
