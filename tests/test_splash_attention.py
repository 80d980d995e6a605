"""Splash attention (real kernel, Pallas interpret mode on CPU) against exact masked attention in float64.

Tolerance: 1e-5 relative (Frobenius) in fp32, the issue's bar; segment-id masking adds no
approximation, so only fp32 rounding of the kernel's online softmax remains (~3e-7 seen). bf16 inputs:
2e-2, because rounding q, k, v to bf16 alone moves the result by ~5e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import sharding
from helpers import reference_attention, relative_error
from splash_attention import splash_attention, tile_sizes
from tpu_video.attention.masks import DENSE_MASK_LIMIT, masks_from_attn_mask
from tpu_video.attention.plan import SplashConfig, fixed_plan
from tpu_video.attention.sequence_parallel import call_scheme, merge_partials
from tpu_video.attention.sp_modes import sp_mode_choice
from tpu_video.attention.xla import attention_with_lse, xla_attention, xla_sequence_parallel_attention
from tpu_video.runtime import placement
from tpu_video.runtime.sdpa import attention_backend

SMALL_TILES = SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, interpret=True)


def masked_reference(q, k, v, key_valid, scale=None, query_valid=None, window=None):
    """helpers.reference_attention with Splash's masks: valid keys, valid queries, a local window."""
    batch, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    valid = np.ones((batch, kv_len), bool) if key_valid is None else np.asarray(key_valid)
    allowed = np.broadcast_to(valid[:, None, None, :], (batch, 1, q_len, kv_len))
    if query_valid is not None:
        allowed = allowed & np.asarray(query_valid)[:, None, :, None]
    if window is not None:
        positions_q, positions_k = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        allowed = allowed & (np.abs(positions_q - positions_k) <= window)
    return reference_attention(q, k, v, allowed, scale=scale)


def random_qkv(batch, heads, q_len, kv_len, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, heads, q_len, head_dim), (batch, heads, kv_len, head_dim), (batch, heads, kv_len, head_dim)]
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def key_mask(batch, kv_len, valid_counts):
    return np.arange(kv_len)[None, :] < np.asarray(valid_counts)[:, None]


def run_splash(q, k, v, key_valid, config=SMALL_TILES, **kwargs):
    valid = None if key_valid is None else jnp.asarray(key_valid)
    fn = jax.jit(lambda q, k, v, m: splash_attention(q, k, v, m, config=config, **kwargs))
    return np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), valid).astype(jnp.float32))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("padding", "valid_counts"),
    [("0%", [300, 300]), ("50%", [150, 150]), ("99%", [3, 3]), ("per-row", [300, 40])],
)
def test_self_attention_with_key_padding_vs_float64(head_dim, padding, valid_counts):
    q, k, v = random_qkv(2, 2, 300, 300, head_dim)  # 300 is not a multiple of the 128 tile
    mask = None if padding == "0%" else key_mask(2, 300, valid_counts)
    expected = masked_reference(q, k, v, mask)
    assert relative_error(run_splash(q, k, v, mask), expected) <= 1e-5


def test_cross_attention_with_different_lengths_vs_float64():
    q, k, v = random_qkv(2, 2, 200, 77, 64, seed=1)
    mask = key_mask(2, 77, [77, 20])
    assert relative_error(run_splash(q, k, v, mask), masked_reference(q, k, v, mask)) <= 1e-5


def test_custom_scale_and_scaled_scores_vs_float64():
    q, k, v = random_qkv(1, 2, 130, 260, 64, seed=2)
    q = q * 3.0  # sharper softmax
    mask = key_mask(1, 260, [100])
    out = run_splash(q, k, v, mask, scale=0.05)
    assert relative_error(out, masked_reference(q, k, v, mask, scale=0.05)) <= 1e-5


def test_bf16_inputs():
    q, k, v = random_qkv(2, 2, 200, 200, 64, seed=3)
    mask = key_mask(2, 200, [200, 90])
    as_bf16 = [jnp.asarray(x, dtype=jnp.bfloat16) for x in (q, k, v)]
    out = np.asarray(
        jax.jit(lambda q, k, v: splash_attention(q, k, v, jnp.asarray(mask), config=SMALL_TILES))(*as_bf16)
    ).astype(np.float32)
    assert relative_error(out, masked_reference(q, k, v, mask)) <= 2e-2


def test_row_without_any_valid_key_gives_zeros_like_pytorch():
    q, k, v = random_qkv(2, 1, 64, 64, 64, seed=4)
    mask = key_mask(2, 64, [64, 0])
    out = run_splash(q, k, v, mask)
    assert np.all(out[1] == 0) and np.all(np.isfinite(out))
    assert relative_error(out[0], masked_reference(q, k, v, mask)[0]) <= 1e-5


def test_zeroing_padded_keys_is_not_exact_but_splash_is():
    """The reference notes' approach (zero K/V, no mask) is what this module exists to avoid."""
    q, k, v = random_qkv(1, 2, 256, 256, 64, seed=5)
    mask = key_mask(1, 256, [150])
    zeroed = [k * mask[:, None, :, None], v * mask[:, None, :, None]]
    expected = masked_reference(q, k, v, mask)
    assert relative_error(masked_reference(q, *zeroed, None), expected) > 5e-2
    assert relative_error(run_splash(q, k, v, mask), expected) <= 1e-5


def test_tile_sizes_clamp_to_short_sequences_and_keep_divisibility():
    config = SplashConfig(block_q=3328, block_kv=2816, block_kv_compute=256)
    small = tile_sizes(config, 80, 80)
    assert (small.block_q, small.block_kv, small.block_kv_compute) == (128, 128, 128)
    mid = tile_sizes(config, 5000, 600)
    assert (mid.block_q, mid.block_kv, mid.block_kv_compute) == (3328, 640, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        SplashConfig(block_q=100)
    with pytest.raises(ValueError, match="must divide"):
        SplashConfig(block_kv=512, block_kv_compute=384)


def test_torchax_sdpa_override_calls_splash_and_matches_torch(monkeypatch):
    """Inside the torchax environment, F.scaled_dot_product_attention with a key mask runs Splash."""
    import tpu_video.runtime.sdpa as module
    from tpu_video.runtime.torchax_runtime import TorchaxRuntime

    calls = []
    monkeypatch.setattr(module, "splash_attention", lambda *a, **kw: calls.append(1) or splash_attention(*a, **kw))

    runtime = TorchaxRuntime()
    q, k, v = (torch.from_numpy(x) for x in random_qkv(2, 2, 100, 100, 64, seed=6))
    mask = torch.from_numpy(key_mask(2, 100, [100, 33]))[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def attend(query, key, value, attn_mask):
        return torch.nn.functional.scaled_dot_product_attention(query=query, key=key, value=value, attn_mask=attn_mask)

    import torchax

    with attention_backend(runtime.env, fixed_plan("splash", SMALL_TILES)):
        jitted = torchax.compile(attend)
        out = runtime.to_host(jitted(*runtime.to_device((q, k, v, mask))))
    assert relative_error(out, expected) <= 1e-5
    assert calls, "the override did not reach the Splash kernel"
    default_op = runtime.env._ops[torch.nn.functional.scaled_dot_product_attention]
    # the runtime's own SDPA is back (workarounds.torchax.zero_unattended_rows_sdpa over torchax's)
    assert hasattr(default_op.func, "stock_sdpa"), "the override leaked out of its block"


def test_cogvideox_stage2_with_splash_matches_xla(tmp_path, monkeypatch, capsys):
    """The tiny CogVideoX transformer (80 tokens, padded to one 128 tile) denoised with each backend."""
    import stage1_text_encoder
    import stage2_transformer
    import tpu_video.runtime.sdpa as module
    from helpers import run_stage
    from utils import read_config, read_tensors

    run_stage(
        stage1_text_encoder,
        [
            "--model",
            "tiny-cogvideox",
            "--prompt",
            "a panda",
            "--dtype",
            "fp32",
            "--num_inference_steps",
            "3",
            "--output_dir",
            tmp_path,
        ],
    )
    calls = []
    monkeypatch.setattr(module, "splash_attention", lambda *a, **kw: calls.append(1) or splash_attention(*a, **kw))
    latents = {}
    for backend in ("xla", "splash"):
        out = tmp_path / backend
        # --executables off: a program another test saved would load without tracing, and `calls` stay empty
        argv = ["--input_dir", tmp_path, "--output_dir", out, "--attention", backend, "--executables", "off"]
        run_stage(stage2_transformer, argv)
        config = read_config(out)
        assert config["stage2"]["attention"] == backend
        latents[backend] = read_tensors(out, config["stage2"])["latents"]
        assert bool(calls) == (backend == "splash")  # traced once per attention layer, splash run only
    assert config["stage2"]["splash"] == {
        "block_q": 3328,
        "block_kv": 2816,
        "block_kv_compute": 256,
        "interpret": True,
        "local_window": None,
        "k_smoothing": False,
        "sp_mode": "auto",
    }
    assert relative_error(latents["splash"], latents["xla"]) <= 1e-5

    from helpers import expect_user_error

    expect_user_error(
        capsys,
        stage2_transformer,
        ["--input_dir", tmp_path, "--block_kv", "200"],
        "--block_kv 200 must be a positive multiple of 128",
    )


# Dense masks, K-smoothing, local windows ------------------------------------------------------------


def hunyuan_style_mask(valid_counts, length):
    """The dense (B, 1, S, S) mask HunyuanVideo-1.5 passes: valid_i & valid_j."""
    valid = key_mask(len(valid_counts), length, valid_counts)
    return valid[:, None, :, None] & valid[:, None, None, :], valid


def test_dense_outer_product_mask_vs_float64():
    q, k, v = random_qkv(2, 2, 200, 200, 64, seed=6)
    dense, valid = hunyuan_style_mask([200, 130], 200)

    def attend(q, k, v, mask):
        key_valid, query_valid = masks_from_attn_mask(mask, 2, 200, 200)
        return splash_attention(q, k, v, key_valid, query_valid=query_valid, config=SMALL_TILES)

    out = np.asarray(jax.jit(attend)(q, k, v, jnp.asarray(dense)))
    expected = masked_reference(q, k, v, valid, query_valid=valid)
    assert relative_error(out, expected) <= 1e-5
    assert np.all(out[1, :, 130:] == 0)  # fully masked query rows are zero, as in PyTorch


def test_dense_mask_that_is_not_key_padding_raises():
    causal = np.tril(np.ones((64, 64), bool))[None, None]
    with pytest.raises(ValueError, match="not \\(valid query\\) x \\(valid key\\)"):
        masks_from_attn_mask(jnp.asarray(causal), 1, 64, 64)  # concrete: checked on the spot
    with pytest.raises(Exception, match="only key-padding masks and their outer-product form"):
        jax.block_until_ready(jax.jit(lambda m: masks_from_attn_mask(m, 1, 64, 64)[0])(jnp.asarray(causal)))
    dense, _ = hunyuan_style_mask([40], 64)
    jax.block_until_ready(jax.jit(lambda m: masks_from_attn_mask(m, 1, 64, 64)[0])(jnp.asarray(dense)))


def test_large_dense_masks_are_refused_not_approximated():
    side = int(DENSE_MASK_LIMIT**0.5) + 1
    mask = jax.ShapeDtypeStruct((1, 1, side, side), jnp.bool_)
    with pytest.raises(ValueError, match="refuses a dense .* pass the per-key mask"):
        jax.eval_shape(lambda m: masks_from_attn_mask(m, 1, side, side), mask)


def test_a_key_mask_repeated_per_head_is_a_key_mask_at_any_length():
    """diffusers' prepare_attention_mask repeats a key mask per head, (B, H, 1, Skv) (LTX-2's text
    attention): taken as the key mask without the dense S x S path, however long the video; heads that
    disagree cannot be one key mask and raise."""
    valid = key_mask(2, 300, [300, 120])
    per_head = np.repeat(valid[:, None, None, :], 4, axis=1)
    long = 2 * DENSE_MASK_LIMIT // 300  # queries: far past the dense path's limit
    key_valid, query_valid = masks_from_attn_mask(jnp.asarray(per_head), 2, long, 300)
    assert query_valid is None and np.array_equal(np.asarray(key_valid), valid)
    q, k, v = random_qkv(2, 4, 200, 300, 64, seed=8)

    def attend(q, k, v, mask):
        key_valid, query_valid = masks_from_attn_mask(mask, 2, 200, 300)
        return splash_attention(q, k, v, key_valid, query_valid=query_valid, config=SMALL_TILES)

    out = np.asarray(jax.jit(attend)(q, k, v, jnp.asarray(per_head)))
    assert relative_error(out, masked_reference(q, k, v, valid)) <= 1e-5
    per_head[1, 2, 0, 5] = not per_head[1, 2, 0, 5]
    with pytest.raises(ValueError, match="differ between heads"):
        masks_from_attn_mask(jnp.asarray(per_head), 2, 200, 300)


@pytest.mark.parametrize("k_smoothing", [False, True], ids=["plain", "k-smoothing"])
def test_k_smoothing_keeps_masked_attention_exact(k_smoothing):
    q, k, v = random_qkv(2, 2, 256, 300, 64, seed=7)
    k = k + 4.0  # a large common key component, the case smoothing exists for
    mask = key_mask(2, 300, [300, 70])
    config = SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, interpret=True, k_smoothing=k_smoothing)
    out = run_splash(q, k, v, mask, config=config)
    assert relative_error(out, masked_reference(q, k, v, mask)) <= 1e-5


@pytest.mark.parametrize("valid_counts", [[300, 300], [300, 170]], ids=["no-padding", "padding"])
def test_local_window_vs_float64(valid_counts):
    q, k, v = random_qkv(2, 2, 300, 300, 64, seed=8)
    mask = key_mask(2, 300, valid_counts)
    config = SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, interpret=True, local_window=50)
    out = run_splash(q, k, v, mask, config=config)
    assert relative_error(out, masked_reference(q, k, v, mask, window=50)) <= 1e-5


# Sharded over the mesh ------------------------------------------------------------------------------


CASES = {"heads-split": (8, None), "heads-replicated": (6, None), "local-window": (8, 40)}
SHARDED = [  # every case on the sp <= 2 meshes in auto and gather; sp 8 and 4 x tp 2 for Ulysses and ring
    *[(mesh, "auto", case) for mesh in [(2, 1, 4), (1, 2, 4), (2, 2, 2)] for case in CASES],
    *[(mesh, "gather", case) for mesh in [(1, 2, 4), (2, 2, 2)] for case in CASES],
    *[(mesh, "auto", case) for mesh in [(1, 8, 1), (1, 4, 2)] for case in ("heads-split", "local-window")],
    *[
        (mesh, "ring", case)
        for mesh in [(1, 2, 4), (1, 8, 1), (1, 4, 2)]
        for case in ("heads-split", "heads-replicated")
    ],
    # ((1, 8, 1), "gather", "local-window") is jax's own assertion: tests/test_upstream_bugs.py
]


@pytest.mark.parametrize(
    "mesh, sp_mode, case", SHARDED, ids=lambda v: "dp{}-sp{}-tp{}".format(*v) if isinstance(v, tuple) else v
)
def test_sharded_equals_unsharded(mesh, sp_mode, case):
    """8 heads split over tp; 6 heads (tp=4 cannot split them) computed whole on every tp device. With
    sp > 1, auto runs Ulysses where the heads per tp shard divide by sp (an all-to-all in the program),
    else ring (collective-permutes: 6 heads at 2x2x2); gather has no all-to-all."""
    heads, window = CASES[case]
    dp, sp, tp = mesh
    local_heads = heads // tp if heads % tp == 0 else heads
    expected = None if sp == 1 else sp_mode if sp_mode != "auto" else "ulysses" if local_heads % sp == 0 else "ring"
    mesh = placement.make_mesh(sharding.MeshShape(*mesh))
    q, k, v = random_qkv(2, heads, 300, 300, 64, seed=9)
    mask = key_mask(2, 300, [300, 111])
    config = SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, interpret=True, local_window=window)
    single = run_splash(q, k, v, mask, config=config)
    scheme = call_scheme(sp_mode_choice(sp_mode, dict(mesh.shape), heads, bool(window))[0], mesh, heads, True)
    sharded = run_splash(q, k, v, mask, config=config, mesh=mesh, scheme=scheme)
    assert relative_error(sharded, single) <= 1e-6
    assert relative_error(sharded, masked_reference(q, k, v, mask, window=window)) <= 1e-5
    assert scheme == expected
    attend = jax.jit(lambda q, k, v, m: splash_attention(q, k, v, m, config=config, mesh=mesh, scheme=scheme))
    lowered = attend.lower(q, k, v, mask)
    program = lowered.compile().as_text()
    assert ("all-to-all" in program) == (expected == "ulysses")
    if expected == "ring":  # (XLA may reshard with a permute elsewhere too, so only the ring's own is checked)
        assert "collective-permute" in program


@pytest.mark.parametrize("mesh", [(1, 2, 4), (2, 2, 2), (1, 8, 1)], ids=lambda m: "dp{}-sp{}-tp{}".format(*m))
@pytest.mark.parametrize("kv_len", [300, 77], ids=["self", "cross"])
@pytest.mark.parametrize("scheme, collective", [("ulysses", "all-to-all"), ("ring", "collective-permute")])
def test_sequence_parallel_xla_attention_with_query_and_key_masks(mesh, kv_len, scheme, collective):
    """XLA attention under Ulysses and ring: a dense boolean (query x key) mask travels as the two
    validities; the padding to a multiple of sp is masked too (300 and 77 tokens do not divide by 8), and
    the second row's keys end inside the ring's first chunks, so later chunks see no valid key."""
    mesh = placement.make_mesh(sharding.MeshShape(*mesh))
    q, k, v = random_qkv(2, 8, 300, kv_len, 32, seed=12)
    key_valid, query_valid = key_mask(2, kv_len, [kv_len, kv_len // 5]), key_mask(2, 300, [280, 300])
    dense = query_valid[:, None, :, None] & key_valid[:, None, None, :]
    fn = jax.jit(lambda q, k, v, m: xla_sequence_parallel_attention(q, k, v, m, scale=None, mesh=mesh, scheme=scheme))
    out = np.asarray(fn(q, k, v, dense))
    assert relative_error(out, masked_reference(q, k, v, key_valid, query_valid=query_valid)) <= 1e-5
    assert collective in fn.lower(q, k, v, dense).compile().as_text()


def test_merging_partial_softmaxes_is_exact_and_ignores_parts_without_keys():
    """Ring attention's merge: attention over keys A + B from the parts over A and over B (float64
    reference, 1e-6), and a part whose row sees no key (lse -inf, output 0) changes nothing, even when
    every part is empty (zeros, not NaN)."""
    q, k, v = random_qkv(1, 2, 30, 40, 16, seed=13)
    valid = np.ones((1, 40), bool)
    valid[:, 25:] = False
    allowed = np.broadcast_to(valid[:, None, None, :], (1, 2, 30, 40))
    parts = [
        attention_with_lse(q, k[:, :, s], v[:, :, s], jnp.asarray(allowed[..., s]))
        for s in (slice(0, 20), slice(20, 40))
    ]
    out, lse = jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf)
    for part, part_lse in parts:
        out, lse = merge_partials(out, lse, part, part_lse)
    assert relative_error(np.asarray(out), masked_reference(q, k, v, valid)) <= 1e-6
    _, whole_lse = attention_with_lse(q, k, v, jnp.asarray(allowed))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole_lse), rtol=1e-6)
    nothing = np.zeros((1, 2, 30, 40), bool)
    empty, empty_lse = attention_with_lse(q, k, v, jnp.asarray(nothing))
    out, lse = merge_partials(jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf), empty, empty_lse)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize(
    "sp_mode, mesh, heads, expected",
    [
        ("auto", {"dp": 1, "sp": 2, "tp": 4}, 48, "ulysses"),
        ("auto", {"dp": 1, "sp": 8, "tp": 1}, 16, "ulysses"),
        ("auto", {"dp": 1, "sp": 4, "tp": 2}, 40, "ulysses"),
        ("auto", {"dp": 1, "sp": 8, "tp": 1}, 40, "ulysses"),
        ("auto", {"dp": 1, "sp": 2, "tp": 4}, 12, "ring"),  # 3 heads per tp shard
        ("auto", {"dp": 1, "sp": 8, "tp": 2}, 20, "ring"),  # Wan 2.1 1.3B's 12 heads would be too
        ("ring", {"dp": 1, "sp": 2, "tp": 4}, 48, "ring"),
        ("gather", {"dp": 1, "sp": 2, "tp": 4}, 48, "gather"),
        ("auto", {"dp": 2, "sp": 1, "tp": 4}, 48, "none"),
    ],
)
def test_sp_mode_choice(sp_mode, mesh, heads, expected):
    assert sp_mode_choice(sp_mode, mesh, heads)[0] == expected


def test_auto_with_a_local_window_falls_back_to_gather_not_ring():
    assert sp_mode_choice("auto", {"dp": 1, "sp": 2, "tp": 4}, 12, local_window=True)[0] == "gather"
    with pytest.raises(ValueError, match="ring cannot run a local window"):
        sp_mode_choice("ring", {"dp": 1, "sp": 2, "tp": 4}, 48, local_window=True)
    mesh = placement.make_mesh(sharding.MeshShape(1, 2, 4))
    assert call_scheme("ring", mesh, 48, self_attention=False) == "gather"  # short text keys stay whole


def test_ulysses_that_the_heads_do_not_allow_is_an_error():
    with pytest.raises(ValueError, match="the 10 heads per tp shard do not divide by sp=4"):
        sp_mode_choice("ulysses", {"dp": 1, "sp": 4, "tp": 2}, 20)


def test_k_smoothing_centres_valid_keys_only():
    from splash_attention import _smooth_keys

    _, k, _ = random_qkv(2, 2, 1, 50, 8, seed=10)
    valid = key_mask(2, 50, [50, 20])
    smoothed = np.asarray(_smooth_keys(jnp.asarray(k + 3.0), jnp.asarray(valid)))
    np.testing.assert_allclose(smoothed[1, :, :20].mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(
        smoothed[1, :, :20], (k + 3.0)[1, :, :20] - (k + 3.0)[1, :, :20].mean(1, keepdims=True), atol=1e-5
    )
    assert np.all(smoothed[1, :, 20:] == 0)


# The XLA backend -----------------------------------------------------------------------------------


def test_xla_attention_takes_any_mask_exactly_and_zeroes_fully_masked_rows():
    q, k, v = random_qkv(2, 2, 40, 50, 16, seed=11)
    rng = np.random.default_rng(12)
    mask = rng.random((2, 2, 40, 50)) > 0.3  # arbitrary per-head pattern
    mask[1, :, 7] = False  # a fully masked query row
    out = np.asarray(jax.jit(xla_attention)(q, k, v, jnp.asarray(mask)))
    assert relative_error(out, reference_attention(q, k, v, mask)) <= 1e-5
    assert np.all(out[1, :, 7] == 0)

    bias = rng.standard_normal((1, 1, 40, 50)).astype(np.float32)  # additive float mask
    out = np.asarray(jax.jit(xla_attention)(q, k, v, jnp.asarray(bias)))
    assert relative_error(out, reference_attention(q, k, v, bias=bias)) <= 1e-5
