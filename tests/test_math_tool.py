"""The math-tool env (docs/math-tool.md): generation, knobs, the split, answer and program parsing, rewards,
the real bubblewrap sandbox (right answer, crash, timeout), forks, and episodes through the real rollout engine
in independent and tree mode."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from fractions import Fraction

import pytest
from rollout_fakes import CharChatTokenizer, ScriptedLLM

from pettingflow.agents import resolve_agent_class
from pettingflow.agents.math_agents import ReasonerAgent, ToolAgent
from pettingflow.configs import load_config
from pettingflow.configs.settings import DatasetSettings
from pettingflow.envs import EnvConfigError, load_tasks, resolve_env_class
from pettingflow.envs.math_tool import (
    MathToolConfig,
    MathToolEnv,
    answers_match,
    extract_program,
    format_number,
    generate_problem,
    load_math_tool_tasks,
    parse_answer,
    printed_value,
    reasoner_reward,
    tool_reward,
)

TOK = CharChatTokenizer()
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap not installed (`make test` installs it)"
)
# Programs that must finish get limits no loaded machine reaches (a pass must not depend on the machine's load);
# only the program that must run out of time gets a short one.
FAST_SANDBOX = {"timeout_s": 30.0, "cpu_time_s": 20, "max_concurrency": 2}
SHORT_SANDBOX = {"timeout_s": 2.0, "cpu_time_s": 2, "max_concurrency": 1}


def run(coro):
    return asyncio.run(coro)


class FakeSandbox:
    """Returns canned results and never runs anything: for rules that do not depend on the program."""

    def __init__(self, stdout: str = "", exit_code: int | None = 0, stderr: str = "", timed_out: bool = False):
        self.calls: list[str] = []
        self.kw = {"stdout": stdout, "exit_code": exit_code, "stderr": stderr, "timed_out": timed_out}

    async def run_async(self, code: str, **_: object):
        from pettingflow.envs.sandbox import ExecResult

        self.calls.append(code)
        k = self.kw
        return ExecResult(k["exit_code"], k["timed_out"], k["stdout"], k["stderr"], False, False, 0.01)


def env_of(question="Compute 3 + 4.", answer="7", sandbox=None, **config) -> MathToolEnv:
    task = {"task_id": "t", "question": question, "answer": answer}
    return MathToolEnv(task, {"max_turns": 4, **config}, sandbox=sandbox or FakeSandbox("7\n"))


# --------------------------------------------------------------------------------------------------
# generation, knobs, split, registration
# --------------------------------------------------------------------------------------------------
def _eval_arithmetic(question: str) -> Fraction:
    """The value of a generated expression, computed independently: its syntax tree walked with Fractions."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
        return ops[type(node.op)](value(node.left), value(node.right))

    return value(ast.parse(question.removeprefix("Compute ").removesuffix("."), mode="eval").body)


def test_generation_is_deterministic_pinned_and_exact() -> None:
    config = MathToolConfig()
    problems = [generate_problem(s, config) for s in range(200)]
    assert problems == [generate_problem(s, config) for s in range(200)]
    assert len({p.question for p in problems}) > 150
    assert {p.kind for p in problems} == {"arithmetic", "word"}
    assert any(p.answer.denominator > 1 for p in problems)  # fractions occur by default
    # pinned: the same problem on every machine and Python version (string-seeded random.Random)
    assert generate_problem(5, config).question == "Compute 20 - (17 - 10)."
    assert generate_problem(5, config).answer == 13
    for p in problems:
        if p.kind == "arithmetic":
            assert _eval_arithmetic(p.question) == p.answer
    # a word problem's answer follows from its own numbers
    p = generate_problem(4, config)
    a, b, c = map(int, re.findall(r"\d+", p.question))
    assert p.kind == "word" and p.answer == a * b - c


@pytest.mark.parametrize(
    "knobs",
    [
        {"kinds": ["arithmetic"], "min_ops": 3, "max_ops": 4, "max_operand": 9},
        {"kinds": ["word"], "allow_fractions": False},
        {"kinds": ["arithmetic"], "allow_fractions": False, "max_ops": 3},
    ],
)
def test_generated_problems_respect_the_knobs(knobs) -> None:
    config = MathToolConfig(**knobs)
    for seed in range(100):
        p = generate_problem(seed, config)
        assert p.kind in config.kinds
        if not config.allow_fractions:
            assert p.answer.denominator == 1
        if p.kind == "arithmetic":
            ops = len(re.findall(r" [+\-*/] ", p.question))
            assert config.min_ops <= ops <= config.max_ops
            assert all(int(n) <= config.max_operand for n in re.findall(r"\d+", p.question))
            assert _eval_arithmetic(p.question) == p.answer


def test_bad_knobs_and_tasks_are_refused() -> None:
    with pytest.raises(EnvConfigError, match="max_ops"):
        MathToolEnv.validate_config({"min_ops": 3, "max_ops": 2})
    with pytest.raises(EnvConfigError, match="kinds"):
        MathToolEnv.validate_config({"kinds": ["geometry"]})
    with pytest.raises(EnvConfigError, match="nope"):
        MathToolEnv.validate_config({"nope": 1})
    with pytest.raises(ValueError, match="needs a 'seed' or a 'question'"):
        MathToolEnv({"task_id": "x"}, sandbox=FakeSandbox())
    from pettingflow.envs.base import TaskDataError

    with pytest.raises(TaskDataError, match="must be a number"):
        MathToolEnv.validate_task({"task_id": "x", "question": "q", "answer": "seven"}, MathToolConfig())
    MathToolEnv.validate_task({"task_id": "x", "seed": 3}, MathToolConfig())


def test_split_holds_out_tasks_from_disjoint_seeds() -> None:
    split = load_tasks(DatasetSettings(source="math-tool", num_tasks=50, validation_fraction=0.2))
    train, held = {t["seed"] for t in split.train}, {t["seed"] for t in split.validation}
    assert len(held) == 10 and len(train) == 40 and not train & held and train | held == set(range(50))
    assert load_tasks(DatasetSettings(source="math-tool", num_tasks=50, validation_fraction=0.2)) == split
    assert load_math_tool_tasks(2) == [{"task_id": f"math-tool/{s}", "seed": s} for s in range(2)]
    with pytest.raises(ValueError, match="at least 2 tasks"):
        load_math_tool_tasks(1)


def test_registered_names_config_file_and_deployment() -> None:
    import yaml

    from pettingflow.configs.loader import CONFIG_DIR

    assert resolve_env_class("math-tool") is MathToolEnv
    assert resolve_agent_class("math-tool-tool") is ToolAgent
    assert resolve_agent_class("math-tool-reasoner") is ReasonerAgent
    config = load_config("math-tool")
    assert [a.class_path for a in config.agents] == ["math-tool-tool", "math-tool-reasoner"]
    assert config.env.dataset.source == "math-tool" and config.policies[0].model == "smollm2-135m-instruct"
    MathToolEnv.validate_config({"max_turns": config.env.max_turns, **config.env.options})
    deployments = yaml.safe_load((CONFIG_DIR.parent / "prefect.yaml").read_text())["deployments"]
    ours = [d for d in deployments if d["name"] == "math-tool"]
    assert [(d["entrypoint"], d["parameters"]["config"]) for d in ours] == [("flows/train.py:train", "math-tool")]


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Answer: 42", 42),
        ("The answer is \\boxed{42}.", 42),
        ("42.0", 42),
        ("Answer: 7/2", Fraction(7, 2)),
        ("Answer: -3 / 4", Fraction(-3, 4)),
        ("\\boxed{\\frac{7}{2}}", Fraction(7, 2)),
        ("so it is \\dfrac{3}{4}", Fraction(3, 4)),
        ("Answer: 1,234 pencils", 1234),
        ("Final answer: 0.75", Fraction(3, 4)),
        ("3 + 4 = 7, then 7 * 2 = 14", 14),  # no label: the last number
        ("Answer: 5\nI checked: 2 + 3", 5),  # the labelled line wins over later numbers
        ("\\boxed{9} but Answer: 4", 9),  # boxed first
        ("I do not know", None),
        ("", None),
    ],
)
def test_parse_answer(text, value) -> None:
    assert parse_answer(text) == (None if value is None else Fraction(value))


def test_matching_is_exact_up_to_float_rounding() -> None:
    third = Fraction(1, 3)
    assert answers_match(parse_answer("0.3333333333333333"), third)
    assert not answers_match(parse_answer("0.33"), third)
    assert answers_match(Fraction(7), Fraction(7)) and not answers_match(Fraction(8), Fraction(7))
    assert not answers_match(None, Fraction(7))
    assert format_number(Fraction(7, 2)) == "7/2" and format_number(Fraction(-4)) == "-4"


def test_extract_program_and_printed_value() -> None:
    assert extract_program("Here:\n```python\nx = 3\nprint(x)\n```\nDone.", 100) == "x = 3\nprint(x)"
    assert extract_program("```\nprint(1)\n```", 100) == "print(1)"
    assert extract_program("```python\nprint(2)", 100) == "print(2)"  # unclosed fence (max_tokens cut it)
    assert extract_program("print(4 * 5)", 100) == "print(4 * 5)"  # bare code that prints
    assert extract_program("The answer is 20.", 100) is None
    assert extract_program("```python\nprint(123456)\n```", 8) == "print(12"
    assert printed_value("step 1\nresult: 7.5\n\n") == Fraction(15, 2)
    assert printed_value("3/4\n") == Fraction(3, 4) and printed_value("") is None and printed_value("done") is None


# --------------------------------------------------------------------------------------------------
# rewards on hand-made cases (the sandbox faked: the rules do not depend on what ran)
# --------------------------------------------------------------------------------------------------
def test_reward_formulas() -> None:
    cfg = MathToolConfig(ran_weight=0.2, invalid_penalty=0.5)
    assert tool_reward(True, True, True, cfg) == 1.0
    assert tool_reward(True, False, True, cfg) == pytest.approx(0.2)
    assert tool_reward(False, False, True, cfg) == 0.0
    assert tool_reward(False, False, False, cfg) == -0.5
    assert reasoner_reward(True, True, cfg) == 1.0
    assert reasoner_reward(False, True, cfg) == 0.0
    assert reasoner_reward(False, False, cfg) == -0.5


def _turn(agent, env, text):
    agent.update_from_env(env.current_turn, env)
    agent.update_from_model(env.current_turn, env, text)
    run(agent.step(env))
    return agent.agent_reward, agent.success, agent.turn_info


def test_an_episode_wrong_then_right() -> None:
    sandbox = FakeSandbox("8\n")  # the program printed a wrong value
    env = env_of(sandbox=sandbox)
    tool, reasoner = ToolAgent(tokenizer=TOK), ReasonerAgent(tokenizer=TOK, agent_idx=1)
    assert _turn(tool, env, "```python\nprint(3 + 5)\n```") == (
        pytest.approx(0.2),
        False,
        pytest.approx(
            {
                "role": "tool",
                "invalid": False,
                "status": "ok",
                "printed": "8",
                "ran": True,
                "correct": False,
                "local_reward": 0.2,
            }
        ),
    )
    assert sandbox.calls == ["print(3 + 5)"]
    assert "The program printed:\n8" in reasoner.turn_prompt(env)
    reward, success, info = _turn(reasoner, env, "Answer: 8")
    assert (reward, success, info["agrees_with_tool"], env.done, env.team_outcome()) == (0.0, False, True, False, 0.0)
    assert "The reasoner answered: 8, which was not accepted." in tool.turn_prompt(env)
    sandbox.kw["stdout"] = "7\n"
    assert _turn(tool, env, "```python\nprint(3 + 4)\n```")[:2] == (1.0, True)
    reward, success, info = _turn(reasoner, env, "The program says 7. \\boxed{7}")
    assert (reward, success, env.done, env.truncated) == (1.0, True, True, False)
    assert env.episode_info() == {
        "team_reward": 1.0,
        "solved": True,
        "question": "Compute 3 + 4.",
        "answer": "7",
        "final_answer": "7",
        "tool_correct": True,
    }
    # the answer is never shown to the agents
    assert "7" not in ToolAgent(tokenizer=TOK).turn_prompt(env_of())


def test_no_program_and_no_answer_are_invalid_turns_and_nothing_runs() -> None:
    sandbox = FakeSandbox("7\n")
    env = env_of(sandbox=sandbox, invalid_penalty=0.5)
    tool, reasoner = ToolAgent(tokenizer=TOK), ReasonerAgent(tokenizer=TOK, agent_idx=1)
    reward, success, info = _turn(tool, env, "I think it is seven")
    assert (reward, success, info["invalid"], info["status"], sandbox.calls) == (-0.5, False, True, "no_program", [])
    assert "held no program" in reasoner.turn_prompt(env)
    reward, success, info = _turn(reasoner, env, "hmm")
    assert (reward, success, info["invalid"], env.team_outcome()) == (-0.5, False, True, 0.0)


def test_answer_prefix_starts_replies_in_the_prompt() -> None:
    env = env_of(answer_prefix=True)
    tool, reasoner = ToolAgent(tokenizer=TOK), ReasonerAgent(tokenizer=TOK, agent_idx=1)
    prompt = tool.update_from_env(0, env)
    assert TOK.decode(prompt.token_ids).endswith("<assistant>```python\nprint(")
    assert tool.update_from_model(0, env, "3 + 4)\n```") == "print(3 + 4)"
    run(tool.step(env))
    assert TOK.decode(reasoner.update_from_env(1, env).token_ids).endswith("<assistant>Answer:")
    assert reasoner.update_from_model(1, env, " 7") == 7
    # a reply that opens its own fence after the prefilled one is read alone
    assert ToolAgent(tokenizer=TOK).parse_response("```python\nprint(```python\nprint(1)\n```", env) == "print(1)"


def test_forks_are_independent_and_team_outcome_is_per_fork() -> None:
    env = env_of()
    tool, reasoner = ToolAgent(tokenizer=TOK), ReasonerAgent(tokenizer=TOK, agent_idx=1)
    _turn(tool, env, "```python\nprint(7)\n```")
    right, wrong = env.fork(), env.fork()
    r1, r2 = reasoner.fork(), reasoner.fork()
    _turn(r1, right, "Answer: 7")
    _turn(r2, wrong, "Answer: 6")
    assert (right.team_outcome(), wrong.team_outcome(), env.team_outcome()) == (1.0, 0.0, 0.0)
    assert right.done and not wrong.done and not env.done and env.state.answers == []
    assert right.sandbox is env.sandbox  # shared, not copied


# --------------------------------------------------------------------------------------------------
# the real bubblewrap sandbox
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    from pettingflow.configs.settings import SandboxSettings
    from pettingflow.envs.sandbox import make_sandbox

    return make_sandbox(SandboxSettings(**FAST_SANDBOX))


@pytest.fixture(scope="module")
def short_sandbox():
    """For the one program that must run out of time: a short limit, so the case does not wait 30 s."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    from pettingflow.configs.settings import SandboxSettings
    from pettingflow.envs.sandbox import make_sandbox

    return make_sandbox(SandboxSettings(**SHORT_SANDBOX))


@needs_bwrap
@pytest.mark.parametrize(
    ("program", "status", "reward", "printed", "shown"),
    [
        ("from fractions import Fraction\nprint(Fraction(20 + 18, 5))", "ok", 1.0, "38/5", "printed:\n38/5"),
        ("print((20 + 18) / 5)", "ok", 1.0, "38/5", "printed:\n7.6"),
        ("print(20 + 18 // 5)", "ok", 0.2, "23", "printed:\n23"),
        ("x = [1, 2]\nprint(x[5])", "failed", 0.0, None, "failed: IndexError: list index out of range"),
        ("print(", "failed", 0.0, None, "failed: SyntaxError"),
        ("while True:\n    pass", "timeout", 0.0, None, "ran out of time"),
    ],
    ids=["fraction", "float", "wrong", "crash", "syntax", "timeout"],
)
def test_programs_run_in_the_real_sandbox(sandbox, short_sandbox, program, status, reward, printed, shown) -> None:
    from pettingflow.agents.math_agents import describe_run

    q = "Chen has 20 red and 18 blue marbles and shares all of them equally among 5 friends. How many each?"
    limits, box = (SHORT_SANDBOX, short_sandbox) if status == "timeout" else (FAST_SANDBOX, sandbox)
    env = MathToolEnv({"task_id": "m", "question": q, "answer": "38/5"}, {"sandbox": limits}, sandbox=box)
    outcome = run(env.run_program(program))
    assert (outcome.info["status"], outcome.reward, outcome.info["printed"]) == (status, pytest.approx(reward), printed)
    assert shown in describe_run(env.state.last_run)


@needs_bwrap
def test_the_sandbox_is_isolated_from_the_host(sandbox) -> None:
    env = env_of(sandbox=sandbox)
    outcome = run(env.run_program("import os\nprint(len(os.listdir('/work')) if os.path.exists('/work') else 7)"))
    assert outcome.info["printed"] == "7"  # the host's folders are not mounted


# --------------------------------------------------------------------------------------------------
# through the real rollout engine (scripted LLM, real sandbox)
# --------------------------------------------------------------------------------------------------
def scripted_team(model, prompt, params) -> str:
    """A perfect-ish team: the tool prints the expression (or the right word-problem formula from the prompt's
    numbers), the reasoner copies the program's output. Odd seeds: the tool writes prose (no program)."""
    if "You write short Python programs" in prompt:
        if params.get("seed") is not None and params["seed"] % 2:
            return "I am not sure."
        q = prompt.split("Problem: ", 1)[1].split("\n", 1)[0]
        code = f"print({q[8:-1]})" if q.startswith("Compute ") else "print(0)"
        # the config prefills the fence and 'print(' (answer_prefix): the reply continues it
        return f"{code[6:]}\n```" if prompt.endswith("```python\nprint(") else f"```python\n{code}\n```"
    m = re.search(r"The program printed:\n(.*)", prompt)
    answer = m.group(1) if m else "0"
    return f" {answer}" if prompt.endswith("Answer:") else f"Answer: {answer}"


def engine_rows(reply, *, sandbox, tasks, group_size=2, tree_branches=None, max_turns=4):
    from pettingflow.agents import build_agent
    from pettingflow.envs import EnvCache
    from pettingflow.envs.registry import EnvFactory
    from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
    from pettingflow.rollout.local import episode_specs
    from pettingflow.rollout.records import build_rows

    config = load_config("math-tool", [f"env.max_turns={max_turns}", "env.token_budget=4000"])
    tree = tree_branches is not None
    cache = EnvCache(lambda spec: EnvFactory(spec, shared={"sandbox": sandbox}))
    specs = episode_specs(config, tasks, group_size=1 if tree else group_size, seed_namespace="t/", env_cache=cache)
    llm = ScriptedLLM(TOK, reply=reply)
    bindings = {
        a.name: AgentBinding(client=llm, served_model=a.name, tokenizer=TOK, policy_name="shared")
        for a in config.agents
    }
    extra = {"tree_branches": tree_branches, "tree_select": "best"} if tree else {}
    engine = ExecutionEngine(
        lambda: [build_agent(a, agent_idx=i, tokenizer=TOK) for i, a in enumerate(config.agents)],
        bindings,
        max_turns=max_turns,
        token_budget=config.env.token_budget,
        layout="per_turn",
        show_progress=False,
        **extra,
    )
    records, stats = asyncio.run(engine.run(specs))
    rows = build_rows(records, "per_turn", "run", 0, group_size=1 if tree else group_size)
    return records, stats, rows, llm


ARITH_TASKS = [
    {"task_id": "a", "question": "Compute 20 - (17 - 10).", "answer": "13"},
    {"task_id": "b", "question": "Compute 7 / 2.", "answer": "7/2"},
]


@needs_bwrap
def test_independent_episodes_through_the_engine(sandbox) -> None:
    records, stats, rows, llm = engine_rows(scripted_team, sandbox=sandbox, tasks=ARITH_TASKS, group_size=4)
    assert len(records) == 8 and all(r.done for r in records)
    assert {r["agent_name"] for r in rows} == {"tool", "reasoner"}
    by_episode: dict[tuple, list] = {}
    for row in rows:
        by_episode.setdefault((row["env_idx"], row["rollout_idx"]), []).append(row)
        info = json.loads(row["info_json"])
        assert row["reward"] == pytest.approx(info["turn"]["local_reward"])
        assert info["turn"]["role"] == row["agent_name"]
    solved = [json.loads(r[0]["info_json"])["team_reward"] for r in by_episode.values()]
    assert 0 < sum(solved) <= len(solved)  # the tool answers only on even sampling seeds
    for ep in by_episode.values():
        infos = [json.loads(r["info_json"]) for r in sorted(ep, key=lambda r: r["turn_idx"])]
        if infos[0]["team_reward"] == 1.0:  # solved: the reasoner copied a correct print
            assert infos[-1]["turn"]["correct"] and infos[0]["tool_correct"]
    assert stats.per_agent["reasoner"]["success_rate"] > 0
    # the agents only talked through the env: the reasoner saw the program's output
    assert any("The program printed:\n13" in c["prompt"] for c in llm.calls)


@needs_bwrap
def test_tree_mode_through_the_engine(sandbox) -> None:
    records, _, rows, _ = engine_rows(scripted_team, sandbox=sandbox, tasks=ARITH_TASKS, tree_branches=2)
    assert len(records) == 2  # one episode per task, K candidates per turn
    for rec in records:
        assert rec.done and not rec.truncated  # best-of-2 picks the candidate that wrote a program
    infos = [json.loads(r["info_json"]) for r in rows]
    assert all(i["team_reward"] == 1.0 for i in infos)
    assert {r["agent_name"] for r in rows} == {"tool", "reasoner"}
    # each turn's K candidates share one uid (the GRPO group), and their rewards differ on the tool's first turn
    first_tool = [r for r in rows if r["agent_name"] == "tool" and r["turn_idx"] == 0]
    assert len(first_tool) == 4 and len({r["uid"] for r in first_tool}) == 2
    for uid in {r["uid"] for r in first_tool}:
        assert sorted(r["reward"] for r in first_tool if r["uid"] == uid) == [0.0, 1.0]  # prose vs a right program
