"""Whether the Hugging Face hub can be reached, and the HF libraries switched to offline mode where it cannot, so
that a hub name fails at once instead of retrying for a minute (the reference machines reach no hub)."""
from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import urllib.parse

HUB_PROBE_TIMEOUT_S = 3.0


def hub_reachable() -> bool:
    """Whether a TCP connection to the hub (or the https proxy) opens within a few seconds."""
    return _probe(os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
                  or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


@functools.lru_cache(maxsize=None)
def _probe(url: str) -> bool:
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    opened = []

    def connect():
        with contextlib.suppress(OSError):
            socket.create_connection((parsed.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            opened.append(True)

    # A thread, because name resolution has no timeout of its own.
    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_PROBE_TIMEOUT_S)
    return bool(opened)


@contextlib.contextmanager
def hub_offline_if_unreachable():
    """Yield whether the hub is reachable; when it is not, switch the HF libraries to offline mode
    inside the block, so they answer from their cache or fail at once instead of retrying for a minute."""
    import huggingface_hub.constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE:
        yield False
        return
    if hub_reachable():
        yield True
        return
    datasets_config = sys.modules.get("datasets.config")
    saved = hub_constants.HF_HUB_OFFLINE, getattr(datasets_config, "HF_HUB_OFFLINE", None)
    hub_constants.HF_HUB_OFFLINE = True
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    try:
        yield False
    finally:
        hub_constants.HF_HUB_OFFLINE = saved[0]
        if datasets_config is not None:
            datasets_config.HF_HUB_OFFLINE = saved[1]
