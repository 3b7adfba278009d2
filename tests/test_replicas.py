"""The replica set's scheduling (``inference/replicas.py``): the least busy replica, episodes kept on theirs, a
dead replica's requests moved to the others, a bad request not mistaken for a dead replica."""

from __future__ import annotations

import asyncio

import pytest

from pettingflow.episode_context import episode_scope
from pettingflow.inference.client import InferenceError
from pettingflow.inference.replicas import NoReplicaError, ReplicaSet


class FakeReplica:
    """A client that answers after ``gate`` opens (so requests pile up in flight), or fails as told."""

    def __init__(self, name: str) -> None:
        self.base_url = name
        self.calls: list[tuple[str, list[int]]] = []
        self.fail: InferenceError | None = None
        self.gate = asyncio.Event()
        self.gate.set()

    async def complete_one(self, prompt_ids, *, model, **sampling):
        self.calls.append((model, list(prompt_ids)))
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return f"{self.base_url}:{model}"

    async def complete(self, prompt_ids, *, model, n=1, **sampling):
        return [await self.complete_one(prompt_ids, model=model, **sampling) for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_episodes_go_to_the_least_busy_replica_and_stay_there() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    replicas = ReplicaSet([a, b])

    async def scenario():
        a.gate.clear()  # a's first request stays in flight while the second episode arrives

        async def episode(key: str, turns: int) -> list[str]:
            with episode_scope(key):
                return [await replicas.complete_one([t], model="m") for t in range(turns)]

        first = asyncio.create_task(episode("e1", 3))
        await asyncio.sleep(0)
        assert replicas.in_flight == [1, 0]
        second = await episode("e2", 2)  # a is busy: e2 goes to b, and both its turns stay there
        a.gate.set()
        return await first, second

    first, second = run(scenario())
    assert first == ["a:m"] * 3 and second == ["b:m"] * 2
    assert replicas.stats() == {"requests": {"a": 3, "b": 2}, "down": {}}

    async def outside_any_episode():
        return [await replicas.complete_one([1], model="m") for _ in range(2)]

    assert run(outside_any_episode()) == ["a:m", "a:m"]  # nothing in flight: the lowest index wins each time
    replicas.in_flight = [5, 0]
    assert replicas.replica_for("e1") == 0 and replicas.replica_for("e2") == 1  # placed episodes stay put
    assert replicas.replica_for("e9") == 1 and replicas.replica_for(None) == 1  # new ones: the least busy


def test_a_dead_replica_moves_its_requests_and_episodes_to_the_others() -> None:
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    replicas = ReplicaSet([a, b, c])

    async def scenario():
        with episode_scope("e1"):
            assert await replicas.complete_one([1], model="m") == "a:m"
            a.fail = InferenceError("connection refused", url="a", attempts=4)
            assert await replicas.complete_one([2], model="m") == "b:m"  # moved, with the episode
            assert await replicas.complete_one([3], model="m") == "b:m"
        with episode_scope("e2"):
            return await replicas.complete(([4]), model="m", n=2)

    assert run(scenario()) == ["b:m", "b:m"]
    assert list(replicas.stats()["down"]) == ["a"] and "connection refused" in replicas.stats()["down"]["a"]
    assert a.calls == [("m", [1]), ("m", [2])] and b.calls[:2] == [("m", [2]), ("m", [3])]
    replicas.mark_up(0)
    assert replicas.replica_for("e3") == 0  # a restarted replica takes new episodes again
    replicas.mark_down(0, "gone again")
    replicas.revive()  # a later rollout call reusing the set: every replica up
    assert not replicas.down and replicas.replica_for("e4") == 0

    b.fail = c.fail = a.fail = InferenceError("timed out", url="x", status_code=504)
    with pytest.raises(NoReplicaError, match="every replica is down"):
        run(replicas.complete_one([5], model="m"))


def test_completions_and_rows_say_which_server_generated_them() -> None:
    from pettingflow.inference.client import _parse_completions
    from pettingflow.rollout.records import EpisodeId, EpisodeRecord, TurnRecord, per_turn_rows

    data = {
        "choices": [
            {
                "index": 0,
                "text": "x",
                "finish_reason": "stop",
                "token_ids": [5],
                "logprobs": {"token_logprobs": [-0.5], "tokens": ["x"]},
            }
        ]
    }
    (completion,) = _parse_completions(data, n=1, url="http://10.0.0.7:8000/v1/completions")
    assert completion.server == "http://10.0.0.7:8000"
    turn = TurnRecord(0, 0, "a", "p", None, [1], [5], [-0.5], "q", "x", "stop", server=completion.server)
    episode_id = EpisodeId(env_name="e", env_idx=0, group_id="g0", sample_idx=0, rollout_idx=0, seed=1)
    episode = EpisodeRecord(episode_id, turns=[turn])
    (row,) = per_turn_rows([episode], "run", 0, group_size=1)
    assert row["inference_server"] == "http://10.0.0.7:8000"


def test_a_bad_request_is_raised_not_taken_for_a_dead_replica() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    replicas = ReplicaSet([a, b])
    a.fail = InferenceError("prompt too long", url="a", status_code=400)
    with pytest.raises(InferenceError, match="prompt too long"):
        run(replicas.complete_one([1], model="m"))
    assert not replicas.down and b.calls == []
    with pytest.raises(ValueError, match="at least one client"):
        ReplicaSet([])
