"""Test setup: 8 virtual CPU devices (set before JAX is imported) and a private preset cache."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory):
    """Presets are materialized once per test session, in a temp folder (inherited by subprocesses)."""
    path = tmp_path_factory.mktemp("preset-cache")
    os.environ["TPU_VIDEO_CACHE"] = str(path)
    return path


@pytest.fixture(autouse=True)
def harmless_warnings_filtered():
    """The stages' own warning filter (workarounds.warning_filters), also for tests that call library code directly."""
    from workarounds.warning_filters import filter_harmless_warnings

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
