#!/usr/bin/env python
"""Exactness of key masking in Splash attention over a padding sweep, printed as JSON lines.

For each fraction of padded keys: the relative error (vs float64 exact masked attention) of
  - zero_kv: padded K and V set to zero, no mask (the reference notes' approach),
  - splash_segment_ids: our backend (splash_attention.splash_attention, segment-id masking).
With --time (meant for a TPU): median seconds of masked vs unmasked Splash at the same shape, and the ratio.
With --k_smoothing: the same masked Splash in bf16 with and without `--k_smoothing`, keys sharing a
common offset of --key_offset (a random direction of that norm), against float64 on the same bf16 inputs.

    python benchmarks/attention_exactness.py               # CPU: Pallas interpret mode, errors only
    python benchmarks/attention_exactness.py --time --seq 16384 --heads 16 --head_dim 128   # on a TPU VM
    python benchmarks/attention_exactness.py --k_smoothing --key_offset 8    # what K-smoothing buys in bf16
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from splash_attention import splash_attention  # noqa: E402
from tpu_video.attention.plan import SplashConfig  # noqa: E402
from tpu_video.attention.reference import reference_attention  # noqa: E402


def exact_attention(q, k, v, key_valid):
    return reference_attention(q, k, v, key_valid[:, None, None, :])


def relative_error(actual, expected) -> float:
    return float(np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected))


def bf16_errors(q, k, v, key_valid, config, key_offset: float, rng) -> dict:
    """Masked Splash in bf16, plain and with K-smoothing, against float64 on the same bf16-rounded inputs;
    every key shares one offset vector of norm `key_offset` (the case smoothing is for)."""
    import dataclasses

    direction = rng.standard_normal(k.shape[-1])
    k = k + key_offset * direction / np.linalg.norm(direction)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    expected = exact_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), key_valid)
    found = {"key_offset": key_offset}
    for smoothing in (False, True):
        variant = dataclasses.replace(config, k_smoothing=smoothing)
        out = jax.jit(lambda q, k, v, m, c=variant: splash_attention(q, k, v, m, config=c))(q, k, v, key_valid)
        found[f"bf16_error_k_smoothing_{'on' if smoothing else 'off'}"] = relative_error(out, expected)
    return found


def median_seconds(fn, *args, repeats=5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--padding", default="0,0.1,0.4,0.6,0.9,0.99", help="comma-separated padded fractions")
    parser.add_argument("--time", action="store_true", help="also time masked vs unmasked Splash (TPU)")
    parser.add_argument("--k_smoothing", action="store_true", help="also bf16 errors with and without K-smoothing")
    parser.add_argument("--key_offset", type=float, default=8.0, help="norm of the keys' common offset")
    args = parser.parse_args()

    on_tpu = jax.devices()[0].platform == "tpu"
    config = SplashConfig(block_q=512, block_kv=512, block_kv_compute=512 if on_tpu else 128, interpret=not on_tpu)
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    attend = jax.jit(lambda q, k, v, m: splash_attention(q, k, v, m, config=config))
    for fraction in (float(f) for f in args.padding.split(",")):
        valid = int(round(args.seq * (1 - fraction)))
        key_valid = np.arange(args.seq)[None, :] < valid
        expected = exact_attention(q, k, v, key_valid)
        zeroed = exact_attention(
            q, k * key_valid[:, None, :, None], v * key_valid[:, None, :, None], np.ones_like(key_valid)
        )
        ours = attend(q, k, v, jnp.asarray(key_valid))
        row = {
            "padded_fraction": fraction,
            "valid_keys": valid,
            "keys": args.seq,
            "zero_kv_error": relative_error(zeroed, expected),
            "splash_segment_ids_error": relative_error(ours, expected),
            "platform": jax.devices()[0].platform,
        }
        if args.k_smoothing:
            row.update(bf16_errors(q, k, v, key_valid, config, args.key_offset, rng))
        if args.time:
            unmasked = jax.jit(lambda q, k, v: splash_attention(q, k, v, None, config=config))
            masked_s = median_seconds(attend, q, k, v, jnp.asarray(key_valid))
            unmasked_s = median_seconds(unmasked, q, k, v)
            row.update(masked_seconds=masked_s, unmasked_seconds=unmasked_s, masked_over_unmasked=masked_s / unmasked_s)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
