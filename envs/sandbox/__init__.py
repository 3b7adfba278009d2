"""Sandboxes for model-written Python code. Nothing here ever runs a program unsandboxed.

``make_sandbox(settings)`` returns a :class:`Sandbox` for ``settings.backend`` or raises
:class:`SandboxUnavailableError` with the fix. See docs/sandbox.md for the threat model.
"""

from __future__ import annotations

from pettingflow.envs.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxUnavailableError
from pettingflow.envs.sandbox.factory import make_sandbox
from pettingflow.envs.sandbox.ray_pool import RaySandboxPool

__all__ = [
    "ExecResult",
    "RaySandboxPool",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailableError",
    "make_sandbox",
]
