"""``make_sandbox``: the one way a sandbox is chosen (its own module, so the Ray pool's actors and the package
import it without importing each other)."""

from __future__ import annotations

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox.base import Sandbox, SandboxUnavailableError


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
