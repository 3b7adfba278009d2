"""Team credit of tree candidates (rollout.tree.team_credit): a first agent whose choice matters only through what
its teammate then does gets credit for it with a lookahead (round, episode), and none when the team reward is the
episode's (shared) or read right after its own action (step)."""

from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
import pytest
from rollout_fakes import CharChatTokenizer, Prompt, ScriptedLLM

from pettingflow.configs import load_config
from pettingflow.configs.settings import SamplingSettings
from pettingflow.envs.base import Env
from pettingflow.rollout.engine import AgentBinding, EpisodeSpec, ExecutionEngine, group_specs
from pettingflow.rollout.records import build_rows
from pettingflow.steps.batches import with_advantages
from pettingflow.storage import trajectories_to_table

TOK = CharChatTokenizer()
K = 4


class RelayEnv(Env):
    """A chooser writes a word; a finisher reads it and answers. The team wins when the finisher says 'win', which
    it does (greedily) only after the word 'good': the chooser's choice matters only through the finisher."""

    def initial_state(self) -> dict[str, str]:
        return {"word": "", "answer": ""}

    def solved(self) -> bool:
        return self.state["answer"] == "win"

    def fork(self) -> RelayEnv:
        return self._copy_episode()

    def episode_info(self) -> dict[str, float]:
        return {"team_reward": 1.0 if self.solved() else 0.0}


class RelayAgent:
    """Chooser (writes ``state['word']``) or finisher (writes ``state['answer']``); no local reward either way."""

    def __init__(self, name: str, key: str):
        self.name, self.key = name, key
        self.sampling = SamplingSettings(temperature=1.0, max_tokens=8)
        self.reset()

    def reset(self) -> None:
        self.action, self.agent_reward, self.success, self.turn_info = "", 0.0, False, {}

    def fork(self) -> RelayAgent:
        return copy.copy(self)

    def update_from_env(self, turn: int, env: RelayEnv) -> Prompt:
        messages = [{"role": "user", "content": f"{self.name}|word={env.state['word']}"}]
        return Prompt(messages, TOK.apply_chat_template(messages, add_generation_prompt=True))

    def update_from_model(self, turn: int, env: RelayEnv, response: str) -> str:
        self.action = response.strip()
        return self.action

    async def step(self, env: RelayEnv) -> None:
        env.state[self.key] = self.action
        env.finish_turn({"agent": self.name})


def reply(model: str, prompt: str, params: dict) -> str:
    """The chooser samples: even seeds 'good', odd 'bad' (K = 4 candidates get two of each). The finisher answers
    from the word it reads, at any temperature."""
    if "chooser|" in prompt:
        return "good" if params["seed"] % 2 == 0 else "bad"
    return "win" if "word=good" in prompt else "lose"


def relay_rows(team_credit: str, max_turns: int = 2, token_budget: int = 1000) -> tuple[list[dict], ScriptedLLM, list]:
    llm = ScriptedLLM(TOK, reply=reply)
    agents = [("chooser", "word"), ("finisher", "answer")]
    bindings = {n: AgentBinding(client=llm, served_model=n, tokenizer=TOK, policy_name="shared") for n, _ in agents}
    engine = ExecutionEngine(
        lambda: [RelayAgent(n, key) for n, key in agents],
        bindings,
        max_turns=max_turns,
        token_budget=token_budget,
        show_progress=False,
        tree_branches=K,
        team_credit=team_credit,
    )

    def make_env(spec: EpisodeSpec) -> RelayEnv:
        return RelayEnv(spec.task, {"max_turns": max_turns}, env_idx=spec.id.env_idx)

    specs = group_specs([{"task_id": "relay"}], 1, 0, "relay", make_env)
    records, stats = asyncio.run(engine.run(specs))
    return build_rows(records, "per_turn", "run", 0, group_size=1), llm, [records, stats]


def chooser_advantages(rows: list[dict]) -> dict[str, float]:
    """The advantage of each of the chooser's candidates (its K rows of turn 0), by the word it chose."""
    config = load_config("plan-path", ["algorithm.team_reward_weight=1.0", "algorithm.gamma=0.0"])
    table = with_advantages(trajectories_to_table(rows), config)
    out: dict[str, list[float]] = {}
    for row in table.to_pylist():
        if row["turn_idx"] == 0:
            out.setdefault(row["response_text"].strip(), []).append(row["advantage"])
    return {word: float(np.mean(values)) for word, values in out.items()}


@pytest.mark.parametrize("mode", ["round", "episode"])
def test_a_lookahead_credits_the_choice_that_lets_the_teammate_win(mode: str) -> None:
    rows, _, _ = relay_rows(mode)
    advantages = chooser_advantages(rows)
    assert set(advantages) == {"good", "bad"}
    assert advantages["good"] > 0 > advantages["bad"]
    first = [r for r in rows if r["turn_idx"] == 0]
    for row in first:
        info = json.loads(row["info_json"])
        assert info["team_credit"] == mode and info["team_reward"] == (1.0 if row["response_text"] == "good" else 0.0)
        # the lookahead is stored with the candidate: the finisher's one greedy call
        (call,) = info["lookahead"]
        assert call["agent"] == "finisher" and call["turn"] == 1
        assert call["response_text"] == ("win" if row["response_text"] == "good" else "lose")


@pytest.mark.parametrize("mode", ["shared", "step"])
def test_without_a_lookahead_the_siblings_get_the_same_team_term(mode: str) -> None:
    """shared: the episode's team reward for all; step: the outcome right after the chooser's own word (no one
    has answered yet): the chooser's group has zero advantages either way."""
    rows, _, _ = relay_rows(mode)
    advantages = chooser_advantages(rows)
    assert set(advantages) == {"good", "bad"} and advantages["good"] == advantages["bad"] == 0.0
    assert not any("lookahead" in json.loads(r["info_json"]) for r in rows)


def test_lookahead_tokens_count_but_are_never_rows_and_use_the_lookahead_temperature() -> None:
    rows, llm, (records, stats) = relay_rows("round")
    (record,) = records
    # 2 turns of K candidates are the rows; the K lookahead calls (one per chooser candidate) are not
    assert len(rows) == 2 * K and {r["turn_idx"] for r in rows} == {0, 1}
    lookahead_calls = [c for c in llm.calls if c.get("n") is None and c["temperature"] == 0.0]
    assert len(lookahead_calls) == K
    candidate_tokens = sum(len(r["response_ids"]) for r in rows)
    lookahead_tokens = sum(
        len(c["response_ids"]) for r in rows for c in json.loads(r["info_json"]).get("lookahead", [])
    )
    assert lookahead_tokens > 0
    assert record.lookahead_tokens == stats.lookahead_tokens == lookahead_tokens
    assert record.tokens_generated == stats.tokens_generated == candidate_tokens + lookahead_tokens


def test_the_lookahead_stays_within_the_episode_token_budget() -> None:
    """A budget that holds the chooser's reply but not a finisher's reply after it: no lookahead call is made."""
    rows, _, _ = relay_rows("round", token_budget=5)  # 'good' or 'bad' + eos = 5 or 4 tokens
    good = next(r for r in rows if r["turn_idx"] == 0 and r["response_text"] == "good")
    assert "lookahead" not in json.loads(good["info_json"])  # 5 of 5 used: nothing left for the finisher


def test_team_credit_needs_tree_mode_and_a_team_outcome() -> None:
    with pytest.raises(ValueError, match=r"rollout\.mode=tree"):
        load_config("plan-path", ["rollout.tree.team_credit=round"])
    tree = ["rollout.mode=tree", "rollout.tree.branches=4", "env.group_size=1"]
    config = load_config("plan-path", [*tree, "rollout.tree.team_credit=round"])
    assert config.rollout.tree.team_credit == "round" and config.rollout.tree.lookahead_temperature == 0.0
    with pytest.raises(ValueError, match="needs tree_branches"):
        ExecutionEngine(list, {}, max_turns=2, token_budget=10, team_credit="step")

    class Silent(RelayEnv):
        def episode_info(self) -> dict[str, float]:
            return {}

    with pytest.raises(ValueError, match="reports none"):
        from pettingflow.rollout.engine import _team_outcome

        _team_outcome(Silent({"task_id": "x"}, {"max_turns": 2}), "step")
