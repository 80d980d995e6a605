"""Library warnings known to be harmless here, hidden by exact message start; nothing else is hidden.
The stages call `filter_harmless_warnings` first thing (and the tests, for library code called directly).
"""

from __future__ import annotations

HARMLESS_WARNINGS = (
    # jax without x64 narrows torch's int64 tensors (timesteps, token ids) to int32; values stay small.
    (UserWarning, "Explicitly requested dtype int64 requested in "),
    # JAX warns on any fork; imageio-ffmpeg's subprocess forks and immediately execs ffmpeg.
    (RuntimeWarning, "os.fork() was called. os.fork() is incompatible with multithreaded code"),
    # Wan's rotary embedding writes fp32 products into a bf16 tensor (`out[..., 0::2] = ...`); torch casts
    # on assignment and JAX 0.10 does the same cast (round to nearest), warning that a future JAX will
    # refuse it. jax is pinned; revisit when it is upgraded.
    (
        FutureWarning,
        "scatter inputs have incompatible types: cannot safely cast value from dtype=float32 to dtype=bfloat16",
    ),
)


def filter_harmless_warnings() -> None:
    """Hide exactly the HARMLESS_WARNINGS (the stages call this first thing)."""
    import re
    import warnings

    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
