"""Sandboxes for model-written Python code. Nothing here ever runs a program unsandboxed.

``make_sandbox(settings)`` returns a :class:`Sandbox` for ``settings.backend`` or raises
:class:`SandboxUnavailableError` with the fix. See docs/sandbox.md for the threat model.
"""

from __future__ import annotations

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxUnavailableError
from pettingflow.envs.sandbox.ray_pool import RaySandboxPool

__all__ = [
    "ExecResult",
    "RaySandboxPool",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailableError",
    "make_sandbox",
]


def make_sandbox(settings: SandboxSettings) -> Sandbox:
    """The sandbox ``settings.backend`` names, checked to work here; never a weaker fallback.

    bubblewrap: needs ``bwrap`` >= 0.8.0 and unprivileged user namespaces; a self-check program must
    prove its isolation from the inside before this returns. docker: needs an engine that answers
    ``docker.from_env().ping()`` and the image present locally.
    """
    if settings.backend == "bubblewrap":
        from pettingflow.envs.sandbox.bubblewrap import BubblewrapSandbox

        return BubblewrapSandbox(settings)
    if settings.backend == "docker":
        from pettingflow.envs.sandbox.docker_backend import DockerSandbox

        return DockerSandbox(settings)
    raise SandboxUnavailableError(f"unknown sandbox backend {settings.backend!r}; use 'bubblewrap' or 'docker'")
