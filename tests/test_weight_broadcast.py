"""The weight-broadcast protocol on CPU (gloo): metadata checks, ack before data, tensors in order, loading.

vLLM is not started here. A stand-in worker (``WeightReceiverExtension`` mixed into an object with a
``model_runner.model`` that has ``load_weights``) is driven either in a thread of this process or, for the
HTTP path, behind a tiny fake ``/collective_rpc`` server in a child process with two worker ranks (world
size 3, like a tensor-parallel-2 server). Everything uses loopback. The NCCL communicator needs CUDA and
vLLM's CUDA build and is only smoke-tested where a CUDA device exists.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

from pettingflow.inference.weight_broadcast import (
    WeightBroadcaster,
    WeightBroadcastError,
    WeightReceiverExtension,
    check_metadata,
    expected_checkpoint_names,
    weight_broadcast_server_args,
)

MODEL_SRC = '''
import torch


class TinyModel(torch.nn.Module):
    """vLLM-like: q_proj and k_proj of the checkpoint are fused into one qk_proj parameter."""

    packed_modules_mapping = {"qk_proj": ["q_proj", "k_proj"]}

    def __init__(self, fail_at: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.qk_proj = torch.nn.Linear(4, 8, bias=False)
        self.out = torch.nn.Linear(4, 4)
        self.order: list[str] = []
        self.fail_at = fail_at

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name == self.fail_at:
                    raise ValueError(f"simulated load failure at {name}")
                self.order.append(name)
                if name in ("q_proj.weight", "k_proj.weight"):
                    rows = slice(0, 4) if name.startswith("q") else slice(4, 8)
                    self.qk_proj.weight[rows].copy_(tensor)
                else:
                    params[name].copy_(tensor)  # KeyError for an unknown name, like vLLM's loaders


class Runner:
    def __init__(self, model):
        self.model = model


class FakeWorker:
    def __init__(self, rank: int, fail_at: str | None = None) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = Runner(TinyModel(fail_at))
'''
_NS: dict[str, Any] = {}
exec(compile(MODEL_SRC, "<tiny-model>", "exec"), _NS)  # the same source runs in the fake server's child process
TinyModel: Any = _NS["TinyModel"]
FakeWorker: Any = _NS["FakeWorker"]


class Worker(FakeWorker, WeightReceiverExtension):  # type: ignore[misc,valid-type]
    """What vLLM builds with --worker-extension-cls: the worker class with the extension as a base."""


def new_weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Checkpoint-format weights: q_proj/k_proj separate, values that differ from TinyModel's init."""
    g = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(10, 4, generator=g) * scale,
        "q_proj.weight": torch.full((4, 4), 1.5),
        "k_proj.weight": torch.full((4, 4), -2.0),
        "out.weight": torch.eye(4) * 3,
        "out.bias": torch.arange(4, dtype=torch.float32),
    }


def local_rpc(workers: list[Any]):
    """An ``rpc`` that calls the workers in threads of this process, like collective_rpc does across processes."""

    def call(method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * len(workers)

        def run(i: int) -> None:
            results[i] = getattr(workers[i], method)(**kwargs)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        return results

    return call


# ---------------------------------------------------------------------------------------------- pure checks
def test_expected_names_expand_fused_parameters_and_keep_exact_shapes() -> None:
    names = expected_checkpoint_names(TinyModel())
    assert set(names) == {"embed.weight", "q_proj.weight", "k_proj.weight", "out.weight", "out.bias"}
    assert names["out.weight"] == (4, 4)
    assert names["q_proj.weight"] is None  # a slice of a fused parameter: vLLM's loader checks the shape


def test_check_metadata_names_every_problem() -> None:
    expected = expected_checkpoint_names(TinyModel())
    ok = check_metadata(["out.weight"], ["float32"], [[4, 4]], expected=expected, model_dtype=torch.float32)
    assert ok == []
    problems = check_metadata(
        ["out.wieght", "out.weight", "out.bias", "embed.weight"],
        ["float32", "float32", "bfloat16", "complex_float"],
        [[4, 4], [3, 4], [4], [10, 4]],
        expected=expected,
        model_dtype=torch.float32,
    )
    text = "\n".join(problems)
    assert "out.wieght" in text and "no parameter for" in text
    assert "out.weight: shape [3, 4] but the served parameter is [4, 4]" in text
    assert "out.bias: sent as bfloat16 but the server runs float32" in text
    assert "'complex_float' is not a torch dtype" in text
    assert check_metadata(["a"], ["float32"], [], expected=None, model_dtype=None)[0].startswith("names, dtypes")


def test_server_args_name_an_importable_extension() -> None:
    import importlib

    flag, qualname = weight_broadcast_server_args()
    module, _, cls = qualname.rpartition(".")
    assert flag == "--worker-extension-cls"
    assert getattr(importlib.import_module(module), cls) is WeightReceiverExtension


# ---------------------------------------------------------------------------------------------- in-process protocol
def test_push_loads_tensors_in_order_into_the_model() -> None:
    worker = Worker(rank=0)
    weights = new_weights()
    with WeightBroadcaster("http://unused", backend="gloo", rpc=local_rpc([worker]), timeout_s=30) as wb:
        assert wb.server_dtype == torch.float32
        report = wb.push(list(weights.items()), reset_prefix_cache=lambda: None)
    model = worker.model_runner.model
    assert model.order == list(weights)  # received and loaded in the announced order
    assert torch.equal(model.embed.weight, weights["embed.weight"])
    assert torch.equal(model.qk_proj.weight[:4], weights["q_proj.weight"])
    assert torch.equal(model.qk_proj.weight[4:], weights["k_proj.weight"])
    assert torch.equal(model.out.bias, weights["out.bias"])
    assert report.tensors == 5 and report.bytes == sum(t.numel() * 4 for t in weights.values())
    assert report.worker_results[0]["count"] == 5
    assert worker._pf_comm is None  # close() made the worker leave the group


def test_push_casts_to_the_server_dtype() -> None:
    worker = Worker(rank=0)
    weights = {k: v.to(torch.bfloat16) for k, v in new_weights().items()}
    with WeightBroadcaster("http://unused", backend="gloo", rpc=local_rpc([worker]), timeout_s=30) as wb:
        wb.push(weights, reset_prefix_cache=lambda: None)
        with pytest.raises(WeightBroadcastError, match="sent as bfloat16 but the server runs float32"):
            wb.push(weights, cast_to_server_dtype=False, reset_prefix_cache=lambda: None)
    assert worker.model_runner.model.out.weight.dtype == torch.float32
    assert torch.equal(worker.model_runner.model.out.weight, weights["out.weight"].float())


def test_wrong_name_is_refused_before_anything_is_loaded_and_the_group_survives() -> None:
    worker = Worker(rank=0)
    before = {k: v.clone() for k, v in worker.model_runner.model.state_dict().items()}
    bad = {**new_weights(), "out.wieght": torch.zeros(4, 4)}
    with WeightBroadcaster("http://unused", backend="gloo", rpc=local_rpc([worker]), timeout_s=30) as wb:
        with pytest.raises(WeightBroadcastError, match=r"refused the update \(nothing was loaded\)") as info:
            wb.push(bad, reset_prefix_cache=lambda: None)
        assert "out.wieght" in str(info.value) and "no parameter for" in str(info.value)
        after = worker.model_runner.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert worker.model_runner.model.order == []
        wb.push(new_weights(), reset_prefix_cache=lambda: None)  # the same group still works
    assert torch.equal(worker.model_runner.model.out.weight, new_weights()["out.weight"])


def test_a_load_failure_mid_stream_is_reported_without_hanging() -> None:
    worker = Worker(rank=0, fail_at="k_proj.weight")
    started = time.monotonic()
    wb = WeightBroadcaster("http://unused", backend="gloo", rpc=local_rpc([worker]), timeout_s=300)
    with wb, pytest.raises(WeightBroadcastError, match=re.escape("simulated load failure at k_proj.weight")):
        wb.push(new_weights(), reset_prefix_cache=lambda: None)
    # the worker drained the remaining broadcasts: the push returned well before its deadline (a generous margin,
    # not a speed bound: it takes about a second)
    assert time.monotonic() - started < 200
    assert worker.model_runner.model.order == ["embed.weight", "q_proj.weight"]


def test_push_before_connect_and_unknown_backend_raise_clear_errors() -> None:
    with pytest.raises(WeightBroadcastError, match="call connect"):
        WeightBroadcaster("http://unused", backend="gloo", rpc=local_rpc([])).push(new_weights())
    with pytest.raises(WeightBroadcastError, match="'nccl' \\(GPU\\) or 'gloo' \\(CPU\\)"):
        WeightBroadcaster("http://unused", backend="mpi")  # type: ignore[arg-type]
    worker = Worker(rank=0)
    assert worker.receive_weights(["out.bias"], ["float32"], [[4]])["error"].startswith("no weight group")


# ---------------------------------------------------------------------------------------------- across processes, HTTP
SERVER_SRC = (
    MODEL_SRC
    + """
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pettingflow.inference.weight_broadcast import WeightReceiverExtension

n_workers, with_extension = int(sys.argv[1]), sys.argv[2] == "1"
base = (FakeWorker, WeightReceiverExtension) if with_extension else (FakeWorker,)
Worker = type("Worker", base, {})
workers = [Worker(rank) for rank in range(n_workers)]
resets = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # /state: what each worker serves now
        state = [
            {k: v.tolist() for k, v in w.model_runner.model.state_dict().items()}
            | {"_order": w.model_runner.model.order}
            for w in workers
        ]
        self.reply(200, {"workers": state, "resets": len(resets)})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        if self.path == "/reset_prefix_cache":
            resets.append(1)
            return self.reply(200, b"")
        method, kwargs = body["method"], body.get("kwargs", {})
        if not hasattr(workers[0], method):  # what vLLM answers: the engine raises, the route gives HTTP 500
            return self.reply(500, b"Internal Server Error")
        results = [None] * n_workers

        def run(i):
            results[i] = getattr(workers[i], method)(**kwargs)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_workers)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        self.reply(200, {"results": results})


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
)


@pytest.fixture
def fake_server(request: pytest.FixtureRequest):
    """A child process serving /collective_rpc for ``n`` stand-in workers; yields its URL."""
    n_workers, with_extension = getattr(request, "param", (2, True))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SERVER_SRC), str(n_workers), "1" if with_extension else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            proc.kill()
            raise RuntimeError(f"fake server did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def served_state(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{url}/state", timeout=10).json()


def test_two_workers_in_another_process_receive_the_same_weights_over_http(fake_server: str) -> None:
    weights = new_weights(scale=2.0)
    with WeightBroadcaster(fake_server, backend="gloo", timeout_s=30) as wb:
        assert len(wb.workers) == 2  # world size 3: learner rank 0, workers 1 and 2
        report = wb.push(weights)
        with pytest.raises(WeightBroadcastError, match=re.escape("out.wieght")):
            wb.push({"out.wieght": torch.zeros(4, 4)})
    state = served_state(fake_server)
    assert state["resets"] == 1  # prefix cache reset after the successful push only
    for worker in state["workers"]:
        assert worker["_order"] == list(weights)
        assert torch.equal(torch.tensor(worker["embed.weight"]), weights["embed.weight"])
        qk = torch.tensor(worker["qk_proj.weight"])
        assert torch.equal(qk[:4], weights["q_proj.weight"]) and torch.equal(qk[4:], weights["k_proj.weight"])
    assert [r["rank"] for r in report.worker_results] == [1, 2]
    assert json.dumps(report.worker_results)  # what vLLM's route passes through must be JSON


@pytest.mark.parametrize("fake_server", [(1, False)], indirect=True)
def test_a_server_without_the_extension_gets_a_hint(fake_server: str) -> None:
    hint = re.escape("--worker-extension-cls pettingflow.inference.weight_broadcast.WeightReceiverExtension")
    with pytest.raises(WeightBroadcastError, match=hint):
        WeightBroadcaster(fake_server, backend="gloo", timeout_s=10).connect()


# ---------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs CUDA and two GPUs (two ranks may not share one GPU); not run on the CPU machine",
)
def test_nccl_push_between_two_gpus() -> None:
    worker = Worker(rank=0)
    worker.device = torch.device("cuda:1")
    worker.model_runner.model.to(worker.device)
    weights = new_weights()
    with WeightBroadcaster("http://unused", backend="nccl", device="cuda:0", rpc=local_rpc([worker])) as wb:
        wb.push(weights, reset_prefix_cache=lambda: None)
    assert torch.equal(worker.model_runner.model.out.weight.cpu(), weights["out.weight"])


def test_the_worker_releases_free_memory_and_reports_it_without_raising(monkeypatch) -> None:
    """The RPC a managed server's workers run after each full reload: it returns what it released, and a failure
    comes back as a result (a raising RPC could kill vLLM's engine)."""
    from pettingflow import allocator

    done = WeightReceiverExtension().release_free_memory()
    assert done["ok"] and done["by"] in ("tcmalloc", "glibc", "none") and done["rss_mb_after"] > 0
    monkeypatch.setattr(allocator, "release_free_memory", lambda: 1 / 0)
    failed = WeightReceiverExtension().release_free_memory()
    assert not failed["ok"] and "release_free_memory: ZeroDivisionError" in failed["error"]
