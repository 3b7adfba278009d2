"""Several replicas of one policy's server behind one client: the fewest requests in flight, episodes stay put.

Why: rollout throughput comes from more inference replicas, and a multi-turn episode is cheapest on the replica
that already holds its conversation in its prefix cache. So:

- an episode's first request goes to the live replica with the fewest requests in flight (ties: the lowest
  index), and every later request of that episode (its next turns, its tree branches) to the same replica;
- a request that failed for good because its replica is gone (no connection, a timeout, 502/503/504 after the
  client's own retries) marks that replica down; the request, and the episode with it, move to the live replica
  with the fewest requests in flight. With no replica left the error is raised.

The engine names the episode with ``pettingflow.episode_context.episode_scope`` (a context variable, so each
episode's asyncio task carries its own and ``CompletionClient``'s methods keep their signature); a request outside
any scope just goes to the least busy replica. Pure scheduling over clients: which servers exist, and restarting
one that died, is the runtime's business (``runs/policy_service.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pettingflow.episode_context import current_episode
from pettingflow.inference.client import InferenceError

log = logging.getLogger(__name__)

GONE_STATUS = (502, 503, 504)  # a proxy or server that cannot serve at all, as opposed to a bad request


class NoReplicaError(InferenceError):
    """Every replica of the set is down."""


def replica_gone(exc: InferenceError) -> bool:
    """Whether ``exc`` says the replica cannot serve at all (rather than that the request was bad)."""
    return exc.status_code is None or exc.status_code in GONE_STATUS


class ReplicaSet:
    """A ``CompletionClient`` over the clients of several replicas of one policy's server (same model, same
    weights), each keeping its own concurrency bound and retries; the clients are not closed by the set."""

    def __init__(self, clients: Sequence[Any], names: Sequence[str] | None = None) -> None:
        if not clients:
            raise ValueError("a replica set needs at least one client")
        self.clients = list(clients)
        self.names = (
            list(names) if names is not None else [getattr(c, "base_url", str(i)) for i, c in enumerate(clients)]
        )
        if len(self.names) != len(self.clients):
            raise ValueError(f"{len(self.clients)} clients but {len(self.names)} names")
        self.in_flight = [0] * len(self.clients)
        self.requests = [0] * len(self.clients)  # answered, per replica
        self.down: dict[int, str] = {}  # replica -> why
        self._placed: dict[str, int] = {}  # episode -> replica

    def _least_busy(self) -> int:
        live = [i for i in range(len(self.clients)) if i not in self.down]
        if not live:
            reasons = "; ".join(f"{self.names[i]}: {why}" for i, why in sorted(self.down.items()))
            raise NoReplicaError(f"every replica is down ({reasons})", url=", ".join(self.names))
        return min(live, key=lambda i: (self.in_flight[i], i))

    def replica_for(self, episode: str | None) -> int:
        """The replica a request of ``episode`` goes to (placing the episode at its first request)."""
        if episode is not None:
            placed = self._placed.get(episode)
            if placed is not None and placed not in self.down:
                return placed
        chosen = self._least_busy()
        if episode is not None:
            self._placed[episode] = chosen
        return chosen

    def mark_down(self, replica: int, why: str) -> None:
        if replica not in self.down:
            log.warning("inference replica %s is down (%s): its requests move to the others", self.names[replica], why)
            self.down[replica] = why

    def mark_up(self, replica: int) -> None:
        """A restarted replica takes new episodes again."""
        self.down.pop(replica, None)

    def revive(self) -> None:
        """Every replica takes new episodes again: a set kept for a later rollout call (a rollout worker keeps its
        clients) finds the replicas the runtime restarted in between (``PolicyService.heal``) up."""
        for replica in list(self.down):
            self.mark_up(replica)

    async def _call(self, method: str, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        episode = current_episode.get()
        while True:
            replica = self.replica_for(episode)
            self.in_flight[replica] += 1
            try:
                result = await getattr(self.clients[replica], method)(prompt_ids, **kwargs)
            except InferenceError as exc:
                if not replica_gone(exc):
                    raise
                self.mark_down(replica, str(exc).splitlines()[0][:200])
                continue
            finally:
                self.in_flight[replica] -= 1
            self.requests[replica] += 1
            return result

    async def complete(self, prompt_ids: Sequence[int], *, model: str, **sampling: Any) -> list[Any]:
        return await self._call("complete", prompt_ids, model=model, **sampling)

    async def complete_one(self, prompt_ids: Sequence[int], *, model: str, **sampling: Any) -> Any:
        return await self._call("complete_one", prompt_ids, model=model, **sampling)

    def stats(self) -> dict[str, Any]:
        """Requests answered per replica and the replicas down (not yet reported in the rollout step's metrics)."""
        return {
            "requests": dict(zip(self.names, self.requests, strict=True)),
            "down": {self.names[i]: why for i, why in self.down.items()},
        }

    async def aclose(self) -> None:
        """Nothing: the replicas' clients stay their owner's to close (``rollout.local.run_episodes`` keeps one
        client per URL, shared by every set and binding that names it)."""
