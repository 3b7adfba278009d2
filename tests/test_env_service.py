"""Environments as services (docs/env-service.md): the HTTP+JSON protocol, the ``RemoteEnv`` proxy, and a rollout
whose episodes live on ``pettingflow env serve`` giving the same rows as in-process envs, failing clearly when the
service dies and resuming once it is back."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import process_list
import pytest
from fastapi.testclient import TestClient
from rollout_fakes import BoardEnv, CharChatTokenizer, ScriptedLLM, plan_path_engine_rows

from bench.scripted_server import plan_path_answer
from pettingflow.configs import load_config
from pettingflow.configs.loader import ConfigError
from pettingflow.envs.plan_path import Grid, ParsedMoves, PlanPathEnv, PlanPathState, TurnOutcome, parse_moves
from pettingflow.envs.service import client as service_client
from pettingflow.envs.service.client import (
    EnvServiceError,
    RemoteEnv,
    RemoteEnvError,
    ServiceClient,
    remote_class,
)
from pettingflow.envs.service.protocol import PROTOCOL, TOKEN_ENV, CodecError, from_json, remote_methods, to_json
from pettingflow.envs.service.server import check_bind, create_app
from pettingflow.processes import free_port

TASK = {"task_id": "plan-path/3", "seed": 3}
BOARD = ["S.#.", "..#.", "....", "#..G"]
URL = "http://127.0.0.1:9"  # never contacted: the TestClient answers
TOK = CharChatTokenizer()


@pytest.fixture
def service() -> Iterator[TestClient]:
    with TestClient(create_app("plan-path"), raise_server_exceptions=False) as tc:
        yield tc


def post(tc: TestClient, path: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    return tc.post(f"/v1{path}", json={"protocol": PROTOCOL, **(body or {})}, **kw)


def create(tc: TestClient, episode_id: str = "ep-1", headers: dict | None = None, **over: Any) -> httpx.Response:
    body = {"episode_id": episode_id, "env": {"class_path": "plan-path", "config": {}}, "task": TASK, "seed": 5}
    return post(tc, "/episodes", {**body, **over}, headers=headers)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert body["protocol"] == PROTOCOL and set(body) == {"protocol", "error"}, body
    return body["error"]


# --------------------------------------------------------------------------------------------------
# the protocol over HTTP
# --------------------------------------------------------------------------------------------------
def test_create_observe_step_fork_close(service: TestClient) -> None:
    info = service.get("/v1/info").json()
    assert info["protocol"] == PROTOCOL
    assert info["env"] == {"name": "plan-path", "class_path": "pettingflow.envs.plan_path:PlanPathEnv"}
    assert {"submit_plan", "execute", "finish_turn", "reset"} <= set(info["methods"])
    assert info["methods"]["execute"] == {"params": ["parsed"], "async": False}

    created = create(service)
    assert created.status_code == 200
    episode = created.json()["episode"]
    local = PlanPathEnv(TASK, {}, seed=5)
    assert episode["episode_id"] == "ep-1" and episode["current_turn"] == 0 and episode["seed"] == 5
    assert episode["state"] == to_json(local.state) and episode["state"]["grid"]["start"] == [*local.state.grid.start]
    assert episode["team_outcome"] == 0.0 and episode["episode_info"]["grid"] == local.state.grid.to_rows()
    assert post(service, "/episodes/ep-1/observe").json()["episode"] == episode

    moves = local.state.grid.shortest_path()[:1]
    stepped = post(service, "/episodes/ep-1/step", {"method": "execute", "args": {"parsed": {"moves": moves}}})
    assert stepped.status_code == 200, stepped.text
    want = local.execute(ParsedMoves(tuple(moves)))
    assert stepped.json()["result"] == to_json(want)
    assert stepped.json()["episode"]["state"] == to_json(local.state)
    done = post(service, "/episodes/ep-1/step", {"method": "finish_turn", "args": {"record": {"agent_name": "x"}}})
    assert done.json()["episode"]["current_turn"] == 1 and done.json()["episode"]["history"] == [
        {"turn": 0, "agent_name": "x"}
    ]

    forked = post(service, "/episodes/ep-1/fork", {"new_episode_id": "ep-2"})
    assert forked.status_code == 200 and forked.json()["episode"]["state"] == to_json(local.state)
    assert post(service, "/episodes/ep-1/fork", {"new_episode_id": "ep-2"}).json() == forked.json()  # a replay
    post(service, "/episodes/ep-2/step", {"method": "execute", "args": {"parsed": {"moves": ["U", "U"]}}})
    assert post(service, "/episodes/ep-1/observe").json()["episode"]["state"] == to_json(local.state)  # untouched

    closed = post(service, "/close", {"episode_ids": ["ep-1", "ep-2", "nope"]}).json()
    assert closed == {"protocol": PROTOCOL, "closed": ["ep-1", "ep-2"], "unknown": ["nope"]}
    gone = post(service, "/episodes/ep-1/observe")
    assert gone.status_code == 404 and error_of(gone)["type"] == "unknown_episode"


def test_create_is_idempotent_by_id_and_a_reused_id_conflicts(service: TestClient) -> None:
    first = create(service).json()
    assert create(service).json() == first  # a retried create gets the same episode
    clash = create(service, seed=6)
    assert clash.status_code == 409 and error_of(clash)["type"] == "episode_exists"


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        ({"protocol": 2}, 400, "protocol_mismatch", "sent protocol 2; this side speaks env service protocol 1"),
        ({}, 400, "protocol_mismatch", "sent no protocol"),
        ({"protocol": 1, "method": "_turn_info", "args": {}}, 400, "unknown_method", "has no method '_turn_info'"),
        ({"protocol": 1, "method": "execute", "args": {"moves": []}}, 400, "bad_request", "no parameters ['moves']"),
        ({"protocol": 1, "method": "execute", "args": {"parsed": {"moves": "R"}}}, 400, "bad_request", "JSON array"),
        ({"protocol": 1, "method": "execute"}, 422, "env_error", "execute raised TypeError"),
        ({"protocol": 1, "args": {}}, 400, "bad_request", "method: Field required"),
    ],
)
def test_bad_step_requests_are_refused_with_the_error_format(
    service: TestClient, body: dict, status: int, kind: str, words: str
) -> None:
    create(service)
    response = service.post("/v1/episodes/ep-1/step", json=body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["type"] == kind and words in error["message"], error


def test_unknown_episodes_routes_envs_and_bodies(service: TestClient) -> None:
    missing = post(service, "/episodes/never/step", {"method": "execute", "args": {"parsed": {"moves": []}}})
    assert missing.status_code == 404
    assert error_of(missing)["type"] == "unknown_episode" and "'never'" in error_of(missing)["message"]
    route = post(service, "/nowhere")
    assert route.status_code == 404 and error_of(route)["type"] == "not_found"
    wrong = create(service, env={"class_path": "code-env", "config": {}})
    assert wrong.status_code == 400 and "serves plan-path" in error_of(wrong)["message"]
    config = create(service, env={"class_path": "plan-path", "config": {"rows": 1}})
    assert config.status_code == 400 and "rows" in error_of(config)["message"]
    not_json = service.post("/v1/episodes", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and error_of(not_json)["type"] == "bad_request"
    bad_id = create(service, episode_id="../x")
    assert bad_id.status_code == 400 and "must match" in error_of(bad_id)["message"]


def test_errors_the_env_raises_are_env_errors(service: TestClient) -> None:
    no_seed = create(service, task={"task_id": "t"})
    assert no_seed.status_code == 422
    assert error_of(no_seed)["exception"] == "ValueError" and "needs a 'seed'" in error_of(no_seed)["message"]
    create(service, task={"task_id": "t", "grid": BOARD}, env={"class_path": "plan-path", "config": {"max_turns": 1}})
    post(service, "/episodes/ep-1/step", {"method": "finish_turn", "args": {}})
    again = post(service, "/episodes/ep-1/step", {"method": "finish_turn", "args": {}})
    assert again.status_code == 422 and error_of(again)["exception"] == "RuntimeError"
    assert "already done" in error_of(again)["message"]


def test_a_full_service_refuses_new_episodes() -> None:
    with TestClient(create_app("plan-path", max_episodes=1), raise_server_exceptions=False) as tc:
        assert create(tc).status_code == 200
        full = create(tc, episode_id="ep-2")
        assert full.status_code == 503 and error_of(full)["type"] == "service_full"


def test_the_token_is_checked_on_every_request() -> None:
    token = "t" * 32
    with TestClient(create_app("plan-path", token=token), raise_server_exceptions=False) as tc:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            for response in (tc.get("/v1/info", headers=headers), create(tc, headers=headers)):
                assert response.status_code == 401 and error_of(response)["type"] == "unauthorized"
        ok = {"Authorization": f"Bearer {token}"}
        assert tc.get("/v1/info", headers=ok).status_code == 200 and create(tc, headers=ok).status_code == 200
        client = ServiceClient(URL, token=token, http=tc)
        assert client.observe("ep-1")["episode_id"] == "ep-1"
        with pytest.raises(EnvServiceError, match="401 unauthorized"):
            ServiceClient(URL, token="x" * 32, http=tc).observe("ep-1")


def test_beyond_loopback_needs_a_token_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PETTINGFLOW_ENV_TOKEN", raising=False)
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    with pytest.raises(ValueError, match="needs a token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(ValueError, match="at least 16"):
        check_bind("0.0.0.0", "short")
    check_bind("0.0.0.0", "s" * 16)
    with pytest.raises(EnvServiceError, match="set PETTINGFLOW_ENV_TOKEN"):
        ServiceClient("http://10.1.2.3:8780")
    monkeypatch.setenv("PETTINGFLOW_ENV_TOKEN", "s" * 16)
    assert ServiceClient("http://10.1.2.3:8780").token == "s" * 16
    cli = subprocess.run(
        [sys.executable, "-m", "pettingflow.cli", "env", "serve", "plan-path", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in __import__("os").environ.items() if k != "PETTINGFLOW_ENV_TOKEN"},
    )
    assert cli.returncode == 2 and "needs a token" in cli.stderr


# --------------------------------------------------------------------------------------------------
# the client: retries, errors, protocol
# --------------------------------------------------------------------------------------------------
def scripted_transport(answers: list[Any], seen: list[str]) -> httpx.Client:
    """An HTTP client whose answers are ``answers`` in order: an exception to raise or (status, body)."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        return httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(handle), base_url=URL)


def test_only_idempotent_calls_are_retried_and_errors_name_the_service_and_call() -> None:
    snap = {"protocol": PROTOCOL, "episode": {"episode_id": "e"}}
    refused = httpx.ConnectError("connection refused")
    seen: list[str] = []
    client = ServiceClient(URL, http=scripted_transport([refused, (503, {}), (200, snap)], seen))
    assert client.observe("e") == {"episode_id": "e"} and len(seen) == 3

    seen.clear()
    client = ServiceClient(URL, http=scripted_transport([refused, (200, snap)], seen))
    with pytest.raises(EnvServiceError) as err:
        client.step("e", "execute", {})
    assert seen == ["/v1/episodes/e/step"]  # never retried
    assert str(err.value).startswith(f"env service {URL}: step execute (episode e) failed: cannot connect")

    seen.clear()
    client = ServiceClient(URL, http=scripted_transport([httpx.ReadTimeout("slow")] * 3, seen))
    with pytest.raises(EnvServiceError, match=r"create \(episode e, task 't'\) failed: no answer within 60 s"):
        client.create("e", "plan-path", {}, {"task_id": "t"}, seed=1, env_idx=0, rollout_idx=0)
    assert len(seen) == 3

    seen.clear()
    crash = {"protocol": PROTOCOL, "error": {"type": "internal", "message": "boom"}}
    client = ServiceClient(URL, http=scripted_transport([(500, crash)], seen))
    with pytest.raises(EnvServiceError, match="HTTP 500 internal: boom"):
        client.observe("e")
    assert len(seen) == 1  # a 500 is the service's bug, not a passing failure

    env_error = {"protocol": PROTOCOL, "error": {"type": "env_error", "message": "no", "exception": "KeyError"}}
    client = ServiceClient(URL, http=scripted_transport([(422, env_error)], []))
    with pytest.raises(RemoteEnvError) as raised:
        client.step("e", "execute", {})
    assert raised.value.exception == "KeyError" and raised.value.status == 422


def test_an_answer_in_another_protocol_version_is_refused() -> None:
    client = ServiceClient(URL, http=scripted_transport([(200, {"protocol": 2, "episode": {}})], []))
    with pytest.raises(EnvServiceError, match="answered with protocol 2; this client speaks protocol 1"):
        client.observe("e")


# --------------------------------------------------------------------------------------------------
# the codec
# --------------------------------------------------------------------------------------------------
def test_state_results_and_arguments_round_trip_through_json() -> None:
    env = PlanPathEnv({"task_id": "t", "grid": BOARD}, {"reward": "shaped"}, seed=1)
    env.submit_plan(parse_moves("Plan: R D", 3))
    outcome = env.execute(parse_moves("Moves: D D R U", 3))
    text = json.dumps(to_json(env.state))
    state = from_json(json.loads(text), PlanPathState)
    assert state == env.state and isinstance(state.grid.walls, frozenset) and isinstance(state.position, tuple)
    assert json.loads(text)["grid"]["walls"] == [[0, 2], [1, 2], [3, 0]]  # sets in a fixed order
    assert from_json(json.loads(json.dumps(to_json(outcome))), TurnOutcome) == outcome
    with pytest.raises(CodecError, match="Grid has no fields"):
        from_json({**to_json(env.state.grid), "extra": 1}, Grid)
    with pytest.raises(CodecError, match=r"state.shaped_return: nan is not a JSON number"):
        env.state.shaped_return = math.nan
        to_json(env.state, "state")
    with pytest.raises(CodecError, match="cannot be sent"):
        to_json(object())
    methods = remote_methods(PlanPathEnv)
    assert set(methods) == {"reset", "finish_turn", "submit_plan", "execute", "distance"}
    assert methods["execute"].decode_args({"parsed": {"moves": ["R"], "ignored": 2}}) == {
        "parsed": ParsedMoves(("R",), 2)
    }


# --------------------------------------------------------------------------------------------------
# RemoteEnv: an Env whose methods run on the service
# --------------------------------------------------------------------------------------------------
def open_remote(tc: TestClient, task=TASK, config=None, seed: int = 5) -> RemoteEnv:
    return remote_class(PlanPathEnv).open(ServiceClient(URL, http=tc), task, config, seed=seed)


def test_a_remote_env_behaves_like_the_env_for_agents_and_engine(service: TestClient) -> None:
    remote, local = open_remote(service), PlanPathEnv(TASK, {}, seed=5)
    assert isinstance(remote, PlanPathEnv) and isinstance(remote, RemoteEnv)
    assert remote.state == local.state and remote.config == local.config and remote.max_turns == 4
    remote.reset(5)  # right after open with the same seed: nothing to do
    path = local.state.grid.shortest_path()
    for moves in (path[:1], path[1:]):
        parsed = ParsedMoves(tuple(moves))
        assert remote.submit_plan(parsed) == local.submit_plan(parsed)
        for env in (remote, local):
            env.finish_turn({"agent_name": "planner"})
        twin, local_twin = remote.fork(), local.fork()
        assert twin.execute(ParsedMoves(("U",))) == local_twin.execute(ParsedMoves(("U",)))
        assert twin.state == local_twin.state and remote.state == local.state  # the fork left the episode alone
        assert remote.execute(parsed) == local.execute(parsed)
        for env in (remote, local):
            env.finish_turn({"agent_name": "executor"})
        assert (remote.current_turn, remote.done, remote.history) == (local.current_turn, local.done, local.history)
    assert remote.done and local.done and remote.episode_id is None  # over: closed on the service
    assert remote.outcome == local.outcome == "solved" and not remote.failed()
    assert remote.team_outcome() == local.team_outcome() == 1.0 and remote.episode_info() == local.episode_info()
    assert remote.solved() and remote.fork().state == remote.state  # a finished episode is copied here
    with pytest.raises(RuntimeError, match="already done"):
        remote.finish_turn()
    remote.reset(5)  # a new episode on the service
    assert (
        remote.episode_id is not None
        and remote.current_turn == 0
        and remote.state == PlanPathEnv(TASK, {}, seed=5).state
    )
    with pytest.raises(AttributeError, match="other attributes of PlanPathEnv live on its service"):
        remote._distances  # noqa: B018


def test_abandoned_episodes_are_closed_in_batches(service: TestClient) -> None:
    remote = open_remote(service)
    count = service.app.state.service.episodes
    forks = [remote.fork() for _ in range(service_client.CLOSE_BATCH)]
    assert len(count) == 1 + service_client.CLOSE_BATCH
    del forks  # garbage: their finalizers queue them for closing
    remote.distance(remote.state.position)  # the next call sends the batch
    assert len(count) == 1


def test_an_env_without_fork_or_json_state_fails_clearly() -> None:
    with TestClient(create_app("rollout_fakes:BoardEnv"), raise_server_exceptions=False) as tc:
        env = remote_class(BoardEnv).open(ServiceClient(URL, http=tc), {"task_id": "b"}, {"label": "z"})
        assert env.state.board == [] and env.config.label == "z" and not hasattr(env, "episode_info")
        with pytest.raises(NotImplementedError, match="cannot fork an episode"):
            env.fork()
        with pytest.raises(CodecError, match=r"finish_turn\(record\)\['x'\]: a object cannot be sent"):
            env.finish_turn({"x": object()})  # refused here, before anything is sent
        assert env.current_turn == 0


# --------------------------------------------------------------------------------------------------
# the engine over a service
# --------------------------------------------------------------------------------------------------
def reply(model: str, prompt: str, params: dict[str, Any]) -> str:
    return plan_path_answer(prompt, params["seed"]) or "?"


def engine_rows(monkeypatch: pytest.MonkeyPatch, server: str | None, **kw: Any) -> tuple[list, list]:
    """``plan_path_engine_rows`` with ``env.server`` set (or not): (records, rows)."""
    real = load_config

    def with_server(name: str, overrides: list[str]) -> Any:
        return real(name, [*overrides, *([f"env.server={server}"] if server else [])])

    monkeypatch.setattr("pettingflow.configs.load_config", with_server)
    tasks = [{"task_id": "a", "grid": BOARD}, TASK, {"task_id": "plan-path/8", "seed": 8}]
    records, _, rows, _ = plan_path_engine_rows(reply, tokenizer=TOK, tasks=tasks, **kw)
    monkeypatch.setattr("pettingflow.configs.load_config", real)
    return records, rows


@pytest.mark.parametrize("mode", [{}, {"tree_branches": 3}], ids=["independent", "tree"])
def test_the_engine_gives_the_same_rows_with_remote_envs(
    service: TestClient, monkeypatch: pytest.MonkeyPatch, mode: dict
) -> None:
    monkeypatch.setattr(service_client, "client_for", lambda url: ServiceClient(url, http=service))
    _, want = engine_rows(monkeypatch, None, **mode)
    records, got = engine_rows(monkeypatch, URL, **mode)
    assert got == want and len(got) > 6
    endings = {r.info.get("goal_reached") for r in records}  # episode_info, from the service's last snapshot
    assert endings == ({True} if mode else {True, False})


def test_tree_team_credit_with_lookahead_gives_the_same_rows_with_remote_envs(
    service: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``team_credit: round`` forks each candidate again and plays on (a lookahead), reading ``team_outcome`` on
    forks, finished ones included."""
    from pettingflow.agents import build_agent
    from pettingflow.envs import EnvCache
    from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
    from pettingflow.rollout.local import episode_specs
    from pettingflow.rollout.records import build_rows

    monkeypatch.setattr(service_client, "client_for", lambda url: ServiceClient(url, http=service))

    def rows(*server: str) -> list[dict]:
        config = load_config("plan-path", ["env.max_turns=6", *server])
        tasks = [{"task_id": "a", "grid": BOARD}, TASK]
        specs = episode_specs(config, tasks, group_size=1, seed_namespace="t/", env_cache=EnvCache())
        llm = ScriptedLLM(TOK, reply=reply)
        engine = ExecutionEngine(
            lambda: [build_agent(a, agent_idx=i, tokenizer=TOK) for i, a in enumerate(config.agents)],
            {a.name: AgentBinding(llm, a.name, TOK, "shared") for a in config.agents},
            max_turns=6,
            token_budget=config.env.token_budget,
            show_progress=False,
            tree_branches=3,
            team_credit="round",
        )
        records, _ = asyncio.run(engine.run(specs))
        return build_rows(records, "per_turn", "run", 0, group_size=1)

    want = rows()
    assert any(json.loads(r["info_json"]).get("lookahead") for r in want)
    assert rows(f"env.server={URL}") == want


@pytest.mark.sandbox
def test_the_code_env_agents_work_against_a_remote_code_env() -> None:
    """Coroutine env methods (the sandbox runs) and the code agents' reward arithmetic, as in-process."""
    from pettingflow.agents.code_agents import CodeGeneratorAgent, UnitTestGeneratorAgent
    from pettingflow.configs.settings import SandboxSettings
    from pettingflow.envs import CodeEnv, load_humaneval

    task = next(t for t in load_humaneval() if t["task_id"] == "HumanEval/0")
    config = {"sandbox": SandboxSettings(timeout_s=20).model_dump(), "max_turns": 3}
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    tests = "```python\nassert has_close_elements([1.0, 2.0, 3.0], 0.5) == False\n```"
    right = f"```python\n{task['prompt']}{task['canonical_solution']}\n```"

    def play(env: Any) -> list[Any]:
        code, test = CodeGeneratorAgent(tokenizer=TOK), UnitTestGeneratorAgent(tokenizer=TOK)
        seen = []
        for turn, (agent, text) in enumerate([(code, wrong), (test, tests), (code, right)]):
            prompt = agent.update_from_env(turn, env).messages
            agent.update_from_model(turn, env, text)
            asyncio.run(agent.step(env))
            seen.append((prompt, agent.agent_reward, agent.success, agent.turn_info))
        return [*seen, env.done, env.truncated, env.outcome, env.episode_info(), env.history]

    with TestClient(create_app("code-env"), raise_server_exceptions=False) as tc:
        remote = remote_class(CodeEnv).open(ServiceClient(URL, http=tc), task, config, seed=0)
        assert isinstance(remote, CodeEnv) and remote.state == CodeEnv(task, config, seed=0).state
        got = play(remote)
    want = play(CodeEnv(task, config, seed=0))
    assert got == want
    assert want[2][1] == 1.0 and want[-5] is True and want[-3] == "solved"  # the right code solved it


def test_env_server_must_be_urls() -> None:
    assert load_config("plan-path", ["env.server=http://127.0.0.1:8780"]).env.server == "http://127.0.0.1:8780"
    assert load_config("plan-path").env.server is None
    with pytest.raises(ConfigError, match="not URLs"):
        load_config("plan-path", ["env.server=127.0.0.1:8780"])
    with pytest.raises(ConfigError, match="empty list"):
        load_config("plan-path", ["env.server=[]"])


# --------------------------------------------------------------------------------------------------
# `pettingflow env serve` in a process of its own
# --------------------------------------------------------------------------------------------------
class ServiceProcess:
    """``pettingflow env serve plan-path`` on a free loopback port; ``kill`` ends it as a crash would. ``token``:
    the service's, given as users should, in ``$PETTINGFLOW_ENV_TOKEN`` (never ``--token``)."""

    def __init__(self, token: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "pettingflow.cli", "env", "serve", "plan-path", "--port", str(self.port)]
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | ({TOKEN_ENV: self.token} if self.token else {})
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            try:
                if httpx.get(f"{self.url}/v1/info", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError(f"the env service on {self.url} did not answer within 90 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def test_a_token_that_begins_with_a_dash_works_and_stays_out_of_the_process_list(monkeypatch) -> None:
    """The token as users give it, in ``$PETTINGFLOW_ENV_TOKEN`` on both sides: one that begins with "-" (as a
    ``secrets.token_urlsafe`` token may) is read whole by ``pettingflow env serve`` and by the client, a request
    without it is refused, and no process's command line holds it. ``--token`` takes such a token as its value too
    (click, unlike argparse, takes the next argument whatever it looks like): refused here only for its length."""
    import secrets

    from typer.testing import CliRunner

    from pettingflow.cli import app

    short = CliRunner().invoke(app, ["env", "serve", "plan-path", "--host", "0.0.0.0", "--token", "-abc"])
    assert short.exit_code != 0 and "at least 16 characters" in short.output
    token = "-" + secrets.token_urlsafe(32)
    service = ServiceProcess(token=token)
    service.start()
    try:
        assert httpx.get(f"{service.url}/v1/info", timeout=5).status_code == 401
        monkeypatch.setenv(TOKEN_ENV, token)
        assert ServiceClient(service.url).info()["protocol"] == PROTOCOL
        assert token.encode() not in Path(f"/proc/{service.proc.pid}/cmdline").read_bytes()
        assert process_list.showing([token]) == []
    finally:
        service.kill()


@pytest.fixture
def env_service() -> Iterator[ServiceProcess]:
    service = ServiceProcess()
    service.start()
    try:
        yield service
    finally:
        service.kill()


@pytest.mark.slow
def test_pettingflow_env_serve_runs_the_episodes_with_the_same_rows(
    env_service: ServiceProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    for mode in ({}, {"tree_branches": 2}):
        _, want = engine_rows(monkeypatch, None, **mode)
        _, got = engine_rows(monkeypatch, env_service.url, **mode)
        assert got == want


class GatedLLM(ScriptedLLM):
    """The scripted LLM as the rollout's inference client; episodes of groups other than g0 wait at their first
    call until ``gate`` opens, so g0 is committed before anything else happens."""

    gate: asyncio.Event | None = None
    hold = False

    async def _answer(self, prompt_ids: list[int], model: str, params: dict[str, Any]) -> Any:
        from pettingflow.episode_context import current_episode

        if GatedLLM.hold and not (current_episode.get() or "").startswith("g0/"):
            if GatedLLM.gate is None:
                GatedLLM.gate = asyncio.Event()
            await GatedLLM.gate.wait()
        return await super()._answer(prompt_ids, model, params)

    async def aclose(self) -> None:
        pass


@pytest.mark.slow
def test_a_dead_service_fails_the_step_clearly_and_the_step_resumes_when_it_is_back(
    env_service: ServiceProcess, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from pettingflow.runs.context import IterationContext
    from pettingflow.runs.endpoint import PolicyEndpoint
    from pettingflow.steps.rollouts import collect_step
    from pettingflow.storage import RunLayout, TrajectoryShards, read_step_trajectories

    monkeypatch.setattr("pettingflow.rollout.local.load_tokenizer", lambda model_dir: TOK)
    monkeypatch.setattr("pettingflow.rollout.local.InferenceClient", lambda url, **kw: GatedLLM(TOK, reply=reply))
    endpoints = {"shared": PolicyEndpoint("shared", "http://127.0.0.1:9", "shared", str(tmp_path))}
    base = [f"run.storage_root={tmp_path}", "env.tasks_per_iteration=3", "env.group_size=2", "env.max_turns=4"]

    def collect(run_id: str, *extra: str) -> Any:
        config = load_config("plan-path", [*base, *extra])
        layout = RunLayout(str(tmp_path), run_id)
        return layout, collect_step(IterationContext(layout, 0), config, endpoints, show_progress=False)

    reference_layout, reference = collect("in-process")

    real_write = TrajectoryShards.write

    def write_then_kill(self: TrajectoryShards, key: int, rows: Any) -> Any:
        out = real_write(self, key, rows)
        env_service.kill()  # the service dies once group 0 is committed; the other groups are mid-episode
        GatedLLM.hold = False
        if GatedLLM.gate is not None:
            GatedLLM.gate.set()
        return out

    monkeypatch.setattr(TrajectoryShards, "write", write_then_kill)
    GatedLLM.hold, GatedLLM.gate = True, None
    with pytest.raises(EnvServiceError) as failed:
        collect("remote", f"env.server={env_service.url}")
    message = str(failed.value)
    assert message.startswith(f"env service {env_service.url}: step ") and "cannot connect" in message, message
    layout = RunLayout(str(tmp_path), "remote")
    assert not layout.step(0, "rollouts").is_committed()
    assert sorted(TrajectoryShards(layout.step(0, "rollouts")).committed()) == [0]

    monkeypatch.setattr(TrajectoryShards, "write", real_write)
    env_service.start()  # the service is back (empty: the episodes it held died with it)
    _, resumed = collect("remote", f"env.server={env_service.url}")
    assert resumed.metrics["groups_resumed"] == 1 and resumed.metrics["episodes"] == 2 * 2

    def comparable(layout: RunLayout) -> list[dict]:
        rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
        return [{k: v for k, v in r.items() if k not in ("run_id", "uid")} for r in rows]

    assert comparable(layout) == comparable(reference_layout) and resumed.rows == reference.rows
