"""The trainer's side of the env service (docs/env-service.md): a client per service URL, ``RemoteEnv`` (an ``Env``
whose methods run on a service) and ``RemoteEnvs`` (what the rollout builds its episodes with when ``env.server``
is set).

A ``RemoteEnv`` of ``PlanPathEnv`` is an instance of a subclass of ``PlanPathEnv`` (``remote_class``), so agents
written for the env, their ``isinstance`` checks and ``Agent.acts_in`` work unchanged. It keeps a mirror of what
agents read (``state``, ``config``, ``task``, the turn counters, ``history``) and runs every method they call
(``submit_plan``, ``execute``, ``submit_code``, ``finish_turn``, ``reset``, ``fork``) on the service, which answers
with the result and the episode's new snapshot. The env's logic runs on the service; the agents' stays here.

Calls: an env method that is a coroutine (code-env's ``submit_code``) is awaited through a worker thread, so
episodes overlap while the service works; a plain method (plan-path's ``execute``, ``finish_turn``, ``fork``) blocks
the rollout's event loop for one round trip, as the in-process method blocks it for its own run.

Failures: a timeout, a 5xx, a refused connection or an error raised by the env fails the call with an
``EnvServiceError`` naming the service URL, the call and the episode, which fails the episode and its group (the
rollout step commits whole groups; a resumed step re-runs the uncommitted ones). Only idempotent calls are
retried: ``info``, ``observe``, ``create`` and ``fork`` (the client chooses the new episode's id, so a replay
returns the episode the first try made) and ``close``; never ``step``.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import functools
import inspect
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from pettingflow.configs.addresses import is_loopback
from pettingflow.envs.base import FAILED, MAX_TURNS, SOLVED, Env, EnvConfig
from pettingflow.envs.registry import ENV_REGISTRY, EnvSpec
from pettingflow.envs.service.protocol import (
    BASE_METHODS,
    PROTOCOL,
    ROUTE_PREFIX,
    TOKEN_ENV,
    MethodSpec,
    from_json,
    remote_methods,
    state_type,
)

log = logging.getLogger(__name__)

CLOSE_BATCH = 32  # abandoned episodes (tree forks, finished episodes) are closed in batches of this many ...
CLOSE_AFTER_S = 5.0  # ... or once the oldest waited this long; the service's idle timeout catches the rest


class EnvServiceError(RuntimeError):
    """A call to an env service that failed: ``url``, ``call`` (e.g. ``step execute (episode 3f2a...)``), why."""

    def __init__(
        self,
        url: str,
        call: str,
        message: str,
        *,
        retryable: bool = False,
        status: int | None = None,
        error_type: str | None = None,
        exception: str | None = None,
    ) -> None:
        super().__init__(f"env service {url}: {call} failed: {message}")
        self.url = url
        self.call = call
        self.retryable = retryable
        self.status = status
        self.error_type = error_type
        self.exception = exception


class RemoteEnvError(EnvServiceError):
    """The env itself raised on the service (``env_error``): ``exception`` is its class name."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds a call may take: to connect, for bookkeeping calls (info, create, observe, fork, close), for a
    ``step`` (an env method: code-env's waits for the sandbox, behind other episodes' runs)."""

    connect_s: float = 5.0
    control_s: float = 60.0
    step_s: float = 300.0


def new_episode_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------------------
# one service
# --------------------------------------------------------------------------------------------------
class ServiceClient:
    """Calls to the env service at ``url``: one pooled HTTP client (thread-safe), retries of idempotent calls,
    the protocol version checked on every answer, the bearer token on every request.

    ``token``: default ``$PETTINGFLOW_ENV_TOKEN``; required for a service beyond loopback. ``http``: an
    ``httpx.Client`` to use instead of one of its own (tests pass Starlette's ``TestClient``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        http: httpx.Client | None = None,
        timeouts: Timeouts | None = None,
        attempts: int = 3,
    ) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"env service URL {url!r} must look like http://host:port")
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        if not self.token and not is_loopback(parts.hostname):
            raise EnvServiceError(
                self.url,
                "connect",
                f"{parts.hostname} is not loopback, so the service requires a token: set {TOKEN_ENV} to the token "
                "the service was started with",
            )
        self.timeouts = timeouts or Timeouts()
        self.attempts = attempts
        self._own_http = http is None  # a caller's client keeps its own timeouts (Starlette's TestClient has none)
        self._http = http or httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(self.timeouts.control_s, connect=self.timeouts.connect_s),
            # an idle connection is dropped here before the server's keep-alive (75 s) closes it under a request
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32, keepalive_expiry=4.0),
        )
        self._pending: list[str] = []
        self._pending_since = 0.0
        self._lock = threading.RLock()
        _LIVE_CLIENTS.add(self)

    # ------------------------------------------------------------------ transport
    def _send(self, call: str, verb: str, path: str, body: Mapping[str, Any] | None, timeout: float) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        payload = None if body is None else {"protocol": PROTOCOL, **body}
        try:
            extra = {"timeout": httpx.Timeout(timeout, connect=self.timeouts.connect_s)} if self._own_http else {}
            response = self._http.request(verb, f"{ROUTE_PREFIX}{path}", json=payload, headers=headers, **extra)
        except httpx.TimeoutException as exc:
            raise EnvServiceError(
                self.url, call, f"no answer within {timeout:.0f} s ({type(exc).__name__})", retryable=True
            ) from exc
        except httpx.ConnectError as exc:
            raise EnvServiceError(
                self.url, call, f"cannot connect ({exc}); is `pettingflow env serve` running there?", retryable=True
            ) from exc
        except httpx.TransportError as exc:  # the connection broke mid-call (a service that died)
            raise EnvServiceError(self.url, call, f"{type(exc).__name__}: {exc}", retryable=True) from exc
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            if isinstance(error, dict):
                message = f"HTTP {response.status_code} {error.get('type')}: {error.get('message')}"
                kind, exception = error.get("type"), error.get("exception")
            else:
                message, kind, exception = f"HTTP {response.status_code}: {response.text[:300]}", None, None
            cls = RemoteEnvError if kind == "env_error" else EnvServiceError
            raise cls(
                self.url,
                call,
                message,
                retryable=response.status_code in (502, 503, 504),
                status=response.status_code,
                error_type=kind,
                exception=exception,
            )
        if not isinstance(data, dict) or data.get("protocol") != PROTOCOL:
            said = data.get("protocol") if isinstance(data, dict) else None
            raise EnvServiceError(
                self.url, call, f"the service answered with protocol {said!r}; this client speaks protocol {PROTOCOL}"
            )
        return data

    def _call(
        self, call: str, verb: str, path: str, body: Mapping[str, Any] | None, *, idempotent: bool, timeout: float
    ) -> dict[str, Any]:
        if not idempotent or self.attempts <= 1:
            return self._send(call, verb, path, body, timeout)
        for attempt in Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception(lambda e: isinstance(e, EnvServiceError) and e.retryable),
            reraise=True,
        ):
            with attempt:
                return self._send(call, verb, path, body, timeout)
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ the protocol's calls
    def info(self) -> dict[str, Any]:
        return self._call("info", "GET", "/info", None, idempotent=True, timeout=self.timeouts.control_s)

    def create(
        self,
        episode_id: str,
        class_path: str,
        config: Mapping[str, Any],
        task: Mapping[str, Any],
        *,
        seed: int | None,
        env_idx: int,
        rollout_idx: int,
    ) -> dict[str, Any]:
        self.flush()
        body = {
            "episode_id": episode_id,
            "env": {"class_path": class_path, "config": dict(config)},
            "task": dict(task),
            "seed": seed,
            "env_idx": env_idx,
            "rollout_idx": rollout_idx,
        }
        call = f"create (episode {episode_id}, task {task.get('task_id', '?')!r})"
        return self._call(call, "POST", "/episodes", body, idempotent=True, timeout=self.timeouts.control_s)["episode"]

    def observe(self, episode_id: str) -> dict[str, Any]:
        return self._call(
            f"observe (episode {episode_id})",
            "POST",
            f"/episodes/{episode_id}/observe",
            {},
            idempotent=True,
            timeout=self.timeouts.control_s,
        )["episode"]

    def step(self, episode_id: str, method: str, args: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Run ``method(**args)`` on the episode: (its JSON result, the episode's snapshot). Never retried."""
        self.flush()
        data = self._call(
            f"step {method} (episode {episode_id})",
            "POST",
            f"/episodes/{episode_id}/step",
            {"method": method, "args": dict(args)},
            idempotent=False,
            timeout=self.timeouts.step_s,
        )
        return data.get("result"), data["episode"]

    def fork(self, episode_id: str, new_id: str) -> dict[str, Any]:
        self.flush()
        return self._call(
            f"fork (episode {episode_id} -> {new_id})",
            "POST",
            f"/episodes/{episode_id}/fork",
            {"new_episode_id": new_id},
            idempotent=True,
            timeout=self.timeouts.control_s,
        )["episode"]

    def close(self, episode_ids: Sequence[str], *, attempts: int | None = None) -> dict[str, Any]:
        body = {"episode_ids": list(episode_ids)}
        call = f"close ({len(body['episode_ids'])} episodes)"
        if attempts == 1:
            return self._send(call, "POST", "/close", body, self.timeouts.control_s)
        return self._call(call, "POST", "/close", body, idempotent=True, timeout=self.timeouts.control_s)

    # ------------------------------------------------------------------ abandoned episodes
    def discard(self, episode_id: str) -> None:
        """Close ``episode_id`` later, with others (a finalizer calls this: it never blocks or raises)."""
        with self._lock:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(episode_id)

    def flush(self, force: bool = False) -> None:
        """Close the discarded episodes when enough wait (or ``force``); a failure is logged, never raised: the
        service forgets idle episodes on its own."""
        with self._lock:
            if not self._pending:
                return
            if (
                not force
                and len(self._pending) < CLOSE_BATCH
                and time.monotonic() - self._pending_since < CLOSE_AFTER_S
            ):
                return
            ids, self._pending = self._pending, []
        try:
            self.close(ids, attempts=1 if force else None)
        except Exception as exc:  # best effort, also at interpreter exit
            log.debug("could not close %d episodes on %s: %s", len(ids), self.url, exc)

    def __repr__(self) -> str:
        return f"ServiceClient({self.url!r})"


_LIVE_CLIENTS: weakref.WeakSet[ServiceClient] = weakref.WeakSet()


@atexit.register
def _close_discarded() -> None:
    for client in list(_LIVE_CLIENTS):
        client.flush(force=True)


# --------------------------------------------------------------------------------------------------
# an env on a service
# --------------------------------------------------------------------------------------------------
class RemoteEnv(Env):
    """An episode that lives on an env service; ``remote_class(EnvClass)`` makes the subclass of both that the
    rollout uses. See the module docstring for what is mirrored here and what runs there."""

    env_class: ClassVar[type[Env]] = Env
    _episode_id: str | None
    _client: ServiceClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("remote envs are opened on a service: RemoteEnvs.create(...) or remote_class(cls).open(...)")

    # ------------------------------------------------------------------ building
    @classmethod
    def open(
        cls,
        client: ServiceClient,
        task: Mapping[str, Any],
        config: EnvConfig | Mapping[str, Any] | None = None,
        *,
        env_idx: int = 0,
        rollout_idx: int = 0,
        seed: int | None = None,
    ) -> RemoteEnv:
        """A new episode of ``task`` on the service (already reset with ``seed``, as ``Env(...)`` is)."""
        env = cls._blank(client)
        env.config = cls.env_class.validate_config(config)
        env.task = dict(task)
        env.env_idx, env.rollout_idx = env_idx, rollout_idx
        env.max_turns = env.config.max_turns
        env._create(seed)
        return env

    @classmethod
    def _blank(cls, client: ServiceClient) -> RemoteEnv:
        env = object.__new__(cls)
        env._client = client
        env._episode_id = None
        env._finalizer = None
        env._outcome = {}
        env._pristine = False
        env.current_turn, env.done, env.truncated, env.history, env.seed, env.state = 0, False, False, [], None, None
        env.outcome = None
        return env

    @property
    def episode_id(self) -> str | None:
        """The episode's id on the service; None once it is over (it is then closed there)."""
        return self._episode_id

    @property
    def service_url(self) -> str:
        return self._client.url

    def _attach(self, episode_id: str) -> None:
        self._episode_id = episode_id
        self._finalizer = weakref.finalize(self, self._client.discard, episode_id)
        self._finalizer.atexit = False

    def _detach(self) -> None:
        """The episode is over: nothing can change it any more, so it is closed on the service; what the engine
        still reads (``team_outcome``, ``episode_info``, the state) is in the last snapshot."""
        if self._episode_id is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._client.discard(self._episode_id)
        self._episode_id = None

    def _create(self, seed: int | None) -> None:
        episode_id = new_episode_id()
        cls = self.env_class
        snap = self._client.create(
            episode_id,
            f"{cls.__module__}:{cls.__qualname__}",
            self.config.model_dump(mode="json"),
            self.task,
            seed=seed,
            env_idx=self.env_idx,
            rollout_idx=self.rollout_idx,
        )
        self._attach(episode_id)
        self._apply(snap)
        self._pristine = True

    def _apply(self, snap: Mapping[str, Any]) -> None:
        """Take the service's snapshot of the episode as the mirror."""
        self.current_turn = int(snap["current_turn"])
        self.max_turns = int(snap["max_turns"])
        self.done = bool(snap["done"])
        self.truncated = bool(snap["truncated"])
        # a service of an older pettingflow sends no outcome: derived from done/truncated/solved as for any env
        self.outcome = snap.get("outcome") if "outcome" in snap else None
        self.seed = snap.get("seed")
        self.history = list(snap.get("history") or [])
        self.state = from_json(snap["state"], state_type(self.env_class), "state")
        self._outcome = {k: snap.get(k) for k in ("solved", "failed", "team_outcome", "episode_info", "outcome_error")}
        if self.done and self.outcome is None:
            self.outcome = MAX_TURNS if self.truncated else SOLVED if snap.get("solved") else FAILED
        if self.done:
            self._detach()

    def _invoke(self, spec: MethodSpec, bound: Mapping[str, Any]) -> Any:
        if self._episode_id is None:
            raise EnvServiceError(
                self._client.url, f"step {spec.name}", "the episode is over and was closed on the service"
            )
        result, snap = self._client.step(self._episode_id, spec.name, spec.encode_args(bound))
        self._pristine = False
        self._apply(snap)
        return spec.decode_result(result)

    # ------------------------------------------------------------------ Env, on the service
    def initial_state(self) -> Any:
        raise RuntimeError(f"{type(self).__name__}: a remote env's state comes from its service")

    def reset(self, seed: int | None = None) -> None:
        """Start again from turn 0. Right after ``open`` with the same seed this is a no-op (the service built
        the same state); an episode that is over gets a new one on the service."""
        if self._episode_id is None:
            self._create(seed)
        elif not (self._pristine and seed == self.seed):
            self._invoke(remote_methods(self.env_class)["reset"], {"seed": seed})
            self._pristine = True

    def finish_turn(self, record: Mapping[str, Any] | None = None) -> None:
        if self.done:
            raise RuntimeError(
                f"env {self.env_idx}/{self.rollout_idx} is already done at turn {self.current_turn}; "
                "call reset() before taking more turns"
            )
        self._invoke(remote_methods(self.env_class)["finish_turn"], {"record": record})

    def fork(self) -> Env:
        """A server-side copy of the episode (a new id); an episode that is over is copied here (nothing can
        change it, so it needs no service)."""
        if self.env_class.fork is Env.fork:
            return Env.fork(self)  # the env class cannot fork: the same error as in-process
        twin = type(self)._blank(self._client)
        for name in (
            "config",
            "task",
            "env_idx",
            "rollout_idx",
            "max_turns",
            "current_turn",
            "done",
            "truncated",
            "outcome",
        ):
            setattr(twin, name, getattr(self, name))
        twin.seed = self.seed
        twin.state = copy.deepcopy(self.state)
        twin.history = copy.deepcopy(self.history)
        twin._outcome = copy.deepcopy(self._outcome)
        if self._episode_id is not None:
            new_id = new_episode_id()
            snap = self._client.fork(self._episode_id, new_id)
            twin._attach(new_id)
            twin._apply(snap)
        return twin

    def _reported(self, key: str) -> Any:
        if self._outcome.get("outcome_error"):
            raise EnvServiceError(self._client.url, key, f"the env raised {self._outcome['outcome_error']}")
        return copy.deepcopy(self._outcome.get(key))

    def solved(self) -> bool:
        return bool(self._reported("solved"))

    def failed(self) -> bool:
        return bool(self._reported("failed"))

    def team_outcome(self) -> float | None:
        value = self._reported("team_outcome")
        return None if value is None else float(value)

    def _episode_info(self) -> dict[str, Any]:
        return self._reported("episode_info") or {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_client", "_episode_id", "_finalizer", "_outcome", "_pristine"):
            raise AttributeError(name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}: a remote env mirrors state, config, task, the turn "
            f"counters and history; other attributes of {self.env_class.__name__} live on its service "
            "(docs/env-service.md)"
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, service={self._client.url!r}, episode={self._episode_id!r})"


def _stub(spec: MethodSpec) -> Any:
    """``spec``'s method on a remote env: the same signature, run on the service."""
    signature = inspect.signature(spec.function)

    def bind(self: RemoteEnv, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return {k: v for k, v in list(bound.arguments.items())[1:]}

    if spec.is_async:

        async def method(self: RemoteEnv, *args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(self._invoke, spec, bind(self, args, kwargs))

    else:

        def method(self: RemoteEnv, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            return self._invoke(spec, bind(self, args, kwargs))

    functools.update_wrapper(method, spec.function)
    method.__doc__ = f"Runs {spec.name} on the env service. " + (spec.function.__doc__ or "")
    return method


@functools.cache
def remote_class(env_cls: type[Env]) -> type[RemoteEnv]:
    """The subclass of ``RemoteEnv`` and ``env_cls`` whose episodes live on a service: ``isinstance(env,
    env_cls)`` holds, and each of ``env_cls``'s methods for agents (``remote_methods``) runs there."""
    if issubclass(env_cls, RemoteEnv):
        return env_cls
    namespace: dict[str, Any] = {"env_class": env_cls, "__module__": __name__}
    for name, spec in remote_methods(env_cls).items():
        if name not in BASE_METHODS:
            namespace[name] = _stub(spec)
    if callable(getattr(env_cls, "episode_info", None)):  # only envs that report one (the engine asks getattr)
        namespace["episode_info"] = RemoteEnv._episode_info
    name = f"Remote{env_cls.__name__}"
    namespace["__qualname__"] = name
    return type(name, (RemoteEnv, env_cls), namespace)


# --------------------------------------------------------------------------------------------------
# what the rollout uses
# --------------------------------------------------------------------------------------------------
_CLIENTS: dict[tuple[str, str | None], ServiceClient] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(url: str, token: str | None = None) -> ServiceClient:
    """The process's client of ``url`` (one connection pool per service, reused across rollout steps)."""
    token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
    key = (url.rstrip("/"), token)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = ServiceClient(url, token=token)
        return _CLIENTS[key]


class RemoteEnvs:
    """Episodes on the env services at ``urls`` (``env.server``): each env class goes to the services that serve
    it (asked once, ``info``), a task's group to one of them by its index, so a group and its forks stay together."""

    def __init__(self, urls: str | Sequence[str], *, clients: Sequence[ServiceClient] | None = None) -> None:
        self.urls = (urls,) if isinstance(urls, str) else tuple(urls)
        if not self.urls:
            raise ValueError("env.server names no URL")
        self.clients = list(clients) if clients is not None else [client_for(u) for u in self.urls]
        self._served: dict[str, tuple[str, str]] | None = None
        self._lock = threading.Lock()

    def served(self) -> dict[str, tuple[str, str]]:
        """URL -> (name, class path) of the env each service serves."""
        with self._lock:
            if self._served is None:
                served = {}
                for client in self.clients:
                    env = client.info().get("env") or {}
                    served[client.url] = (str(env.get("name", "")), str(env.get("class_path", "")))
                self._served = served
            return self._served

    def create(
        self, spec: EnvSpec, task: Mapping[str, Any], *, env_idx: int, rollout_idx: int, seed: int | None
    ) -> RemoteEnv:
        served = self.served()
        candidates = [c for c in self.clients if spec.class_path in served[c.url]]
        if not candidates:
            offered = ", ".join(f"{url} serves {name or path}" for url, (name, path) in served.items())
            raise EnvServiceError(
                ", ".join(self.urls),
                "create",
                f"no env service serves {ENV_REGISTRY.short_name(spec.class_path)} ({offered}); start one with "
                f"`pettingflow env serve {ENV_REGISTRY.short_name(spec.class_path)}`",
            )
        client = candidates[env_idx % len(candidates)]
        return remote_class(spec.env_class()).open(
            client, task, spec.config, env_idx=env_idx, rollout_idx=rollout_idx, seed=seed
        )
