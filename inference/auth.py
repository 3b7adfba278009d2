"""API keys of the inference servers, by URL: every HTTP call PettingFlow makes to a server takes its header here.

Why a registry: a server that listens beyond loopback is reachable by anyone on the network, and vLLM's API key
is what keeps strangers from generating with it or loading adapters into it. The key is made per run
(``new_key``) when the runtime starts such a server, or read from the environment variable the config names
for attached servers (``inference.api_key_env``); it is never written to a run's files. Every caller (the rollout
client, weight sync, health and readiness checks) asks ``headers(url)``, so none of them can forget it.

A managed server gets its key in its environment (``VLLM_API_KEY``, ``inference/server.py``), never as
``--api-key KEY``: an argument is in every local user's process list, and a key that begins with "-" (about one in
64 of ``new_key``'s, whose URL-safe alphabet has "-") is read by argparse as an option, so vLLM would not start.

vLLM's key guards the routes under ``/v1`` (generation, models, LoRA adapters) but not the dev-mode routes that
reload full weights (``/collective_rpc``, ``/sleep``): the config therefore refuses dev mode beyond loopback
(``configs/settings.py``, ``inference.host``).
"""

from __future__ import annotations

import secrets
import threading

_KEYS: dict[str, str] = {}
_LOCK = threading.Lock()


def _root(url: str) -> str:
    """``http://h:p`` for ``http://h:p``, ``http://h:p/`` and ``http://h:p/v1/...``."""
    url = url.rstrip("/")
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    return f"{scheme}{sep}{host}"


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def register(url: str, key: str | None) -> None:
    """Requests to the server at ``url`` carry ``key`` from now on (None: none)."""
    with _LOCK:
        if key:
            _KEYS[_root(url)] = key
        else:
            _KEYS.pop(_root(url), None)


def key_for(url: str) -> str | None:
    with _LOCK:
        return _KEYS.get(_root(url))


def headers(url: str) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` for a server with a key, else ``{}``."""
    key = key_for(url)
    return {"Authorization": f"Bearer {key}"} if key else {}
