"""A Sandbox whose runs execute in Ray actors, each holding its own ``make_sandbox(settings)``.

Why actors and not tasks: building a sandbox runs its self-check (~0.2 s for bubblewrap, an engine
ping for docker); an actor pays that once and then serves many runs. Each actor is a threaded actor
with ``max_concurrency = settings.max_concurrency``, so one actor runs up to that many programs at
once and the pool up to ``num_workers * settings.max_concurrency``. Runs go to the actor with the
fewest runs in flight from this pool.

Ray is imported only when a pool is built, so importing this package never starts or needs Ray. The
pool does not start Ray unless asked (``init_if_needed=True``): silently starting a local runtime
inside a process that meant to attach to a cluster would hide a configuration error. The runtime it
starts then uses token authentication (``pettingflow.ray_cluster.init_ray``, which sets ``RAY_AUTH_MODE``
and ``RAY_AUTH_TOKEN_PATH``); it never sets ``RAY_USAGE_STATS_ENABLED``.
"""

from __future__ import annotations

import threading
from typing import Any

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox.base import ExecResult, SandboxUnavailableError


class _SandboxWorker:
    """Ray actor body. Construction errors are kept and reported by ``ready`` so that the driver gets
    the sandbox's own message ("apt-get install -y bubblewrap") rather than a bare ActorDiedError."""

    def __init__(self, settings: SandboxSettings):
        from pettingflow.envs.sandbox.factory import make_sandbox

        self._sandbox = None
        self._error: str | None = None
        try:
            self._sandbox = make_sandbox(settings)
        except SandboxUnavailableError as exc:
            self._error = str(exc)

    def ready(self) -> str | None:
        return self._error

    def run(self, code: str, stdin: str, timeout_s: float | None) -> ExecResult:
        if self._sandbox is None:
            raise SandboxUnavailableError(self._error or "sandbox not built")
        return self._sandbox.run(code, stdin=stdin, timeout_s=timeout_s)


class RaySandboxPool:
    """Implements the Sandbox protocol by forwarding runs to ``num_workers`` Ray actors.

    ``init_if_needed``: when Ray is not initialised, start a local runtime with
    ``init_ray(num_cpus=num_cpus, include_dashboard=False)`` (and shut it down in :meth:`shutdown`);
    otherwise raise SandboxUnavailableError. ``num_cpus_per_worker`` is the Ray CPU reservation of each
    actor (default 0: the programs run in the sandbox's own child processes, which Ray does not see,
    and the sandbox's concurrency bound is what limits CPU use).
    """

    def __init__(
        self,
        settings: SandboxSettings,
        num_workers: int,
        *,
        init_if_needed: bool = False,
        num_cpus: int | None = None,
        num_cpus_per_worker: float = 0.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        try:
            import ray
        except ImportError as exc:
            raise SandboxUnavailableError("RaySandboxPool needs Ray: pip install 'ray[default]'") from exc
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            if not init_if_needed:
                raise SandboxUnavailableError(
                    "Ray is not initialised: call ray.init(...) (or ray.init(address=...) for a cluster) "
                    "before building RaySandboxPool, or pass init_if_needed=True to start a local runtime"
                )
            from pettingflow.ray_cluster import init_ray

            init_ray(num_cpus=num_cpus, include_dashboard=False)
            self._owns_ray = True
        actor_cls = ray.remote(_SandboxWorker)
        self._actors = [
            actor_cls.options(num_cpus=num_cpus_per_worker, max_concurrency=settings.max_concurrency).remote(settings)
            for _ in range(num_workers)
        ]
        self._inflight = [0] * num_workers
        self._lock = threading.Lock()
        errors = [e for e in ray.get([a.ready.remote() for a in self._actors]) if e]
        if errors:
            self.shutdown()
            raise SandboxUnavailableError(f"sandbox could not be built in a Ray worker: {errors[0]}")

    def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        """Blocking run on the least busy actor (the actor enforces limits and concurrency)."""
        i = self._acquire()
        try:
            return self._ray.get(self._actors[i].run.remote(code, stdin, timeout_s))
        finally:
            self._release(i)

    async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        """Awaits the actor's ObjectRef directly: no thread is held while the program runs."""
        i = self._acquire()
        try:
            return await self._actors[i].run.remote(code, stdin, timeout_s)
        finally:
            self._release(i)

    def shutdown(self) -> None:
        """Kill the actors; shut Ray down only if this pool started it."""
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RaySandboxPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _acquire(self) -> int:
        with self._lock:
            if not self._actors:
                raise RuntimeError("RaySandboxPool was shut down")
            i = min(range(len(self._actors)), key=self._inflight.__getitem__)
            self._inflight[i] += 1
            return i

    def _release(self, i: int) -> None:
        with self._lock:
            if i < len(self._inflight):
                self._inflight[i] -= 1
