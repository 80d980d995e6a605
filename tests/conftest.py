"""Test setup: 8 virtual CPU devices and unoptimised CPU code generation (set before JAX is imported), one
torch thread per process, one private cache per run shared by the xdist workers, library loggers bound
before any test captures stderr, the slow tests scheduled first, and the fixtures several test modules
share."""

import os
import sys
from pathlib import Path

# LLVM optimisation off for XLA:CPU's generated code: the same HLO and results, compiled faster; the suite
# took 956 s instead of 1175 s under `-n 2` on 2026-11-26 (docs/performance.md). The TPU compiler ignores it
# (a plan's report was identical with and without it).
# XLA:CPU's newer fusion emitters off as well: the legacy emitters compile the same programs in about half the
# time (tests/test_wan.py: 23.9 -> 11.8 s of compiling, 47.7 -> 32.1 s in all, on 2026-11-27).
CPU_CODEGEN = " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + CPU_CODEGEN + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenMP thread per process for torch: the xdist workers already keep every core busy, and OpenMP's
# threads spin while they wait for a core another worker holds. tests/test_ltx2.py with
# tests/test_wan_animate.py under `-n 2` took 115-124 s instead of 151-168 s (2026-11-28,
# docs/performance.md). Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# diffusers and transformers give their loggers a StreamHandler on sys.stderr when first imported. Imported
# inside a test that uses capsys, the handler keeps that test's stream, which pytest closes afterwards, and a
# later library warning prints "--- Logging error ---" with a traceback into whichever test is running then.
# Imported here, before any test, the handlers write to the session's stderr.
import diffusers  # noqa: E402, F401
import pytest  # noqa: E402
import transformers  # noqa: E402, F401


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory):
    """Presets (and JAX's compilation cache) live in a temp folder for the whole run, inherited by
    subprocesses. Under xdist the workers share it: presets are published atomically, so the first worker
    to need one builds it and the other reads it."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tpu-video-cache"
    path.mkdir(exist_ok=True)
    os.environ["TPU_VIDEO_CACHE"] = str(path)
    return path


def pytest_collection_modifyitems(config, items):
    """Slow tests first, so that under xdist no long test starts last and keeps one worker busy alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def harmless_warnings_filtered():
    """The stages' own warning filter (workarounds.warning_filters), also for tests that call library code directly."""
    from tpu_video.workarounds.warning_filters import filter_harmless_warnings

    filter_harmless_warnings()


BLOCKER = "raise ImportError('jax is blocked for this test: stage 1 and stage 3 --backend torch must not need it')\n"


@pytest.fixture
def jax_blocked(tmp_path):
    """A PYTHONPATH folder whose jax, jaxlib and torchax packages raise ImportError when imported."""
    folder = tmp_path / "blocked"
    for name in ("jax", "jaxlib", "torchax"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(BLOCKER)
    return folder


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """For "refused before loading" tests: any component load (models.ModelSource.load, the one path to
    `from_pretrained`) fails the test."""
    from tpu_video import models

    def refuse(self, component, dtype=None):
        raise AssertionError(f"{component} was loaded before the refusal")

    monkeypatch.setattr(models.ModelSource, "load", refuse)


@pytest.fixture(scope="session")
def four_layer_cogvideox(tmp_path_factory):
    """A tiny CogVideoX 1.5 pipeline folder with 4 transformer blocks (the interval cache needs 3 or more)."""
    from tpu_video.models import cogvideox

    folder = tmp_path_factory.mktemp("cogvideox-4-layers")
    cogvideox.presets.tiny_pipeline("1.5", num_layers=4).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def four_block_ltx2(tmp_path_factory):
    """tiny-ltx2.3's folder with a 4-block transformer (the interval cache needs 3 or more blocks)."""
    import shutil

    from tpu_video import models
    from tpu_video.models.ltx2.presets import tiny_transformer

    folder = tmp_path_factory.mktemp("ltx2.3-4-blocks") / "model"
    shutil.copytree(models.materialize_preset("tiny-ltx2.3"), folder)
    shutil.rmtree(folder / "transformer")
    tiny_transformer(5, "2.3", num_layers=4).save_pretrained(folder / "transformer")
    return folder
