"""Stage 1's `--backend torchax`: the T5, Qwen2.5-VL and Gemma 3 rule tables, sharded encoders against eager
PyTorch, and the CLI against `--backend torch` (image encoders and single-image VAE encodes included).

Tolerance: 1e-5 relative in fp32. Sharding only changes the reduction order of the row-parallel sums.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import sharding
import stage1_text_encoder
from helpers import relative_error, run_stage, write_image
from sharding import COLUMN, COLUMN_BIAS, REPLICATED, ROW, MeshShape
from tpu_video.engine.encoders import DeviceTextEncoder
from tpu_video.models.cogvideox.published import T5_XXL_ENCODER
from tpu_video.models.hunyuanvideo15.published import QWEN25_VL_7B_TEXT
from tpu_video.runtime import placement
from tpu_video.runtime.torchax_runtime import TorchaxRuntime
from utils import read_config

TOLERANCE = 1e-5


def t5_encoder(device: str = "cpu", **config):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    with torch.device(device):
        return T5EncoderModel(T5Config(**config)).eval()


def qwen_text_encoder(device: str = "cpu", **config):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config)).eval()


TINY_T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu")
TINY_QWEN = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
)


# Rule tables ---------------------------------------------------------------------------------------


def expected_t5_spec(name: str, split_attention: bool):
    """The intended layout, written independently of the regex table."""
    attention = ".SelfAttention." in name
    if attention and not split_attention:
        return REPLICATED
    if name.endswith((".q.weight", ".k.weight", ".v.weight", ".wi.weight", ".wi_0.weight", ".wi_1.weight")):
        return COLUMN
    if name.endswith((".o.weight", ".wo.weight")):
        return ROW
    if name.endswith("relative_attention_bias.weight"):
        return (None, "tp")
    return REPLICATED


def expected_qwen_spec(name: str, split_attention: bool):
    if ".self_attn." in name and not split_attention:
        return REPLICATED
    if any(f".{part}_proj." in name for part in ("q", "k", "v", "gate", "up")):
        return COLUMN if name.endswith("weight") else COLUMN_BIAS
    if ".o_proj." in name or ".down_proj." in name:
        return ROW
    return REPLICATED


# (model, tp) -> whether attention is split: tp must divide every head count.
T5_SPLITS = {("tiny", 1): True, ("tiny", 4): True, ("tiny", 8): False, ("tiny", 3): False}
T5_SPLITS |= {("t5-v1.1-xxl", 4): True, ("t5-v1.1-xxl", 8): True, ("t5-v1.1-xxl", 3): False}
T5_SPLITS |= {("t5-original-relu", 2): True, ("t5-original-relu", 8): False}
QWEN_SPLITS = {("tiny", 1): True, ("tiny", 2): True, ("tiny", 4): False, ("tiny", 8): False}
QWEN_SPLITS |= {("qwen2.5-vl-7b", 2): True, ("qwen2.5-vl-7b", 4): True, ("qwen2.5-vl-7b", 8): False}


@pytest.mark.parametrize("model, tp", list(T5_SPLITS))
def test_t5_rule_table_matches_every_parameter_as_intended(model, tp):
    config = {
        "tiny": TINY_T5,
        "t5-v1.1-xxl": T5_XXL_ENCODER,
        "t5-original-relu": {**TINY_T5, "feed_forward_proj": "relu"},
    }
    split = T5_SPLITS[model, tp]
    encoder = t5_encoder("meta", **config[model])
    table = sharding.text_encoder_rules(encoder.config, tp)
    names = [name for name, _ in encoder.named_parameters(remove_duplicate=False)]
    assert "encoder.embed_tokens.weight" in names  # tied to `shared`, matched too
    specs = table.assign(names)
    assert specs == {name: expected_t5_spec(name, split) for name in names}
    per_layer = (7 if split else 3) if encoder.config.is_gated_act else (6 if split else 2)
    assert sum(spec != REPLICATED for spec in specs.values()) == per_layer * encoder.config.num_layers + split


@pytest.mark.parametrize("model, tp", list(QWEN_SPLITS))
def test_qwen_rule_table_matches_every_parameter_as_intended(model, tp):
    encoder = qwen_text_encoder("meta", **(TINY_QWEN if model == "tiny" else QWEN25_VL_7B_TEXT))
    split = QWEN_SPLITS[model, tp]
    names = [name for name, _ in encoder.named_parameters()]
    specs = sharding.text_encoder_rules(encoder.config, tp).assign(names)
    assert specs == {name: expected_qwen_spec(name, split) for name in names}
    per_layer = 10 if split else 3  # q/k/v weights+biases, o, gate, up, down
    assert sum(spec != REPLICATED for spec in specs.values()) == per_layer * encoder.config.num_hidden_layers


@pytest.mark.parametrize("tp, split", [(8, True), (16, False)])
def test_gemma3_12b_rule_table_matches_every_parameter_as_intended(tp, split):
    """LTX-2's prompt encoder at its published size (16 query, 8 key/value heads): tp 16 replicates attention."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from tpu_video.models.ltx2.published import GEMMA3_12B

    with torch.device("meta"):
        encoder = Gemma3TextModel(Gemma3TextConfig(**GEMMA3_12B["text_config"]))
    names = [name for name, _ in encoder.named_parameters()]
    specs = sharding.text_encoder_rules(encoder.config, tp).assign(names)
    attention = {"q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "o_proj": ROW}
    mlp = {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW}
    for name, spec in specs.items():
        kind = name.split(".")[-2]
        wanted = (attention[kind] if split else REPLICATED) if kind in attention else mlp.get(kind, REPLICATED)
        assert spec == wanted, name
    per_layer = 7 if split else 3
    assert sum(spec != REPLICATED for spec in specs.values()) == per_layer * 48


def expected_connector_spec(name: str, split_attention: bool):
    """The intended layout of an LTX2TextConnectors parameter, written independently of the regex table."""
    weight = name.endswith(".weight")
    if "text_proj_in." in name:
        return ROW if weight else REPLICATED
    if ".attn1." in name:
        if not split_attention:
            return REPLICATED
        if ".to_out." in name:
            return ROW if weight else REPLICATED
        return COLUMN if weight and ".norm_" not in name else COLUMN_BIAS  # q/k/v, gates; the q/k norms
    if ".ff.net.0." in name:
        return COLUMN if weight else COLUMN_BIAS
    if ".ff.net.2." in name:
        return ROW if weight else REPLICATED
    return REPLICATED  # the learnable registers


@pytest.mark.parametrize("version, tp", [("2.0", 8), ("2.3", 8), ("2.3", 64)])
def test_ltx2_connector_rule_table_matches_every_parameter_as_intended(version, tp):
    """LTX-2's text connectors at their published sizes: LTX-2.0's 30 heads per connector keep attention
    replicated at tp 8; LTX-2.3's 32 split it at 8, not at 64. The projections (row-parallel) and the MLPs
    split either way."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from tpu_video.models.ltx2.connectors import connector_rules
    from tpu_video.models.ltx2.published import LTX2_CONNECTORS, LTX23_CONNECTORS

    config = LTX2_CONNECTORS if version == "2.0" else LTX23_CONNECTORS
    with torch.device("meta"):
        connectors = LTX2TextConnectors(**config)
    split = connectors.config.video_connector_num_attention_heads % tp == 0
    names = [name for name, _ in connectors.named_parameters()]
    table = connector_rules(connectors.config, tp)
    assert table.name == f"ltx2-connectors/{'megatron' if split else 'megatron-mlp'}"
    specs = table.assign(names)
    assert specs == {name: expected_connector_spec(name, split) for name in names}
    split_count = sum(p.numel() for name, p in connectors.named_parameters() if specs[name] != REPLICATED)
    share = split_count / sum(p.numel() for p in connectors.parameters())
    assert share > (0.95 if split else 0.75)  # unsplit attention replicated: 83% (2.0, tp 8), 79% (2.3, tp 64)


def test_unknown_text_encoder_is_a_value_error_in_the_library_and_a_user_error_in_stage_1():
    from transformers import CLIPTextConfig

    from tpu_video.cli import UserError
    from tpu_video.engine.encoders import text_encoder_rules

    with pytest.raises(ValueError, match="no sharding rules for a 'clip_text_model' text encoder"):
        sharding.text_encoder_rules(CLIPTextConfig(), 8)
    with pytest.raises(UserError, match="'clip_text_model' text encoder; run stage 1 with --backend torch"):
        text_encoder_rules(CLIPTextConfig())({"dp": 1, "sp": 1, "tp": 8})


# Sharded encoders vs eager -------------------------------------------------------------------------


def encode_sharded(encoder, tp: int, input_ids, attention_mask, hidden_states: bool):
    """The encoder's output through a DeviceTextEncoder on a (1, 1, tp) mesh (this places `encoder`'s
    weights on the mesh in place), and the placement record."""
    runtime = TorchaxRuntime(placement.make_mesh(MeshShape(tp=tp)))
    device_encoder = DeviceTextEncoder(encoder, runtime, hidden_states)
    output = device_encoder(input_ids, attention_mask, output_hidden_states=hidden_states)
    return output, runtime.placements[-1]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "float-mask"])
def test_sharded_t5_equals_eager(tp, masked):
    encoder = t5_encoder(**TINY_T5)
    input_ids = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(24) < 17).float()[None] if masked else None  # ByT5 passes its mask as floats
    with torch.no_grad():
        expected = encoder(input_ids, attention_mask=mask).last_hidden_state
    output, placement = encode_sharded(encoder, tp, input_ids, mask, False)
    assert relative_error(output[0], expected) <= TOLERANCE
    q_weight = encoder.encoder.block[0].layer[0].SelfAttention.q.weight  # now on the mesh
    assert q_weight.jax().addressable_shards[0].data.shape == (32 // tp if tp <= 4 else 32, 32)  # 4 heads
    assert placement["rule_table"] == ("t5-encoder/megatron" if tp <= 4 else "t5-encoder/megatron-mlp")


@pytest.mark.parametrize("tp", [2, 8])
def test_sharded_qwen_hidden_states_equal_eager(tp):
    encoder = qwen_text_encoder(**TINY_QWEN)
    input_ids = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(40) < 29).long()[None]  # right padding, as the pipeline's chat template pads
    with torch.no_grad():
        expected = encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    output, placement = encode_sharded(encoder, tp, input_ids, mask, True)
    assert placement["rule_table"] == ("qwen2.5-vl-text/megatron" if tp == 2 else "qwen2.5-vl-text/megatron-mlp")
    assert len(output.hidden_states) == len(expected.hidden_states) == 4
    assert relative_error(output[0], expected.last_hidden_state) <= TOLERANCE
    for got, want in zip(output.hidden_states, expected.hidden_states, strict=True):
        assert relative_error(got, want) <= TOLERANCE


# Stage 1 CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, prompt",
    [
        ("tiny-cogvideox", "a red cat"),
        ("tiny-hunyuanvideo15", 'a shop sign that says "OPEN"'),
        ("tiny-wan2.1", "a red cat"),  # Wan's pipeline asked the encoder's weights for their device ('jax')
        ("tiny-ltx2", "a red cat"),  # Gemma 3's every hidden state, then the connectors (registers, float64 RoPE)
        ("tiny-ltx2.3", "a red cat"),  # the connectors' per-stream projections and gated attention
    ],
)
def test_stage1_torchax_backend_equals_torch_backend(tmp_path, model, prompt):
    outputs = {}
    for backend in ("torch", "torchax"):
        out = tmp_path / backend
        argv = ["--model", model, "--prompt", prompt, "--dtype", "fp32", "--output_dir", out, "--backend", backend]
        run_stage(stage1_text_encoder, argv)
        outputs[backend] = (
            load_file(out / "stage1_embeddings.safetensors"),
            json.loads((out / "generation_config.json").read_text()),
        )
    (torch_tensors, torch_config), (jax_tensors, jax_config) = outputs["torch"], outputs["torchax"]
    assert jax_tensors.keys() == torch_tensors.keys()
    for name, expected in torch_tensors.items():
        if expected.abs().max() == 0:  # ByT5 embeddings of a prompt with no quoted text, and empty masks
            assert torch.equal(jax_tensors[name], expected), name
        else:
            assert relative_error(jax_tensors[name], expected) <= TOLERANCE, name
    stage1 = jax_config["stage1"]
    assert stage1["backend"] == "torchax" and stage1["mesh"] == {"dp": 1, "sp": 1, "tp": 8}
    expected_tables = {
        "tiny-cogvideox": ["t5-encoder"],
        "tiny-hunyuanvideo15": ["qwen2.5-vl-text", "t5-encoder"],
        "tiny-wan2.1": ["t5-encoder"],
        "tiny-ltx2": ["gemma3-text", "ltx2-connectors"],  # 2 heads per connector: only the MLPs split at tp 8
        "tiny-ltx2.3": ["gemma3-text", "ltx2-connectors"],  # 8 heads: attention split too
    }
    assert [p["rule_table"].split("/")[0] for p in stage1["placement"]] == expected_tables[model]
    assert torch_config["stage1"]["backend"] == "torch" and torch_config["stage1"]["device"] == "cpu"


@pytest.mark.parametrize(
    "model, on_devices",
    [
        ("tiny-cogvideox-i2v", 1),  # the VAE encode of the image
        ("tiny-hunyuanvideo15-i2v", 2),  # SigLIP and the VAE encode
        ("tiny-wan2.1-i2v", 2),  # CLIP; the condition video's VAE encode, 4 frames per call
        ("tiny-wan2.2-ti2v", 1),  # the Wan 2.2 VAE encode of the image
    ],
)
def test_stage1_image_encoders_on_the_devices_equal_the_torch_backend(tmp_path, model, on_devices):
    image = write_image(tmp_path / "image.png", 40, 60, seed=2)
    outputs = {}
    for backend in ("torch", "torchax"):
        out = tmp_path / backend
        argv = ["--model", model, "--prompt", "a red cat", "--dtype", "fp32", "--image", image, "--backend", backend]
        run_stage(stage1_text_encoder, [*argv, "--output_dir", out])
        outputs[backend] = (load_file(out / "stage1_embeddings.safetensors"), read_config(out))
    (torch_tensors, _), (jax_tensors, jax_config) = outputs["torch"], outputs["torchax"]
    assert jax_tensors.keys() == torch_tensors.keys()
    for name, expected in torch_tensors.items():
        if expected.abs().max() == 0:
            assert torch.equal(jax_tensors[name], expected), name
        else:
            assert relative_error(jax_tensors[name], expected) <= TOLERANCE, name
    tables = [p["rule_table"] for p in jax_config["stage1"]["placement"]]
    assert tables.count("replicated") == on_devices, tables


@pytest.mark.parametrize(
    "family, component, parameters, table_name",
    [
        ("cogvideox", "text_encoder", 4_762_310_656, "t5-encoder/megatron"),  # T5 v1.1 XXL's encoder
        ("wan", "text_encoder", 5_680_910_336, "t5-encoder/megatron"),  # UMT5-XXL's (256,384 tokens)
        ("hunyuanvideo15", "text_encoder", 7_070_619_136, "qwen2.5-vl-text/megatron-mlp"),  # Qwen2.5-7B's, no head
        ("hunyuanvideo15", "text_encoder_2", 219_314_944, "t5-encoder/megatron-mlp"),  # ByT5-small's, 1510 tokens
    ],
)
def test_published_text_encoders_are_kept_for_every_hub_id(family, component, parameters, table_name):
    """Stage 1's --plan of a CogVideoX, Wan or HunyuanVideo-1.5 hub id builds its text encoders from the configs
    kept in code: the published encoder's parameter count (bf16 weights: T5 9.5 GB, UMT5 11.4 GB; Qwen2.5-7B's
    7.62e9 less its 152,064 x 3584 head; ByT5-small's encoder at 384 tokens is 217,657,472), split by its table
    (attention replicated where 8 does not divide the heads: Qwen's 28 and 4, ByT5's 6)."""
    from tpu_video import models
    from tpu_video.planning.encoders import MetaSource

    for hub_id in models.FAMILIES[family].PUBLISHED:
        source, family_module = models.resolve_model(hub_id, configs_only=True)
        encoder = MetaSource(source, family_module).load(component, torch.bfloat16)
        assert sum(parameter.numel() for parameter in encoder.parameters()) == parameters, hub_id
        names = [name for name, _ in encoder.named_parameters(remove_duplicate=False)]
        table = sharding.text_encoder_rules(encoder.config, 8)
        assert table.name == table_name and table.assign(names)


def test_every_published_id_keeps_each_text_encoder_its_pipeline_takes():
    """So stage 1's --plan of every hub id kept in code builds the published encoders (and the image processors of
    HunyuanVideo-1.5 and Wan image-to-video); only tokenizers have stand-ins, and any other component missing from
    the configs kept is refused when stage 1 loads it."""
    import inspect

    import diffusers

    from tpu_video import models
    from tpu_video.cli import UserError
    from tpu_video.planning.encoders import MetaSource

    for family in models.FAMILIES.values():
        for hub_id, index in family.PUBLISHED.items():
            pipeline = getattr(diffusers, index["_class_name"][1])
            takes = [
                name for name in inspect.signature(pipeline.__init__).parameters if name.startswith("text_encoder")
            ]
            assert takes and all(name in index for name in takes), (hub_id, takes)
    source, family = models.resolve_model("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v", True)
    assert MetaSource(source, family).load("feature_extractor").size == {"height": 384, "width": 384}  # 729 tokens
    source, family = models.resolve_model("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", configs_only=True)
    processor = MetaSource(source, family).load("image_processor")
    assert processor.crop_size == {"height": 224, "width": 224}  # the CLIP ViT-H/14 encoder's 16 x 16 + 1 tokens
    with pytest.raises(UserError, match="the configs kept in code for it have no 'feature_extractor'"):
        MetaSource(source, family).load("feature_extractor")
