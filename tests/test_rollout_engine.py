"""Execution engine with a scripted LLM: turn order, groups, masks in both layouts, UIDs, budgets."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter

import pytest
from rollout_fakes import EOS, CharChatTokenizer, ScriptedLLM, ToyAgent, ToyEnv

from pettingflow.rollout.engine import AgentBinding, ExecutionEngine, group_specs
from pettingflow.rollout.records import build_rows
from pettingflow.storage import RunLayout, read_step_trajectories, trajectories_to_table, write_trajectories

TOK = CharChatTokenizer()


def make_engine(llm, layout="per_turn", max_turns=4, token_budget=1000, names=("coder", "tester"), max_model_len=None):
    bindings = {n: AgentBinding(client=llm, served_model=f"m-{n}", tokenizer=TOK, policy_name="shared") for n in names}
    envs: list[ToyEnv] = []

    def make_env(spec):
        env = ToyEnv(spec.task, max_turns)
        envs.append(env)
        return env

    engine = ExecutionEngine(
        lambda: [ToyAgent(n, TOK, layout) for n in names],
        bindings,
        max_turns=max_turns,
        token_budget=token_budget,
        layout=layout,
        max_model_len=max_model_len,
        show_progress=False,
    )
    return engine, make_env, envs


def run(engine, specs):
    return asyncio.run(engine.run(specs))


def test_turn_order_and_env_is_the_only_channel() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: model.upper())
    engine, make_env, envs = make_engine(llm)
    records, stats = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    (rec,) = records
    assert [t.agent_name for t in rec.turns] == ["coder", "tester", "coder", "tester"]
    assert [t.turn_idx for t in rec.turns] == [0, 1, 2, 3]
    assert [c["model"] for c in llm.calls] == ["m-coder", "m-tester", "m-coder", "m-tester"]
    # the tester's first prompt shows what the coder wrote, through env.state only
    assert "coder:M-CODER" in llm.calls[1]["prompt"]
    assert envs[0].state.board == ["coder:M-CODER", "tester:M-TESTER", "coder:M-CODER", "tester:M-TESTER"]
    assert rec.truncated and not rec.done
    assert stats.turns == 4 and stats.episodes == 1


def test_groups_share_task_and_seed_samples_get_distinct_sampling_seeds() -> None:
    llm = ScriptedLLM(TOK)
    engine, make_env, envs = make_engine(llm, max_turns=2)
    specs = group_specs(["A", "B"], 3, base_seed=7, env_name="toy", make_env=make_env)
    assert [(s.id.env_idx, s.id.sample_idx, s.id.rollout_idx) for s in specs] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (1, 0, 3),
        (1, 1, 4),
        (1, 2, 5),
    ]
    records, _ = run(engine, specs)
    assert [r.id.rollout_idx for r in records] == [0, 1, 2, 3, 4, 5]
    seeds_by_group = {}
    for env, spec in zip(envs, specs, strict=True):
        seeds_by_group.setdefault(spec.id.env_idx, set()).update(env.reset_seeds)
    assert len(seeds_by_group[0]) == 1 and len(seeds_by_group[1]) == 1
    assert seeds_by_group[0] != seeds_by_group[1]
    first_turn_seeds = [c["seed"] for c in llm.calls if c["prompt"] == "<user>A|" + EOS + "\n<assistant>"]
    assert len(set(first_turn_seeds)) == 3  # same task, same turn, three different sampling seeds
    assert all(c["temperature"] == 0.7 for c in llm.calls)


def test_per_turn_rows_masks_and_uids() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "ab")
    engine, make_env, _ = make_engine(llm, max_turns=3)
    records, _ = run(engine, group_specs(["A", "B"], 2, 0, "toy", make_env))
    rows = build_rows(records, "per_turn", run_id="r", iteration=0, group_size=2)
    assert len(rows) == 4 * 3
    for row in rows:
        assert row["response_ids"] == [ord("a"), ord("b"), ord(EOS)]
        assert row["response_mask"] == [1, 1, 1]
        assert len(row["sampler_logprobs"]) == 3
        assert TOK.decode(row["prompt_ids"]).endswith("<assistant>")
    # a UID = (group, turn, agent): exactly the 2 samples of a group share it
    by_uid = Counter(r["uid"] for r in rows)
    assert set(by_uid.values()) == {2}
    assert len(by_uid) == 2 * 3
    key = {(r["rollout_idx"] // 2, r["turn_idx"], r["agent_idx"]): r["uid"] for r in rows}
    assert len(set(key.values())) == len(key)
    trajectories_to_table(rows)  # the schema accepts them


def test_per_episode_rows_concatenate_actions_and_env_tokens_with_exact_mask() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "xy")
    engine, make_env, _ = make_engine(llm, layout="per_episode", max_turns=4)
    records, _ = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    rows = build_rows(records, "per_episode", run_id="r", iteration=0, group_size=1)
    assert [r["agent_name"] for r in rows] == ["coder", "tester"]
    coder = rows[0]
    assert TOK.decode(coder["prompt_ids"]) == "<user>T|" + EOS + "\n<assistant>"
    action = [ord("x"), ord("y"), ord(EOS)]
    # between its two actions the env adds: the newline closing the answer, the new user message,
    # and the next assistant header; the model's own EOS is not repeated
    env_text = "\n<user>T|coder:xy/tester:xy" + EOS + "\n<assistant>"
    env_ids = TOK.encode(env_text)
    assert coder["response_ids"] == action + env_ids + action
    assert coder["response_mask"] == [1, 1, 1] + [0] * len(env_ids) + [1, 1, 1]
    assert coder["sampler_logprobs"][3 : 3 + len(env_ids)] == [0.0] * len(env_ids)
    # the second call's prompt is exactly the sequence so far: no re-tokenization of model text
    second_coder_call = llm.calls[2]
    assert second_coder_call["prompt_ids"] == coder["prompt_ids"] + action + env_ids
    assert coder["turn_idx"] == 0 and coder["reward"] == 3.0


def test_per_episode_without_eos_closes_the_message_with_env_tokens() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "xy", end_with_eos=False)
    engine, make_env, _ = make_engine(llm, layout="per_episode", max_turns=3, names=("solo",))
    records, _ = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    (row,) = build_rows(records, "per_episode", run_id="r", iteration=0, group_size=1)
    action = [ord("x"), ord("y")]
    env1 = TOK.encode(EOS + "\n<user>T|solo:xy" + EOS + "\n<assistant>")
    env2 = TOK.encode(EOS + "\n<user>T|solo:xy/solo:xy" + EOS + "\n<assistant>")
    assert row["response_ids"] == action + env1 + action + env2 + action
    assert row["response_mask"] == [1, 1] + [0] * len(env1) + [1, 1] + [0] * len(env2) + [1, 1]


def test_episode_ends_on_success() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "DONE" if model == "m-tester" else "try")
    engine, make_env, _ = make_engine(llm, max_turns=6)
    (rec,), stats = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    assert len(rec.turns) == 2 and rec.done and not rec.truncated
    assert stats.per_agent["tester"]["success_rate"] == 1.0
    assert stats.per_agent["coder"]["success_rate"] == 0.0


def test_token_budget_caps_requests_and_truncates() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "abcdefgh")
    engine, make_env, _ = make_engine(llm, max_turns=6, token_budget=12)
    (rec,), _ = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    assert [c["max_tokens"] for c in llm.calls] == [12, 3]  # 9 tokens used (8 + EOS), 3 left
    assert rec.tokens_generated == 12
    assert rec.truncated and len(rec.turns) == 2


def test_context_length_caps_max_tokens() -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "z" * 50)
    engine, make_env, _ = make_engine(llm, max_turns=1, max_model_len=30, names=("solo",))
    run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    assert llm.calls[0]["max_tokens"] == 30 - len(llm.calls[0]["prompt_ids"])


def test_rows_write_and_read_back(tmp_path) -> None:
    llm = ScriptedLLM(TOK)
    engine, make_env, _ = make_engine(llm, max_turns=2)
    records, _ = run(engine, group_specs(["A", "B"], 2, 0, "toy", make_env))
    layout = RunLayout(str(tmp_path), "run-x")
    step = layout.step(0, "rollouts")
    write_trajectories(step, build_rows(records, "per_turn", "run-x", 0, 2))
    table = read_step_trajectories(step)
    assert table.num_rows == 8
    assert all(
        len(m) == len(r) and 1 in m
        for m, r in zip(
            table.column("response_mask").to_pylist(), table.column("response_ids").to_pylist(), strict=True
        )
    )


def test_unknown_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="per_turn or per_episode"):
        make_engine(ScriptedLLM(TOK), layout="per_token")


def test_an_agents_own_evaluation_temperature_beats_the_evaluation_default() -> None:
    """Evaluation runs at validation.temperature (sampling_overrides), except for an agent with its own
    sampling.eval_temperature; training rollouts use each agent's sampling.temperature."""
    from pettingflow.configs import load_config
    from pettingflow.rollout.local import evaluation_temperatures

    config = load_config("code-env", ["agents.test_generator.sampling.eval_temperature=0.0"])
    assert evaluation_temperatures(config) == {"test_generator": 0.0}
    llm = ScriptedLLM(TOK)
    engine, make_env, _ = make_engine(llm, max_turns=2)
    engine.sampling_overrides, engine.agent_temperatures = {"temperature": 1.0}, {"tester": 0.0}
    run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    assert [(c["model"], c["temperature"]) for c in llm.calls] == [("m-coder", 1.0), ("m-tester", 0.0)]
    training, _, _ = make_engine(llm := ScriptedLLM(TOK), max_turns=2)
    run(training, group_specs(["T"], 1, 0, "toy", make_env))
    assert [c["temperature"] for c in llm.calls] == [0.7, 0.7]  # ToyAgent's own sampling.temperature


class ForkingToyAgent(ToyAgent):
    def fork(self):
        twin = copy.copy(self)
        twin.messages, twin.seen_boards = list(self.messages), list(self.seen_boards)
        return twin


class ForkingToyEnv(ToyEnv):
    def fork(self):
        twin = copy.copy(self)
        twin.state, twin.history = copy.deepcopy(self.state), list(self.history)
        return twin


class ScriptedTester(ForkingToyAgent):
    """A tool-like role: its reply comes from code, not a model (``scripted``)."""

    scripted = True

    def scripted_reply(self, turn, env) -> str:
        return f"checked-{turn}"


@pytest.mark.parametrize("tree", [None, 3])
def test_a_scripted_agent_acts_without_the_model_and_is_never_a_training_row(tree) -> None:
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, p: "code")
    bindings = {
        n: AgentBinding(client=llm, served_model=f"m-{n}", tokenizer=TOK, policy_name="shared")
        for n in ("coder", "tester")
    }
    envs: list[ToyEnv] = []

    def make_env(spec):
        envs.append(ForkingToyEnv(spec.task, 4))
        return envs[-1]

    engine = ExecutionEngine(
        lambda: [ForkingToyAgent("coder", TOK, "per_turn"), ScriptedTester("tester", TOK, "per_turn")],
        bindings,
        max_turns=4,
        token_budget=1000,
        show_progress=False,
        tree_branches=tree,
    )
    (rec,), stats = run(engine, group_specs(["T"], 1, 0, "toy", make_env))
    assert {c["model"] for c in llm.calls} == {"m-coder"} and len(llm.calls) == 2  # the tester never asks the model
    path = rec.path()
    assert [(t.agent_name, t.response_text) for t in path][1::2] == [("tester", "checked-1"), ("tester", "checked-3")]
    assert sum(t.agent_name == "tester" for t in rec.turns) == 2  # one reply per scripted turn, even in tree mode
    rows = build_rows([rec], "per_turn", "run", 0, group_size=1)  # one episode, tree or not
    assert {r["agent_name"] for r in rows} == {"coder"}
    assert stats.tokens_generated == sum(len(r["response_ids"]) for r in rows)
    assert "tester:checked-1" in llm.calls[1]["prompt"]  # the coder reads the scripted reply through the env
