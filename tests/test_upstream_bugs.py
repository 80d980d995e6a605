"""Canaries: each test asserts that a named upstream bug still exists, because a workaround of ours
depends on it. A failure here is good news: the bug is fixed upstream, so delete the workaround named
in the test and then the test. Run just these with `pytest -m upstream_bug`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
import torch

from helpers import ROOT, Sample, collectives_in, hunyuan_inputs, relative_error, tiny_hunyuan_transformer
from sharding import MeshShape
from tpu_video.models import cogvideox
from tpu_video.runtime.placement import make_mesh
from tpu_video.runtime.torchax_runtime import TorchaxRuntime

pytestmark = pytest.mark.upstream_bug


def test_torchax_0_0_13_import_fails_on_torch_2_13_dimname_overloads():
    """torchax 0.0.13 looks up `aten.*.Dimname` overloads that torch 2.13 removed.
    Workaround: tpu_video/workarounds/torchax.py's tolerate_missing_overloads (delete it once this fails)."""
    result = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True)
    assert result.returncode != 0, "torchax imports without the shim now: drop tolerate_missing_overloads, this test"
    assert "has no overload name" in result.stderr and "Dimname" in result.stderr


def test_torchax_gather_lowering_adds_collectives_on_a_dp_sharded_batch():
    """torchax 0.0.13 lowers `aten.gather` to advanced indexing over a full index grid; XLA's partitioner
    then adds collectives for a dp-sharded batch. Workaround: workarounds.torchax.take_along_axis_gather."""
    runtime = TorchaxRuntime(make_mesh(MeshShape(2, 1, 4)))
    f32, i32 = jax.numpy.float32, jax.numpy.int32
    stock = runtime.env._ops[torch.ops.aten.gather].func.stock_gather
    gather_shapes = [((2, 130, 64), f32), ((2, 130, 64), i32)]
    assert collectives_in(lambda x, i: stock(x, 1, i), gather_shapes, runtime.mesh) != []


def test_torchax_0_0_13_has_no_int8_matmul_lowering():
    """torchax 0.0.13 lowers neither `aten._int_mm` nor an int8 `aten.mm` with int32 sums (`--quantize int8`).
    Workaround: workarounds.torchax.int_mm (delete it and install_int_mm once this fails)."""
    from torchax.ops import ops_registry
    from torchax.ops.jaten import _aten_mm

    assert torch.ops.aten._int_mm.default not in ops_registry.all_aten_ops
    assert torch.ops.aten._int_mm not in ops_registry.all_aten_ops
    ones = jax.numpy.ones((2, 64), jax.numpy.int8)
    assert _aten_mm(ones * 4, ones.T * 4).dtype == jax.numpy.int8  # 64 * 16 = 1024 wraps in int8


def test_torchax_group_norm_gathers_activations_split_along_width():
    """torchax 0.0.13 lowers `aten.native_group_norm` through one flattened dimension per group; on
    activations split along width XLA's partitioner then all-gathers them. Workaround:
    workarounds.torchax.layout_keeping_group_norm."""
    from torchax.ops.jaten import _aten_native_group_norm

    mesh = make_mesh(MeshShape(1, 8, 1))
    shapes = [((1, 32, 2, 8, 64), jax.numpy.float32)]  # (batch, channels, frames, height, width)
    found = collectives_in(
        lambda x: _aten_native_group_norm(x, None, None, 1, 32, 2 * 8 * 64, 8, 1e-6)[0],
        shapes,
        mesh,
        layout=(None, None, None, None, "sp"),
    )
    assert "all-gather" in found, f"torchax's group norm keeps the width split now ({found}): drop the workaround"


def test_torchax_nearest_upsampling_adds_collectives_on_a_width_split():
    """torchax 0.0.13 decomposes nearest upsampling into an index gather, which XLA's partitioner cannot split
    along a sharded width: it adds collectives (all-gathers in the VAE decodes, an all-reduce here).
    Workaround: workarounds.torchax.repeat_upsample."""
    from torchax import interop

    runtime = TorchaxRuntime(make_mesh(MeshShape(1, 8, 1)))
    stock = runtime.env._get_op_or_decomp(torch.ops.aten.upsample_nearest2d.vec).func.stock

    def upsampled(x):
        return stock(x, None, [2.0, 2.0])

    shapes = [((2, 4, 8, 64), jax.numpy.float32)]
    found = collectives_in(interop.jax_view(upsampled), shapes, runtime.mesh, layout=(None, None, None, "sp"))
    assert found != [], "torchax's nearest upsampling keeps the width split now: drop the workaround"


def test_xla_cpu_miscompiles_cogvideox_in_place_rotary_update_at_batch_1():
    """XLA:CPU gets diffusers' in-place rotary write (`query[:, :, T:] = ...`) wrong under jit.
    Workaround: cogvideox.transformer.rotary_attention_processor (torch.cat)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    runtime = TorchaxRuntime()
    rotary = get_3d_rotary_pos_embed(16, None, (4, 6), temporal_size=2, grid_type="slice", max_size=(4, 6))
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 4, 4, 8, 12, generator=generator), torch.randn(1, 32, 32, generator=generator))
    errors = {}
    for name, prepare in (("stock", lambda t: t), ("patched", cogvideox.transformer.make_jit_safe)):
        transformer = prepare(cogvideox.presets.tiny_pipeline("1.5").transformer.eval())
        with torch.no_grad():
            expected = transformer(*inputs, timestep=torch.tensor([999]), image_rotary_emb=rotary, return_dict=False)[0]
        jitted = runtime.compile(cogvideox.transformer.GuidedTransformer(transformer, do_cfg=False))
        device_inputs = runtime.to_device((inputs[0], torch.tensor([999]), inputs[1], rotary, torch.tensor(1.0)))
        errors[name] = relative_error(runtime.to_host(jitted(*device_inputs)), expected)
    assert errors["patched"] <= 1e-5
    assert errors["stock"] > 1e-3, f"stock processor now compiles correctly ({errors}); the patch may be dropped"


def test_diffusers_hunyuanvideo15_forward_cannot_be_traced():
    """diffusers 0.42.1's HunyuanVideo15Transformer3DModel.forward branches on tensor values
    (`if torch.all(image_embeds == 0)`). Workaround: hunyuanvideo15.transformer.traceable_forward."""
    runtime = TorchaxRuntime()
    compiled = runtime.compile(Sample(tiny_hunyuan_transformer()))
    with pytest.raises(jax.errors.ConcretizationTypeError, match="traced array with shape bool") as raised:
        compiled(**runtime.to_device(hunyuan_inputs()))
    # raised inside diffusers' own forward, not in our wrapper or the runtime
    assert any(entry.path.name == "transformer_hunyuan_video15.py" for entry in raised.traceback)


def test_torchax_type_as_casts_in_place_and_leaves_a_stale_dtype():
    """torchax 0.0.13's Tensor.type_as mutates the array and keeps the old torch dtype, so a bf16 conv
    after `upsample(x.float()).type_as(x)` (the Wan VAE) fails under jit.
    Workaround: torchax_compat.cast_type_as."""
    from tpu_video.workarounds.torchax import STOCK_TYPE_AS

    class Upsampled(torch.nn.Module):
        def __init__(self, type_as):
            super().__init__()
            self.type_as = type_as
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1).to(torch.bfloat16)

        def forward(self, x):
            up = torch.nn.functional.interpolate(x.float(), scale_factor=2.0, mode="nearest-exact")
            return self.conv(self.type_as(up, x))

    runtime = TorchaxRuntime()
    x = torch.ones(1, 2, 3, 3, dtype=torch.bfloat16)
    fixed = runtime.compile(Upsampled(lambda tensor, other: tensor.type_as(other)))  # the patched method
    assert runtime.to_host(fixed(runtime.to_device(x))).dtype == torch.bfloat16
    stock = runtime.compile(Upsampled(STOCK_TYPE_AS[0]))
    with pytest.raises(RuntimeError, match=r"Input type \(float\) and bias type \(c10::BFloat16\)"):
        stock(runtime.to_device(x))


def test_torchax_setitem_makes_a_strided_slice_assignment_a_scatter():
    """torchax 0.0.13's Tensor.__setitem__ is JAX's `.at[key].set`, which lowers `out[..., 0::2] = x` (Wan's
    rotary embedding) to stablehlo.scatter. Workaround: workarounds.torchax.strided_slice_set."""
    import torchax

    stock = torchax.tensor.Tensor.__setitem__.stock_setitem
    env = torchax.default_env()

    def assign(base, value):
        out = env.j2t_iso(base).clone()
        stock(out, (Ellipsis, slice(0, None, 2)), env.j2t_iso(value))
        return env.t2j_iso(out)

    with env:
        program = jax.jit(assign).lower(jax.numpy.zeros((2, 8)), jax.numpy.ones((2, 4))).as_text()
    assert "stablehlo.scatter" in program, "torchax writes strided slices without a scatter now: drop the workaround"


def test_torchax_repeat_interleave_by_a_number_is_a_scatter():
    """torchax 0.0.13 lowers `x.repeat_interleave(2, dim=1, output_size=8)` (diffusers' rotary tables) and the
    `repeat_interleave.self_int` op so that `jnp.repeat` builds them with a scatter. Workaround:
    workarounds.torchax.repeat_interleave_by_int."""
    runtime = TorchaxRuntime()
    x = jax.numpy.ones((3, 4))
    method = runtime.env._ops[torch.Tensor.repeat_interleave].func.stock
    op = runtime.env._ops[torch.ops.aten.repeat_interleave.self_int].func.stock
    for stock in (lambda x: method(x, 2, 1, output_size=8), lambda x: op(x, 2, 1)):
        program = jax.jit(stock).lower(x).as_text()
        assert "stablehlo.scatter" in program, "torchax repeats by a number without a scatter: drop the workaround"


def test_torch_compile_builds_a_guider_output_without_its_attributes():
    """torch 2.13's dynamo (2.11's too, on the GPU host) returns diffusers' GuiderOutput without its `.pred`
    attribute; the key works. Workaround: HunyuanVideo-1.5's GuidedTransformer reads `["pred"]`. A fresh
    process: torch.compile fails once torchax is imported."""
    code = (
        "import torch\n"
        "from diffusers import ClassifierFreeGuidance\n"
        "guider = ClassifierFreeGuidance(guidance_scale=6.0)\n"
        "a, b = torch.ones(2), torch.zeros(2)\n"
        "assert torch.equal(torch.compile(lambda a, b: guider.forward(a, b)['pred'], backend='eager')(a, b), 6 * a)\n"
        "torch.compile(lambda a, b: guider.forward(a, b).pred, backend='eager')(a, b)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0, "dynamo keeps GuiderOutput.pred now: read it as an attribute again, drop this test"
    assert "AttributeError: 'GuiderOutput' object has no attribute 'pred'" in result.stderr, result.stderr[-2000:]


def test_diffusers_0_42_1_block_registry_lacks_hunyuanvideo15():
    """diffusers 0.42.1's transformer-block registry (read by its cache hooks and by our step cache) has no
    HunyuanVideo15TransformerBlock. Workaround: workarounds.diffusers.register_hunyuanvideo15_block. A fresh
    process, because registering is process-wide."""
    code = (
        "from diffusers.hooks._helpers import TransformerBlockRegistry as R\n"
        "from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock as B\n"
        "R.get(B)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0, (
        "diffusers registers the block now: remove register_hunyuanvideo15_block and this test"
    )
    assert "HunyuanVideo15TransformerBlock" in result.stderr and "not registered" in result.stderr


def test_diffusers_0_42_1_block_registry_lacks_wan_animates_copy_of_wans_block():
    """transformer_wan_animate.py defines its own WanTransformerBlock (a copy of Wan's), which diffusers 0.42.1's
    block registry leaves out, so its cache hooks cannot run on WanAnimateTransformer3DModel. Workaround:
    models/wan/animate.py's GuidedAnimate.block_streams hands Wan's entry to our step cache and block scan (and
    tests/cache_reference.register_block_as to the reference). A fresh process: registering is process-wide."""
    code = (
        "from diffusers.hooks._helpers import TransformerBlockRegistry as R\n"
        "from diffusers.models.transformers.transformer_wan_animate import WanTransformerBlock as B\n"
        "R.get(B)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0, "diffusers registers the block now: GuidedAnimate.block_streams can go"
    assert "not registered" in result.stderr


def test_jax_0_10_2_splash_cannot_shard_a_local_window_mask_eight_ways():
    """jax 0.10.2's Splash mask preprocessing asserts (a bare `assert` in splash_attention_mask_info.py) when
    a local-window mask's 300 queries are split 8 ways. Workaround: `--sp_mode auto` runs Ulysses for a
    local window (attention.sp_modes.sp_mode_choice), whole sequence per head. Once this fails, the case
    joins tests/test_splash_attention.py's SHARDED list."""
    import jax.numpy as jnp
    import numpy as np

    from splash_attention import splash_attention
    from tpu_video.attention.plan import SplashConfig

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 300, 64)), jnp.float32) for _ in range(3))
    config = SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, interpret=True, local_window=40)
    mesh = make_mesh(MeshShape(1, 8, 1))
    with pytest.raises(AssertionError) as raised:
        jax.jit(lambda q, k, v: splash_attention(q, k, v, None, config=config, mesh=mesh, scheme="gather"))(q, k, v)
    assert raised.traceback[-1].path.name == "splash_attention_mask_info.py", raised.traceback[-1]


def test_torch_2_13_generator_set_state_fails_on_a_view_at_an_offset():
    """torch 2.13's CPU `Generator.set_state` reads a state tensor that is a view at a storage offset (a row
    of a stacked state) wrongly: it crashes the process or says "Invalid mt19937 state". Workaround:
    engine.batching.Generators.set_state gives each generator a copy (delete the `.clone()` once this fails)."""
    code = (
        "import torch; s = torch.stack([torch.Generator().manual_seed(1).get_state(), "
        "torch.Generator().manual_seed(2).get_state()]); g = torch.Generator(); g.set_state(s[1]); "
        "assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(2)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0, "set_state now takes a row of a stack: drop the copy in engine.batching"


SERIALIZE_AFTER_CACHE_HIT = """
import contextlib, pickle, sys
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable
from tpu_video.workarounds.jax import without_compilation_cache
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
f = jax.jit(lambda w, x: jnp.tanh(x @ w).astype(jnp.bfloat16).sum())
if sys.argv[2] == "save":
    f.lower(w, x).compile()  # the first process fills the cache
elif sys.argv[2] in ("from the cache", "fresh"):
    with without_compilation_cache() if sys.argv[2] == "fresh" else contextlib.nullcontext():
        compiled = f.lower(w, x).compile()
    pickle.dump(serialize_executable.serialize(compiled), open(sys.argv[3], "wb"))
else:
    serialized = pickle.load(open(sys.argv[3], "rb"))
    loaded = serialize_executable.deserialize_and_load(*serialized, execution_devices=jax.devices()[:1])
    print(float(loaded(w, x)))
"""


def test_jax_0_10_2_cpu_executables_from_the_compilation_cache_fail_when_loaded_in_a_new_process(tmp_path):
    """An executable the persistent compilation cache returned serializes into bytes that load in a new
    process and then fail when run. Workaround: workarounds.jax.without_compilation_cache, around the
    compiles of programs bound for the executable store (tpu_video/runtime/programs.py)."""
    script, cache = tmp_path / "bug.py", tmp_path / "cache"
    script.write_text(SERIALIZE_AFTER_CACHE_HIT)

    def python(*argv):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, script, cache, *argv], capture_output=True, text=True, env=env)

    assert python("save").returncode == 0
    for how in ("from the cache", "fresh"):
        assert python(how, tmp_path / f"{how}.pkl").returncode == 0
    broken, workaround = (python("load", tmp_path / f"{how}.pkl") for how in ("from the cache", "fresh"))
    assert broken.returncode != 0 and "not found (type id" in broken.stderr, broken.stderr[-2000:]
    assert workaround.returncode == 0 and float(workaround.stdout) == 512.0, workaround.stderr[-2000:]


SAVED_QR = """
import pickle, sys
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable
x = jnp.eye(4) + 1.0
if sys.argv[1] == "save":
    compiled = jax.jit(lambda x: jnp.linalg.qr(x)[0]).lower(x).compile()
    pickle.dump(serialize_executable.serialize(compiled), open(sys.argv[2], "wb"))
else:
    if sys.argv[1] == "workaround":
        from tpu_video.workarounds.jax import lapack_ready
        lapack_ready()
    payload, in_tree, out_tree = pickle.load(open(sys.argv[2], "rb"))
    one = jax.devices()[:1]
    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=one)
    print(float(compiled(x)[0, 0]))
"""


def test_jax_0_10_2_a_saved_cpu_program_calling_lapack_crashes_when_run_in_a_new_process(tmp_path):
    """A QR (Wan Animate's motion encoder) compiled, saved and loaded in a new process crashes when run, unless
    jaxlib's LAPACK kernels were set up first. Workaround: workarounds.jax.lapack_ready, before the executable
    store loads a program (tpu_video/runtime/executables.py)."""
    script, saved = tmp_path / "qr.py", tmp_path / "qr.pkl"
    script.write_text(SAVED_QR)

    def python(*argv):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, script, *argv, saved], capture_output=True, text=True, env=env)

    assert python("save").returncode == 0
    broken, workaround = python("load"), python("workaround")
    assert broken.returncode == -11, (broken.returncode, broken.stderr[-2000:])  # SIGSEGV
    assert workaround.returncode == 0 and abs(float(workaround.stdout) + 0.7559) < 1e-3, workaround.stderr[-2000:]


def test_torchax_0_0_13_drops_in_place_updates_made_through_a_view():
    """diffusers' LTX-2 `apply_split_rotary_emb` writes both halves of its output with `addcmul_` on slices;
    under torchax the output keeps the unrotated values. Workaround: workarounds.torchax.split_rotary_emb
    (tpu_video/models/ltx2/transformer.py traces with it)."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    from tpu_video.workarounds.torchax import split_rotary_emb

    generator = torch.Generator().manual_seed(0)
    x, cos, sin = torch.randn(2, 5, 16, generator=generator), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    expected = apply_split_rotary_emb(x, (cos, sin))
    runtime = TorchaxRuntime()
    errors = {}
    for name, function in (("stock", apply_split_rotary_emb), ("patched", split_rotary_emb)):
        with runtime.env:
            got = function(*runtime.to_device((x,)), tuple(runtime.to_device((cos, sin))))
        errors[name] = relative_error(runtime.to_host(got), expected)
    assert errors["patched"] <= 1e-6
    assert errors["stock"] > 1e-2, f"torchax now keeps in-place updates through views ({errors}); drop the patch"


def test_torchax_0_0_13_sdpa_gives_nan_where_a_boolean_mask_admits_no_key():
    """torch's SDPA gives zeros on such a row (transformers counts on it for left-padded prompts: Gemma 3 in
    LTX-2's stage 1); torchax's reference gives NaN. Workaround: workarounds.torchax.zero_unattended_rows_sdpa,
    installed in every TorchaxRuntime's environment."""
    from tpu_video.workarounds.torchax import op_definition

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 3, 4, generator=generator) for _ in range(3))
    mask = torch.tensor([[False, False, False], [True, False, False], [True, True, True]])[None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert torch.equal(expected[:, :, 0], torch.zeros(1, 2, 4))
    runtime = TorchaxRuntime()
    ours = op_definition(runtime.env, torch.nn.functional.scaled_dot_product_attention).func
    with runtime.env:
        inputs = runtime.to_device((query, key, value, mask))
        stock = runtime.to_host(ours.stock_sdpa(*inputs))
        fixed = runtime.to_host(torch.nn.functional.scaled_dot_product_attention(*inputs))
    assert relative_error(fixed, expected) <= 1e-6 and torch.equal(fixed[:, :, 0], expected[:, :, 0])
    assert torch.isnan(stock[:, :, 0]).all(), "torchax now gives torch's zeros: drop zero_unattended_rows_sdpa"


def test_torchax_0_0_13_jittable_module_evaluates_every_property_of_a_transformers_model():
    """JittableModule finds a module's tensors by reading every attribute of every submodule, which on a
    transformers model evaluates `is_gradient_checkpointing` (a FutureWarning each time). Workaround:
    runtime.programs.Programs scans under workarounds.torchax.quiet_attribute_scan (a run's and a plan's
    programs alike; until 2026-11-26 only a run's encoders did)."""
    import warnings

    from tpu_video import models
    from tpu_video.workarounds.torchax import import_torchax

    encoder = models.resolve_model("tiny-wan2.1")[0].load("text_encoder").eval()
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        import_torchax().interop.JittableModule(encoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TorchaxRuntime().compile(encoder)  # places the weights, then builds runtime.programs.Programs


def test_torchax_0_0_13_jittable_module_lists_a_tied_plain_tensor_under_every_name():
    """torchax 0.0.13's JittableModule passes a tied weight once only when it is a Parameter that requires
    grad; placed weights are plain tensors, listed as buffers under each name, so a program took the tied
    T5 embedding twice. Workaround: workarounds.torchax.dedup_tied_buffers (tpu_video/runtime/programs.py): one
    argument, the same encoding."""
    from torchax import interop
    from transformers import T5Config, T5EncoderModel

    from tpu_video.engine.encoders import DeviceTextEncoder

    torch.manual_seed(0)
    config = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    encoder = T5EncoderModel(config).eval().requires_grad_(False)
    assert encoder.shared.weight is encoder.encoder.embed_tokens.weight
    tied = {"shared.weight", "encoder.embed_tokens.weight"}
    assert tied <= set(interop.JittableModule(encoder).buffers)  # the bug: both names, one tensor
    ids = torch.tensor([[3, 5, 7, 1]])
    with torch.no_grad():
        expected = encoder(input_ids=ids).last_hidden_state
    with jax.default_matmul_precision("highest"):
        device_encoder = DeviceTextEncoder(encoder, TorchaxRuntime(make_mesh(MeshShape())))
        output = device_encoder(ids, torch.ones_like(ids))
    names = {name.removeprefix("encoder.") for name in device_encoder.jitted.buffers}
    assert len(tied & names) == 1
    assert relative_error(output.last_hidden_state, expected) <= 1e-6


def test_diffusers_0_42_1_vace_fails_past_one_reference_image_per_latent_frame():
    """WanVACEPipeline.prepare_masks pads the mask with `zeros_like(mask[:, :num_ref_images])`, a slice of its
    own latent frames: with more reference images than latent frames the padding is short and the control's
    concatenation fails. Stage 1 refuses such a request (tpu_video/models/wan/vace.py)."""
    from diffusers import WanVACEPipeline
    from PIL import Image

    from tpu_video import models

    pipe = WanVACEPipeline.from_pretrained(models.materialize_preset("tiny-wan2.1-vace"))
    references = [Image.new("RGB", (48, 32))] * 3  # 5 frames make 2 latent frames
    video, mask, references = pipe.preprocess_conditions(None, None, references, 1, 32, 48, 5, torch.float32, "cpu")
    latents = pipe.prepare_video_latents(video, mask, references, None, "cpu")
    masks = pipe.prepare_masks(mask, references, None)
    assert latents.shape[2] == 5 and masks.shape[2] == 4  # 2 + 3 against 2 + min(3, 2)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([latents, masks], dim=1)


def test_diffusers_0_42_1_passes_the_hubs_deprecated_symlinks_argument():
    """diffusers' config read from the hub passes `local_dir_use_symlinks="auto"`, which huggingface_hub warns
    about on every call. Workaround: its message in tpu_video/workarounds/warning_filters.py (delete it once
    this fails); under the stages' filter the warning is gone."""
    import inspect
    import warnings

    from diffusers import configuration_utils
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from tpu_video.workarounds.warning_filters import filter_harmless_warnings

    assert 'kwargs.pop("local_dir_use_symlinks", "auto")' in inspect.getsource(configuration_utils), "fixed upstream"
    for filtered in (False, True):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if filtered:
                filter_harmless_warnings()
            with pytest.raises(LocalEntryNotFoundError):  # offline: nothing to find, after the arguments are checked
                hf_hub_download("no-one/nothing", "config.json", local_dir_use_symlinks="auto", local_files_only=True)
        said = [str(warning.message) for warning in seen if "local_dir_use_symlinks" in str(warning.message)]
        assert bool(said) != filtered, said
