"""The Hugging Face Hub, reached once: a name that is no local path is a Hub id, and when the Hub cannot be reached
the process goes offline at once (a cached copy still loads; a missing one is one line, not 25 s of retries)."""
from __future__ import annotations

import functools
import socket
from pathlib import Path
from urllib.parse import urlparse

from . import env
from .paths import local_or_hub


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host (HF_ENDPOINT) takes a TCP connection within `timeout` s: one probe per process."""
    url = urlparse(env.hub_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def offline_unless_hub_reachable(name: str) -> bool:
    """For a Hub id: when the Hub cannot be reached, switch huggingface_hub (and datasets) to offline mode, so a
    cached copy still loads and a missing one fails at once instead of after ~25 s of retries. True when offline.
    Done by hand: neither library probes once; each request retries on its own."""
    if Path(local_or_hub(name)).exists():
        return False
    import huggingface_hub.constants as hub
    if hub.HF_HUB_OFFLINE:
        return True
    if hub_reachable():
        return False
    env.export("HF_HUB_OFFLINE", "1")  # for processes started from here (tokenization workers)
    hub.HF_HUB_OFFLINE = True  # read by huggingface_hub.is_offline_mode(), which transformers asks
    try:
        import datasets.config
        datasets.config.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    return True
