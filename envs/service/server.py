"""The env service: one registered env class behind the HTTP+JSON protocol of docs/env-service.md
(``pettingflow env serve NAME``).

``EnvService`` holds the episodes and does what each route asks, without HTTP; ``create_app`` wraps it in a
FastAPI app (bearer-token check, the protocol's error format) and ``serve`` runs that app with uvicorn. Episodes
live in this process's memory: a restarted service has none, and a trainer whose episode was lost fails that
episode (the rollout step then re-runs its group on resume).

Env methods run on the server's event loop as they run on the trainer's in-process: a synchronous method
in one go, a coroutine (code-env's sandbox calls) awaited, so many episodes' sandbox runs overlap. Calls to one
episode are serialized (a lock per episode); calls to different episodes are not.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from pettingflow.configs.addresses import is_loopback
from pettingflow.envs.base import Env, EnvConfigError
from pettingflow.envs.registry import ENV_REGISTRY, EnvCache, EnvSpec, freeze_config, resolve_env_class
from pettingflow.envs.service.protocol import (
    EPISODE_ID,
    PROTOCOL,
    ROUTE_PREFIX,
    TOKEN_ENV,
    CodecError,
    ProtocolError,
    check_protocol,
    remote_methods,
    snapshot,
    to_json,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 8780
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_MAX_EPISODES = 10_000
MIN_TOKEN_CHARS = 16
KEEP_ALIVE_S = 75  # longer than the client's pool keeps an idle connection, so a request never meets a closing one


# --------------------------------------------------------------------------------------------------
# request bodies
# --------------------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol: int


class _EnvRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    class_path: str
    config: dict[str, Any] = {}


class CreateBody(_Body):
    episode_id: str
    env: _EnvRef
    task: dict[str, Any]
    seed: int | None = None
    env_idx: int = 0
    rollout_idx: int = 0


class StepBody(_Body):
    method: str
    args: dict[str, Any] = {}


class ForkBody(_Body):
    new_episode_id: str


class CloseBody(_Body):
    episode_ids: list[str]


def _parse(model: type[BaseModel], body: Any) -> Any:
    check_protocol(body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in exc.errors())
        raise ProtocolError("bad_request", f"invalid request body: {problems}") from exc


def _check_id(episode_id: str, what: str = "episode id") -> None:
    if not EPISODE_ID.match(episode_id):
        raise ProtocolError("bad_request", f"{what} {episode_id!r:.140} must match {EPISODE_ID.pattern}")


# --------------------------------------------------------------------------------------------------
# the episodes
# --------------------------------------------------------------------------------------------------
@dataclass
class _Episode:
    env: Env
    origin: str  # create: the canonical request; fork: "fork:<parent id>" (what makes a replay idempotent)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


class EnvService:
    """The episodes of one env class and what each route does with them."""

    def __init__(
        self,
        env: str,
        *,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_episodes: int = DEFAULT_MAX_EPISODES,
    ) -> None:
        self.env_cls = resolve_env_class(env)
        self.class_path = ENV_REGISTRY.class_path(env)
        self.name = ENV_REGISTRY.short_name(self.class_path)
        self.methods = remote_methods(self.env_cls)
        self.idle_timeout_s = idle_timeout_s
        self.max_episodes = max_episodes
        self.cache = EnvCache()
        self.episodes: dict[str, _Episode] = {}
        self._last_sweep = time.monotonic()

    # ------------------------------------------------------------------ bookkeeping
    def _sweep(self) -> None:
        """Forget episodes nobody touched for ``idle_timeout_s`` (a trainer that died never closes its own)."""
        now = time.monotonic()
        if now - self._last_sweep < min(5.0, self.idle_timeout_s / 2):
            return
        self._last_sweep = now
        stale = [
            k for k, ep in self.episodes.items() if now - ep.last_used > self.idle_timeout_s and not ep.lock.locked()
        ]
        for k in stale:
            del self.episodes[k]
        if stale:
            log.info("dropped %d episodes idle for more than %.0f s", len(stale), self.idle_timeout_s)

    def _get(self, episode_id: str) -> _Episode:
        self._sweep()
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise ProtocolError(
                "unknown_episode",
                f"no episode {episode_id!r} on this service (never created, closed, idle for more than "
                f"{self.idle_timeout_s:.0f} s, or the service restarted)",
            )
        ep.last_used = time.monotonic()
        return ep

    def _room(self) -> None:
        self._sweep()
        if len(self.episodes) >= self.max_episodes:
            raise ProtocolError(
                "service_full", f"this service holds {len(self.episodes)} episodes, its limit (--max-episodes)"
            )

    def _answer(self, episode_id: str, env: Env, **extra: Any) -> dict[str, Any]:
        try:
            return {"protocol": PROTOCOL, **extra, "episode": snapshot(episode_id, env)}
        except CodecError as exc:
            raise ProtocolError("internal", f"the episode's state cannot be sent: {exc}") from exc

    # ------------------------------------------------------------------ routes
    def info(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL,
            "env": {"name": self.name, "class_path": self.class_path},
            "methods": {
                name: {"params": list(m.params), "async": m.is_async} for name, m in sorted(self.methods.items())
            },
            "episodes": len(self.episodes),
            "idle_timeout_s": self.idle_timeout_s,
            "max_episodes": self.max_episodes,
        }

    def create(self, body: Any) -> dict[str, Any]:
        req: CreateBody = _parse(CreateBody, body)
        _check_id(req.episode_id)
        if req.env.class_path not in (self.name, self.class_path):
            raise ProtocolError(
                "wrong_env", f"this service serves {self.name} ({self.class_path}), not {req.env.class_path!r}"
            )
        try:
            spec = EnvSpec(self.class_path, freeze_config(self.env_cls.validate_config(req.env.config)))
        except (EnvConfigError, ValueError) as exc:
            raise ProtocolError("bad_request", str(exc)) from exc
        origin = freeze_config(
            {
                "env": spec.config_json,
                "task": req.task,
                "seed": req.seed,
                "env_idx": req.env_idx,
                "rollout_idx": req.rollout_idx,
            }
        )
        existing = self.episodes.get(req.episode_id)
        if existing is not None:  # a retried create: the same request gets the same episode
            if existing.origin != origin:
                raise ProtocolError(
                    "episode_exists", f"episode {req.episode_id!r} exists and was created by another request"
                )
            existing.last_used = time.monotonic()
            return self._answer(req.episode_id, existing.env)
        self._room()
        try:
            env = self.cache.get(spec).create(req.task, env_idx=req.env_idx, rollout_idx=req.rollout_idx, seed=req.seed)
        except Exception as exc:
            raise ProtocolError("env_error", f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc
        self.episodes[req.episode_id] = _Episode(env, origin)
        return self._answer(req.episode_id, env)

    def observe(self, episode_id: str, body: Any) -> dict[str, Any]:
        _parse(_Body, body)
        return self._answer(episode_id, self._get(episode_id).env)

    async def step(self, episode_id: str, body: Any) -> dict[str, Any]:
        req: StepBody = _parse(StepBody, body)
        method = self.methods.get(req.method)
        if method is None:
            raise ProtocolError(
                "unknown_method", f"{self.name} has no method {req.method!r} for agents; it has {sorted(self.methods)}"
            )
        ep = self._get(episode_id)
        try:
            args = method.decode_args(req.args)
        except CodecError as exc:
            raise ProtocolError("bad_request", str(exc)) from exc
        async with ep.lock:
            try:
                result = getattr(ep.env, req.method)(**args)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:
                log.warning("episode %s: %s raised %s: %s", episode_id, req.method, type(exc).__name__, exc)
                raise ProtocolError(
                    "env_error", f"{req.method} raised {type(exc).__name__}: {exc}", type(exc).__name__
                ) from exc
            finally:
                ep.last_used = time.monotonic()
            try:
                encoded = to_json(result, f"{req.method}() result")
            except CodecError as exc:
                raise ProtocolError("internal", f"the result of {req.method} cannot be sent: {exc}") from exc
            return self._answer(episode_id, ep.env, result=encoded)

    async def fork(self, episode_id: str, body: Any) -> dict[str, Any]:
        req: ForkBody = _parse(ForkBody, body)
        _check_id(req.new_episode_id, "new_episode_id")
        ep = self._get(episode_id)
        origin = f"fork:{episode_id}"
        existing = self.episodes.get(req.new_episode_id)
        if existing is not None:  # a retried fork
            if existing.origin != origin:
                raise ProtocolError("episode_exists", f"episode {req.new_episode_id!r} exists and is no fork of it")
            return self._answer(req.new_episode_id, existing.env)
        self._room()
        async with ep.lock:
            if (again := self.episodes.get(req.new_episode_id)) is not None and again.origin == origin:
                return self._answer(req.new_episode_id, again.env)  # the first try finished while this one waited
            try:
                twin = ep.env.fork()
            except Exception as exc:
                raise ProtocolError(
                    "env_error", f"fork raised {type(exc).__name__}: {exc}", type(exc).__name__
                ) from exc
            self.episodes[req.new_episode_id] = _Episode(twin, origin)
        return self._answer(req.new_episode_id, twin)

    def close(self, body: Any) -> dict[str, Any]:
        req: CloseBody = _parse(CloseBody, body)
        closed = [k for k in req.episode_ids if self.episodes.pop(k, None) is not None]
        unknown = [k for k in req.episode_ids if k not in closed]
        return {"protocol": PROTOCOL, "closed": closed, "unknown": unknown}


# --------------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------------
def check_bind(host: str, token: str | None) -> None:
    """Anything reachable beyond loopback is authenticated: a non-loopback ``host`` needs a token."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the env service's token must have at least {MIN_TOKEN_CHARS} characters")
    if not token and not is_loopback(host):
        raise ValueError(
            f"--host {host} is reachable beyond this machine, so the env service needs a token: pass --token or set "
            f"{TOKEN_ENV} (make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'), and set "
            f"the same {TOKEN_ENV} where the rollouts run"
        )


def create_app(
    env: str,
    *,
    token: str | None = None,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    max_episodes: int = DEFAULT_MAX_EPISODES,
) -> FastAPI:
    """The FastAPI app serving ``env`` (a registered name or ``module:Class``). With ``token``, every request
    must carry ``Authorization: Bearer <token>`` (checked in constant time), or gets 401."""
    service = EnvService(env, idle_timeout_s=idle_timeout_s, max_episodes=max_episodes)
    app = FastAPI(title=f"PettingFlow env service: {service.name}", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    expected = f"Bearer {token}".encode() if token else None

    def error(exc: ProtocolError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.type == "unauthorized" else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    if expected is not None:  # every request, before any route (unknown paths too)

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error(ProtocolError("unauthorized", "missing or wrong bearer token (Authorization header)"))
            return await call_next(request)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "bad_request"
        body = ProtocolError(kind, f"{request.method} {request.url.path}: {exc.detail}").body()
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("env service: %s %s failed", request.method, request.url.path)
        return error(ProtocolError("internal", f"{type(exc).__name__}: {exc}", type(exc).__name__))

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError as exc:
            raise ProtocolError("bad_request", f"the request body is not JSON: {exc}") from exc

    @app.get(f"{ROUTE_PREFIX}/info")
    async def info() -> JSONResponse:
        return JSONResponse(service.info())

    @app.post(f"{ROUTE_PREFIX}/episodes")
    async def create(request: Request) -> JSONResponse:
        return JSONResponse(service.create(await body_of(request)))

    @app.post(f"{ROUTE_PREFIX}/episodes/{{episode_id}}/observe")
    async def observe(episode_id: str, request: Request) -> JSONResponse:
        return JSONResponse(service.observe(episode_id, await body_of(request)))

    @app.post(f"{ROUTE_PREFIX}/episodes/{{episode_id}}/step")
    async def step(episode_id: str, request: Request) -> JSONResponse:
        return JSONResponse(await service.step(episode_id, await body_of(request)))

    @app.post(f"{ROUTE_PREFIX}/episodes/{{episode_id}}/fork")
    async def fork(episode_id: str, request: Request) -> JSONResponse:
        return JSONResponse(await service.fork(episode_id, await body_of(request)))

    @app.post(f"{ROUTE_PREFIX}/close")
    async def close(request: Request) -> JSONResponse:
        return JSONResponse(service.close(await body_of(request)))

    return app


def serve(
    env: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    max_episodes: int = DEFAULT_MAX_EPISODES,
) -> None:
    """Serve ``env`` on ``host:port`` until interrupted (``check_bind`` first: beyond loopback only with a token)."""
    import uvicorn

    check_bind(host, token)
    app = create_app(env, token=token, idle_timeout_s=idle_timeout_s, max_episodes=max_episodes)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
