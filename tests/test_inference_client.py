"""InferenceClient against a scripted fake OpenAI-compatible server on loopback (no vLLM needed).

The fake is a ``ThreadingHTTPServer`` on port 0: one thread per connection, so it can observe how many
requests are in flight at once. Each test scripts its answers with a function of (request number, body).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pettingflow.inference.client import Completion, InferenceClient, InferenceError, normalize_base_url
from pettingflow.processes import free_port


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # dict -> JSON; bytes -> sent raw; None -> a valid completion for the request
    delay_s: float = 0.0
    # held until this many requests have been in flight at once (backstop: HOLD_BACKSTOP_S): forces the overlap a
    # test needs instead of hoping the machine's load lets the requests arrive within ``delay_s`` of each other
    hold_for: int = 0


HOLD_BACKSTOP_S = 60.0


def completion_body(request: dict[str, Any], order: list[int] | None = None) -> dict[str, Any]:
    """A vLLM-shaped /v1/completions answer: choice i has ids [100i+1, ...] and log-probs -0.1*(k+1)."""
    n = int(request.get("n", 1))
    length = min(int(request.get("max_tokens", 3)), 3)
    choices = []
    for i in order or range(n):
        ids = [100 * i + k + 1 for k in range(length)]
        choices.append(
            {
                "index": i,
                "text": "".join(f"<{t}>" for t in ids),
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.1 * (k + 1) for k in range(length)], "tokens": ["x"] * length},
                "finish_reason": "length",
                "prompt_token_ids": request.get("prompt"),
            }
        )
    return {"id": "cmpl-fake", "object": "text_completion", "model": request.get("model"), "choices": choices}


class FakeOpenAI:
    """Scripted /v1/completions + /health server; records requests and the peak number in flight."""

    def __init__(self, script: Callable[[int, dict[str, Any]], Reply]):
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._peak = threading.Condition(self._lock)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._send(Reply(200, {"status": "ok"}) if self.path == "/health" else Reply(404, {"detail": "nf"}))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw or b"{}")
                with fake._lock:
                    number = len(fake.requests)
                    fake.requests.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    fake._peak.notify_all()
                try:
                    reply = fake.script(number, body)
                    if reply.hold_for:
                        with fake._peak:
                            fake._peak.wait_for(lambda: fake.max_in_flight >= reply.hold_for, HOLD_BACKSTOP_S)
                    if reply.delay_s:
                        time.sleep(reply.delay_s)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                if reply.body is None and reply.status == 200:
                    reply.body = completion_body(body)
                self._send(reply)

            def _send(self, reply: Reply) -> None:
                data = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[Callable[[Callable[[int, dict[str, Any]], Reply]], FakeOpenAI]]:
    servers: list[FakeOpenAI] = []

    def make(script: Callable[[int, dict[str, Any]], Reply]) -> FakeOpenAI:
        servers.append(FakeOpenAI(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def client_for(url: str, **kwargs: Any) -> InferenceClient:
    kwargs.setdefault("backoff_initial_s", 0.01)
    kwargs.setdefault("backoff_max_s", 0.05)
    return InferenceClient(url, **kwargs)


async def _complete(client: InferenceClient, **kwargs: Any) -> list[Completion]:
    async with client:
        return await client.complete([1, 2, 3], model="m", max_tokens=3, **kwargs)


def test_success_returns_ids_logprobs_and_sends_token_prompt(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply())
    client = client_for(fake.url + "/v1/")
    [c] = asyncio.run(_complete(client, temperature=0.7, top_p=0.9, top_k=5, stop=["\n"], seed=11))
    assert isinstance(c, Completion)
    assert (c.token_ids, c.finish_reason, c.text) == ([1, 2, 3], "length", "<1><2><3>")
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    [req] = fake.requests
    assert req["prompt"] == [1, 2, 3]
    assert req["logprobs"] == 1 and req["return_token_ids"] is True
    assert (req["temperature"], req["top_p"], req["top_k"], req["stop"], req["seed"]) == (0.7, 0.9, 5, ["\n"], 11)
    assert req["model"] == "m" and req["max_tokens"] == 3 and req["n"] == 1
    assert "ignore_eos" not in req


def test_500_then_success_is_retried(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(500, {"error": {"message": "engine hiccup"}}) if i == 0 else Reply())
    [c] = asyncio.run(_complete(client_for(fake.url, max_retries=3)))
    assert c.token_ids == [1, 2, 3]
    assert len(fake.requests) == 2


def test_persistent_500_gives_final_error_with_url_attempts_and_cause(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(503, {"error": {"message": "EngineCore died"}}))
    with pytest.raises(InferenceError) as info:
        asyncio.run(_complete(client_for(fake.url, max_retries=2)))
    err = info.value
    assert len(fake.requests) == 3
    assert err.attempts == 3 and err.status_code == 503
    msg = str(err)
    assert f"{fake.url}/v1/completions" in msg and "3 attempt(s)" in msg
    assert "HTTP 503" in msg and "EngineCore died" in msg


def test_retries_back_off_exponentially(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(500, {"error": {"message": "x"}}))
    client = InferenceClient(fake.url, max_retries=2, backoff_initial_s=0.2, backoff_max_s=5.0)
    started = time.perf_counter()
    with pytest.raises(InferenceError):
        asyncio.run(_complete(client))
    elapsed = time.perf_counter() - started
    # waits: 0.2 and 0.4 s, each plus up to 0.2 s of jitter (a lower bound only: load can only add time)
    assert elapsed >= 0.6, elapsed


def test_timeout_is_retried_then_reported(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(delay_s=1.5))
    with pytest.raises(InferenceError) as info:
        asyncio.run(_complete(client_for(fake.url, timeout_s=0.3, max_retries=1)))
    assert len(fake.requests) == 2 and info.value.attempts == 2
    assert "timed out after 0.3 s" in str(info.value)


def test_refused_connection_is_retried_then_reported() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(InferenceError) as info:
        asyncio.run(_complete(client_for(url, max_retries=2)))
    assert info.value.attempts == 3
    assert "ConnectError" in str(info.value) and url in str(info.value)


def test_malformed_json_is_an_error_and_not_retried(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(200, b"{'choices': oops"))
    with pytest.raises(InferenceError, match="malformed JSON"):
        asyncio.run(_complete(client_for(fake.url)))
    assert len(fake.requests) == 1


def test_400_is_not_retried_and_shows_server_message(fake_server) -> None:
    message = "This model's maximum context length is 2048 tokens"
    fake = fake_server(lambda i, body: Reply(400, {"error": {"message": message, "type": "BadRequestError"}}))
    with pytest.raises(InferenceError) as info:
        asyncio.run(_complete(client_for(fake.url, max_retries=3)))
    assert len(fake.requests) == 1
    assert info.value.status_code == 400 and info.value.attempts == 1
    assert message in str(info.value) and "not retried" in str(info.value)


def test_n_choices_come_back_in_index_order(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(200, completion_body(body, order=[2, 0, 1])))
    out = asyncio.run(_complete(client_for(fake.url), n=3, seed=5))
    assert [c.token_ids[0] for c in out] == [1, 101, 201]
    assert fake.requests[0]["n"] == 3 and fake.requests[0]["seed"] == 5


def test_wrong_number_of_choices_is_an_error(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply(200, completion_body({**body, "n": 1})))
    with pytest.raises(InferenceError, match="1 choices for n=2"):
        asyncio.run(_complete(client_for(fake.url), n=2))


def test_missing_token_ids_names_return_token_ids(fake_server) -> None:
    def script(i: int, body: dict[str, Any]) -> Reply:
        data = completion_body(body)
        del data["choices"][0]["token_ids"]
        return Reply(200, data)

    fake = fake_server(script)
    with pytest.raises(InferenceError, match="return_token_ids"):
        asyncio.run(_complete(client_for(fake.url)))


def test_logprob_count_mismatch_is_an_error(fake_server) -> None:
    def script(i: int, body: dict[str, Any]) -> Reply:
        data = completion_body(body)
        data["choices"][0]["logprobs"]["token_logprobs"].pop()
        return Reply(200, data)

    fake = fake_server(script)
    with pytest.raises(InferenceError, match="3 token ids but 2 log-probs"):
        asyncio.run(_complete(client_for(fake.url)))


@pytest.mark.parametrize("limit", [3, 12])
def test_concurrency_bound_is_respected(fake_server, limit: int) -> None:
    """12 requests: the server never sees more than ``limit`` at once, and does see ``limit`` (each request is held
    until ``limit`` have been in flight together, then 0.2 s more, so that a client that lets more through shows)."""
    fake = fake_server(lambda i, body: Reply(delay_s=0.2, hold_for=limit))

    async def main() -> list[Completion]:
        async with client_for(fake.url, max_concurrency=limit) as client:
            return await asyncio.gather(*(client.complete_one([i + 1], model="m", max_tokens=2) for i in range(12)))

    started = time.perf_counter()
    out = asyncio.run(main())
    elapsed = time.perf_counter() - started
    assert len(out) == 12 and len(fake.requests) == 12
    assert fake.max_in_flight == limit  # the fake can see 12 at once (limit=12 case), so 3 is the client's doing
    assert elapsed >= 0.2 * (12 // limit) - 0.05


def test_complete_one_and_ignore_eos_extra_body(fake_server) -> None:
    fake = fake_server(lambda i, body: Reply())

    async def main() -> Completion:
        async with client_for(fake.url) as client:
            return await client.complete_one([5], model="m", max_tokens=2, ignore_eos=True, extra_body={"min_p": 0.1})

    c = asyncio.run(main())
    assert c.token_ids == [1, 2]
    assert fake.requests[0]["ignore_eos"] is True and fake.requests[0]["min_p"] == 0.1
    with pytest.raises(ValueError, match="one choice"):
        asyncio.run(client_for(fake.url).complete_one([5], model="m", n=2))


def test_one_client_survives_several_event_loops(fake_server) -> None:
    """Prefect tasks may call asyncio.run() per task with one shared client: the pool follows the loop."""
    fake = fake_server(lambda i, body: Reply())
    client = client_for(fake.url)
    for _ in range(2):
        assert asyncio.run(client.complete_one([1], model="m", max_tokens=1)).token_ids == [1]
    assert asyncio.run(client.health()) is True
    asyncio.run(client.aclose())
    asyncio.run(client.aclose())  # idempotent


def test_input_validation() -> None:
    client = InferenceClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(client.complete([], model="m"))
    with pytest.raises(ValueError):
        InferenceClient("http://x", max_concurrency=0)
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"
