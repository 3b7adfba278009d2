"""A scripted OpenAI-compatible server for the flow tests and ``bench.orchestration``: vLLM's routes, canned
answers, real token ids.

The code agent gets the canonical solution when the request's sampling seed is even and a wrong one
when it is odd, so GRPO groups have reward variance; the test agent gets two asserts. plan-path
agents get the shortest path read off the board (even seed) or a reply without moves (odd seed). Token ids come
from the real tokenizer, so training consumes exactly what the server "generated".
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_BOARD_ROW = re.compile(r"^[.#AG](?: [.#AG])*$")


def plan_path_answer(prompt: str, seed: int) -> str | None:
    """A plan-path reply, or None for other prompts: the shortest path read off the board in the prompt
    (``Plan: ...`` for the planner, ``Moves: ...`` for the executor) when ``seed`` is even, a reply without
    any move when it is odd (an invalid turn), so GRPO groups have reward variance."""
    if "The board:" not in prompt:
        return None
    from pettingflow.envs.plan_path import Grid

    lines = prompt.rsplit("The board:", 1)[1].strip("\n").splitlines()
    board = []
    for line in lines:
        if not _BOARD_ROW.match(line.strip()):
            break
        board.append(line.strip().replace(" ", "").replace("A", "S"))
    if seed % 2:
        return "I am not sure where to go."
    path = Grid.from_rows(board).shortest_path() or []
    limit = re.search(r"at most (\d+) move", prompt)
    path = path[: int(limit.group(1)) if limit else 3]
    return ("Plan: " if "Plan the next" in prompt else "Moves: ") + " ".join(path)


class ScriptedServer:
    def __init__(self, tokenizer: Any, solutions: dict[str, str], served_model: str = "shared", port: int = 0):
        """``port``: 0 picks a free one; a fixed one lets a run that names this server's URL be resumed."""
        self.tokenizer = tokenizer
        self.solutions = solutions  # entry point -> full correct function source
        self.models = [served_model]
        self.requests: list[dict[str, Any]] = []
        self.reloads: list[dict[str, Any]] = []
        self.delay: Any = None  # optional () -> seconds to wait before each completion (random timing in tests)
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": m, "object": "model"} for m in server.models]})
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if self.path == "/v1/completions":
                    if server.delay is not None:
                        time.sleep(server.delay())
                    self._send(200, server.complete(body))
                elif self.path == "/collective_rpc":
                    with server._lock:
                        server.reloads.append(body)
                    self._send(200, {"results": [None]})
                elif self.path == "/reset_prefix_cache":
                    self._send(200, {})
                elif self.path == "/v1/load_lora_adapter":
                    with server._lock:
                        server.reloads.append(body)
                        if body["lora_name"] not in server.models:
                            server.models.append(body["lora_name"])
                    self._send(200, {})
                else:
                    self._send(404, {"error": self.path})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, prompt: str, seed: int) -> str:
        moves = plan_path_answer(prompt, seed)
        if moves is not None:
            return moves
        entry = re.search(r"function `(\w+)`", prompt)
        name = entry.group(1) if entry else "f"
        if "careful Python tester" in prompt:
            # the test grammar (docs/code-env.md): literal calls only, one right on some tasks, one often wrong
            return f"```python\nassert {name}(1) is not None\nassert {name}(1) == 1\n```"
        if seed % 2 == 0 and name in self.solutions:
            return f"```python\n{self.solutions[name]}\n```"
        return f"```python\ndef {name}(*args):\n    return None\n```"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.requests.append(body)
        prompt = self.tokenizer.decode(body["prompt"])
        seed = int(body.get("seed") or 0)
        # as vLLM: with n > 1 and a seed, choice k is sampled with seed + k (tree rollouts rely on it)
        return {
            "choices": [self._choice(prompt, seed + k, k, body["max_tokens"]) for k in range(int(body.get("n", 1)))]
        }

    def _choice(self, prompt: str, seed: int, index: int, max_tokens: int) -> dict[str, Any]:
        text = self.answer(prompt, seed)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        finish = "length"
        if len(ids) < max_tokens:
            ids = [*ids, self.tokenizer.eos_token_id]
            finish = "stop"
        return {
            "index": index,
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "token_ids": ids,
            "logprobs": {"token_logprobs": [-0.25] * len(ids)},
            "finish_reason": finish,
        }
