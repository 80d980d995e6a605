"""Library warnings known to be harmless here, hidden by exact message start (Python warnings) or pattern (log
records of one named library logger); nothing else is hidden. The stages call `filter_harmless_warnings`
first thing (and the tests, for library code called directly).
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
    # diffusers 0.42 passes huggingface_hub's deprecated `local_dir_use_symlinks="auto"` on every config read
    # from the hub; the hub ignores it (tests/test_upstream_bugs.py).
    (UserWarning, "The `local_dir_use_symlinks` argument is deprecated and ignored in "),
)


HARMLESS_LOG_RECORDS = (
    # transformers 5 without torchvision (not a dependency) takes the PIL image processors, which the
    # diffusers pipelines we compare with take too; it says so once per class.
    (
        "transformers.utils.import_utils",
        r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil`",
    ),
    # diffusers 0.42 says this each time a guider is built (HunyuanVideo-1.5's pipelines build them).
    ("diffusers.guiders.guider_utils", r"Guiders are currently an experimental feature"),
)


def filter_harmless_warnings() -> None:
    """Hide exactly the HARMLESS_WARNINGS and HARMLESS_LOG_RECORDS, and transformers' progress bars (the
    stages call this first thing)."""
    import logging
    import re
    import warnings

    _quiet_transformers_bars()

    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name, pattern in HARMLESS_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(getattr(existing, "pattern", None) == pattern for existing in logger.filters):
            logger.addFilter(_HiddenRecords(pattern))


class _HiddenRecords:
    """A logging filter dropping the records whose message matches `pattern` at its start."""

    def __init__(self, pattern: str) -> None:
        import re

        self.pattern = pattern
        self._compiled = re.compile(pattern)

    def filter(self, record) -> bool:
        return self._compiled.match(record.getMessage()) is None


def _quiet_transformers_bars() -> None:
    """transformers 5 draws a bar for every model it loads ("Loading weights", also while a module is built on
    the meta device) and saves ("Writing model shards": a tiny preset built on first use); the stages log what
    loading took, and placing a large model has its own bar. Its switch also turns off huggingface_hub's
    download bars, which a first run of a published model needs: those are turned back on unless the user had
    them off (HF_HUB_DISABLE_PROGRESS_BARS)."""
    import transformers.utils.logging
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    downloads_quiet = are_progress_bars_disabled()
    transformers.utils.logging.disable_progress_bar()
    if not downloads_quiet:
        enable_progress_bars()
