"""The torch 2.13 / torchax 0.0.13 import workaround: needed today, harmless, and reversible."""

import subprocess
import sys

import torch

from torchax_compat import MISSING_OVERLOADS, import_torchax, tolerate_missing_overloads


def test_plain_torchax_import_still_fails_without_the_shim():
    """Fails loudly once torchax imports cleanly on this torch: then delete torchax_compat.py."""
    result = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True)
    assert result.returncode != 0, "torchax now imports without the shim: remove torchax_compat.py and this test"
    assert "has no overload name" in result.stderr and "Dimname" in result.stderr


def test_shimmed_import_works_and_names_what_was_missing():
    torchax = import_torchax()
    assert any("Dimname" in name for name in MISSING_OVERLOADS)
    with torchax.default_env():
        total = (torch.arange(4.0, device="jax") * 2).sum().to("cpu")
    assert float(total) == 12.0


def test_shim_restores_normal_lookup_after_the_block():
    with tolerate_missing_overloads() as missing:
        placeholder = torch.ops.aten.prod.dim_Dimname
    assert missing == ["aten::prod.dim_Dimname"] and not callable(placeholder)
    try:
        _ = torch.ops.aten.prod.dim_Dimname
    except AttributeError:
        pass
    else:
        raise AssertionError("the overload lookup was not restored")
    assert torch.ops.aten.prod.default is not None
