"""Async client for vLLM's OpenAI-compatible ``/v1/completions`` that works in token ids end to end.

Why token ids: the prompt is sent as the token ids the project's tokenizer produced (the chat template is
applied by the caller, ``rollout/chat.py``), and the server returns the generated token ids
(``return_token_ids``) and the log-probability of each chosen token (``logprobs: 1``). Those ids and
log-probs go into the trajectory unchanged. The decoded ``text`` is for the environment and humans only;
it is never re-tokenized for training, because decode -> encode does not round-trip (merges at the
boundary, special tokens, whitespace normalization).

What the ids contain (vLLM 0.32): when generation stops on EOS, the EOS id is the last of ``token_ids``
(the text omits it); when it stops on a ``stop`` string, the ids include the tokens of the stop string
while the text is cut before it.

Log-probs are vLLM's ``--logprobs-mode`` values, ``raw_logprobs`` by default: log-softmax of the model's
logits *before* temperature/top-p/top-k. They equal the sampling distribution's log-probs only at
temperature 1 without truncation; start the server with ``logprobs_mode="processed_logprobs"`` to get
the post-processing ones.

Retries: connection errors, timeouts and HTTP 5xx are retried with exponential backoff (tenacity), up to
``max_retries`` retries (``max_retries + 1`` attempts); then ``InferenceError`` names the URL, the number of
attempts and the last cause. HTTP 4xx is not retried and carries the server's message. A response that is
not JSON, or lacks token ids / log-probs, raises ``InferenceError`` at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from pettingflow.inference import auth

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One generated choice: the sampler's token ids, the log-prob of each, why it stopped, and its text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    server: str = ""  # the server root that generated it (which replica: rows record it)


class InferenceError(RuntimeError):
    """A request failed for good: ``url``, ``attempts`` made, ``status_code`` (if any) and the last ``cause``."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        attempts: int = 1,
        status_code: int | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.attempts = attempts
        self.status_code = status_code
        self.cause = cause


class _Retryable(Exception):
    """Internal: a transient failure (connection, timeout, 5xx) that tenacity may retry."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all become ``http://h:p``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def server_message(resp: httpx.Response, limit: int = 500) -> str:
    """The error message of an OpenAI-style error body, or the start of the raw body."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:limit] or "<empty body>"
    if isinstance(data, Mapping):
        err = data.get("error", data)
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])[:limit]
        if "detail" in data:
            return str(data["detail"])[:limit]
    return str(data)[:limit]


class InferenceClient:
    """Bounded-concurrency, retrying client for one OpenAI-compatible server (vLLM).

    ``base_url`` is the server root (``/v1`` is appended; a trailing ``/v1`` is accepted). One
    ``httpx.AsyncClient`` (connection pool sized to ``max_concurrency``) is shared by all requests made
    from the same event loop; at most ``max_concurrency`` requests are in flight (an ``asyncio.Semaphore``
    held only while a request is on the wire, not during backoff sleeps). ``timeout_s`` bounds each
    attempt (connect, send, and waiting for the full response). Use ``async with`` or ``aclose()``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_concurrency: int = 32,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 8.0,
        api_key: str | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = normalize_base_url(base_url)
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        # no key given: the one registered for this server, if any (inference/auth.py)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else auth.headers(self.base_url)
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ public API
    async def complete(
        self,
        prompt_ids: Sequence[int],
        *,
        model: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 256,
        stop: Sequence[str] | None = None,
        n: int = 1,
        seed: int | None = None,
        ignore_eos: bool = False,
        extra_body: Mapping[str, Any] | None = None,
    ) -> list[Completion]:
        """Generate ``n`` completions of the token-id prompt; one ``Completion`` per choice, in order.

        ``ignore_eos`` and ``extra_body`` are vLLM extensions (``extra_body`` is merged into the request
        last, for parameters not listed here).
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if n < 1:
            raise ValueError("n must be >= 1")
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
            "n": int(n),
            "logprobs": 1,
            "return_token_ids": True,
        }
        if stop:
            body["stop"] = list(stop)
        if seed is not None:
            body["seed"] = int(seed)
        if ignore_eos:
            body["ignore_eos"] = True
        if extra_body:
            body.update(extra_body)
        url = f"{self.base_url}/v1/completions"
        data = await self._post_json(url, body)
        return _parse_completions(data, n=n, url=url)

    async def complete_one(self, prompt_ids: Sequence[int], *, model: str, **sampling: Any) -> Completion:
        """``complete(..., n=1)`` returning the single ``Completion``."""
        if sampling.get("n", 1) != 1:
            raise ValueError("complete_one generates one choice; use complete(n=...) for more")
        sampling.pop("n", None)
        return (await self.complete(prompt_ids, model=model, **sampling))[0]

    async def models(self) -> list[str]:
        """Ids from ``GET /v1/models``: the served base model and loaded LoRA adapters."""
        url = f"{self.base_url}/v1/models"
        resp = await self._request("GET", url)
        return [str(m["id"]) for m in resp.get("data", [])]

    async def health(self) -> bool:
        """True if ``GET /health`` answers 200 (one attempt, no retries)."""
        http, _ = self._ensure_http()
        try:
            return (await http.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        """Close the connection pool (safe to call twice)."""
        http, loop = self._http, self._loop
        self._http, self._sem, self._loop = None, None, None
        # A pool made in another, finished event loop cannot be closed from this one; it is dropped.
        if http is not None and loop is asyncio.get_running_loop():
            await http.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"InferenceClient({self.base_url!r}, max_concurrency={self.max_concurrency}, "
            f"timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )

    # ------------------------------------------------------------------ internals
    def _ensure_http(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The pool and semaphore of the running event loop (recreated if the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._sem is None or self._loop is not loop:
            # A pool made in another (finished) loop cannot be reused or closed from this one; drop it.
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(
                    max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
                ),
                headers=self._headers,
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        return self._http, self._sem

    async def _post_json(self, url: str, body: Mapping[str, Any]) -> Any:
        return await self._request("POST", url, body)

    async def _request(self, method: str, url: str, body: Mapping[str, Any] | None = None) -> Any:
        attempts = 0
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait_exponential_jitter(
                initial=self.backoff_initial_s, max=self.backoff_max_s, jitter=self.backoff_initial_s
            ),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "%s %s attempt %d failed (%s); retrying", method, url, rs.attempt_number, rs.outcome.exception()
            ),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    data = await self._request_once(method, url, body, attempts)
        except _Retryable as exc:
            raise InferenceError(
                f"{method} {url} failed after {attempts} attempt(s) ({self.max_retries} retries): {exc}",
                url=url,
                attempts=attempts,
                status_code=exc.status_code,
                cause=exc.__cause__ or exc,
            ) from (exc.__cause__ or exc)
        return data

    async def _request_once(self, method: str, url: str, body: Mapping[str, Any] | None, attempt: int) -> Any:
        http, sem = self._ensure_http()
        async with sem:
            try:
                resp = await http.request(method, url, json=body)
            except httpx.TimeoutException as exc:
                raise _Retryable(f"timed out after {self.timeout_s:g} s ({type(exc).__name__})") from exc
            except httpx.TransportError as exc:
                raise _Retryable(f"{type(exc).__name__}: {exc or 'connection failed'}") from exc
        if resp.status_code >= 500:
            raise _Retryable(f"HTTP {resp.status_code}: {server_message(resp)}", status_code=resp.status_code)
        if resp.status_code >= 400:
            raise InferenceError(
                f"{method} {url} returned HTTP {resp.status_code} (client error, not retried): {server_message(resp)}",
                url=url,
                attempts=attempt,
                status_code=resp.status_code,
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise InferenceError(
                f"{method} {url} returned malformed JSON (HTTP {resp.status_code}): {resp.text[:200]!r}",
                url=url,
                attempts=attempt,
                status_code=resp.status_code,
                cause=exc,
            ) from exc


def _parse_completions(data: Any, *, n: int, url: str) -> list[Completion]:
    """Turn an OpenAI completions response into ``n`` ``Completion``s ordered by choice index."""

    def bad(why: str) -> InferenceError:
        return InferenceError(f"unexpected response from {url}: {why}", url=url)

    if not isinstance(data, Mapping) or not isinstance(data.get("choices"), list):
        raise bad("no 'choices' list")
    choices = sorted(data["choices"], key=lambda c: int(c.get("index", 0)) if isinstance(c, Mapping) else 0)
    if len(choices) != n:
        raise bad(f"{len(choices)} choices for n={n}")
    out = []
    for ch in choices:
        if not isinstance(ch, Mapping):
            raise bad("a choice is not an object")
        token_ids = ch.get("token_ids")
        if token_ids is None:
            raise bad("no 'token_ids' in the choice; the server must support 'return_token_ids' (vLLM >= 0.10.2)")
        lp = ch.get("logprobs")
        token_logprobs = lp.get("token_logprobs") if isinstance(lp, Mapping) else None
        if token_logprobs is None:
            raise bad("no 'logprobs.token_logprobs' in the choice")
        if len(token_logprobs) != len(token_ids):
            raise bad(f"{len(token_ids)} token ids but {len(token_logprobs)} log-probs")
        if any(x is None for x in token_logprobs):
            raise bad("a generated token has no log-prob")
        out.append(
            Completion(
                token_ids=[int(t) for t in token_ids],
                logprobs=[float(x) for x in token_logprobs],
                finish_reason=str(ch.get("finish_reason") or "unknown"),
                text=str(ch.get("text") or ""),
                server=normalize_base_url(url.removesuffix("/v1/completions")),
            )
        )
    return out
