"""Reading a model's model_index.json: a local folder's, the Hugging Face cache's, or the hub's; a hub that
cannot be reached is one line at once, not the hub client's retries."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tpu_video.cli import UserError


def read_model_index(model: str, location: str) -> dict[str, Any]:
    """`--model`'s model_index.json: the folder's, else the Hugging Face cache's (read without asking the hub),
    else the hub's where the hub can be reached."""
    if os.path.isdir(location):
        path = Path(location) / "model_index.json"
        if not path.is_file():
            raise UserError(f"--model {model!r}: {path} is missing (not a diffusers pipeline folder)")
        return json.loads(path.read_text())
    from diffusers import DiffusionPipeline
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(location, "model_index.json")
    if isinstance(cached, str):  # downloaded before: read it without asking the hub
        return json.loads(Path(cached).read_text())
    check_hub_reachable(model)
    try:
        return DiffusionPipeline.load_config(location)
    except Exception as err:  # the hub client raises many types; any of them means "cannot fetch"
        raise UserError(
            f"--model {model!r}: cannot read model_index.json from the hub ({type(err).__name__})"
        ) from None


def check_hub_reachable(model: str) -> None:
    """A hub id not in the Hugging Face cache, on a host that cannot resolve the hub's name (offline, or no
    DNS): one line now, instead of the hub client's retries (about 30 s of them) and then the same error."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--model {model!r} is not in the Hugging Face cache, and HF_HUB_OFFLINE is set")
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        raise UserError(
            f"--model {model!r}: not a preset or a local folder, not in the Hugging Face cache, and {host} cannot "
            "be reached from this host (offline?); give a local diffusers folder or a preset"
        ) from None
