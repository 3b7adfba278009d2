"""Which episode the current asyncio task is running, for code below the engine that has no other way to know.

The rollout engine names each episode (``episode_scope``) around its run; a client serving several inference
replicas reads the name (``current_episode``) to keep all of that episode's requests on one replica, whose prefix
cache holds the conversation (``inference/replicas.py``). A context variable, so every episode's task carries its
own and the client's methods keep the signature the engine calls them with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

current_episode: ContextVar[str | None] = ContextVar("pettingflow_episode", default=None)


@contextlib.contextmanager
def episode_scope(key: str) -> Iterator[None]:
    """Requests made inside (in this task and the tasks it starts) belong to episode ``key``."""
    token = current_episode.set(key)
    try:
        yield
    finally:
        current_episode.reset(token)
