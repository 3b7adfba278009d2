"""The how-to guides run as written: their files are rebuilt from the page and used as a reader would.

docs/guides/custom-env.md: the package, task file and config it shows pass `pettingflow check` (a separate
process, the package on PYTHONPATH, as the guide says), and an episode of its two agents runs through the
real execution engine with a scripted model: turn order, the env as the only channel, rewards, early stop.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_fakes import CharChatTokenizer, ScriptedLLM

from pettingflow.rollout.engine import AgentBinding, ExecutionEngine, group_specs

ROOT = Path(__file__).resolve().parents[1]
FILE_BLOCK = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)


def write_guide_files(page: Path, into: Path) -> list[str]:
    """Every ``<!-- file: PATH -->`` block of ``page`` written under ``into``; returns the paths."""
    written = []
    for match in FILE_BLOCK.finditer(page.read_text()):
        target = into / match["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(match["body"])
        written.append(match["path"])
    return written


@pytest.fixture()
def custom_env(tmp_path: Path):
    files = write_guide_files(ROOT / "docs" / "guides" / "custom-env.md", tmp_path)
    assert {"mygame/env.py", "mygame/agents.py", "tasks.jsonl", "mygame.yaml"} <= set(files)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "mygame" or m.startswith("mygame.")]:
            del sys.modules[name]


def test_custom_env_guide_passes_the_check(custom_env: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(custom_env)}
    cli = Path(sys.executable).parent / "pettingflow"
    done = subprocess.run(
        [str(cli), "check", "mygame.yaml", "--no-models"], cwd=custom_env, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agent proposer: mygame.agents:Proposer" in done.stdout and "mygame.yaml: ok" in done.stdout
    assert "8 train, 2 held-out" in done.stdout
    (custom_env / "tasks.jsonl").write_text('{"task_id": "bad", "a": "two", "b": 3}\n')
    bad = subprocess.run(
        [str(cli), "check", "mygame.yaml", "--no-models"], cwd=custom_env, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "needs an integer 'a'" in bad.stderr + bad.stdout


def test_custom_env_guide_plays_an_episode(custom_env: Path) -> None:
    from mygame.agents import Checker, Proposer
    from mygame.env import SumEnv

    tok = CharChatTokenizer()

    def reply(model: str, prompt: str, params: dict) -> str:
        if model == "m-proposer":  # wrong first, right after the checker said no
            a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)", prompt)[-1])
            return str(a + b) if "judged: no" in prompt else str(a + b + 1)
        proposed = re.findall(r"(\d+) \+ (\d+) = (\d+)", prompt)[-1]
        return "yes" if int(proposed[0]) + int(proposed[1]) == int(proposed[2]) else "no"

    llm = ScriptedLLM(tok, reply=reply)
    names = ("proposer", "checker")
    bindings = {n: AgentBinding(client=llm, served_model=f"m-{n}", tokenizer=tok, policy_name="shared") for n in names}
    envs = []

    def make_env(spec):
        envs.append(SumEnv(spec.task, {"max_turns": 6}))
        return envs[-1]

    engine = ExecutionEngine(
        lambda: [Proposer("proposer", tokenizer=tok), Checker("checker", tokenizer=tok)],
        bindings,
        max_turns=6,
        token_budget=1000,
        show_progress=False,
    )
    (record,), _ = asyncio.run(engine.run(group_specs([{"task_id": "t", "a": 2, "b": 3}], 1, 0, "sum", make_env)))
    assert [t.agent_name for t in record.turns] == ["proposer", "checker", "proposer", "checker"]
    assert [t.reward for t in record.turns] == [0.0, 1.0, 1.0, 1.0]  # 6 is wrong, "no" is right, 5, "yes"
    assert record.done and envs[0].solved() and envs[0].episode_info() == {"team_reward": 1.0}


def test_one_gpu_guide_config_loads_and_passes_the_check(tmp_path: Path) -> None:
    """docs/guides/one-gpu.md: its config loads and passes the check (classes, tasks); its model folder is
    named by the check when absent (no GPU or model here: what the guide says has not run, does not run here)."""
    from pettingflow.configs.loader import load_config
    from pettingflow.runs.preflight import PreflightError, preflight

    write_guide_files(ROOT / "docs" / "guides" / "one-gpu.md", tmp_path)
    config = load_config(str(tmp_path / "one-gpu.yaml"))
    assert config.inference.gpu_memory_utilization == 0.35 and config.inference.between_updates == "sleep"
    assert config.training.head_chunk_tokens == 512
    preflight(config, check_models=False)
    if not Path(config.policies[0].model).exists():
        with pytest.raises(PreflightError, match=r"policies\[0\] \('shared'\)\.model: model folder /models/"):
            preflight(config)


def command_block(page: Path, name: str) -> list[list[str]]:
    """The shell lines of the ``<!-- commands: NAME -->`` block of ``page``, split into words."""
    import shlex

    match = re.search(rf"<!-- commands: {name} -->\n```bash\n(.*?)```", page.read_text(), re.S)
    assert match, f"{page.name} has no '{name}' command block"
    return [shlex.split(line, comments=True) for line in match[1].strip().splitlines()]


def test_rerun_guide_commands_are_accepted(tmp_path: Path) -> None:
    """docs/guides/rerun-and-compare.md: each re-run it shows has options the CLI knows and overrides that
    `rerun_config` accepts for its --from-step (what `pettingflow rerun` checks before starting anything)."""
    import typer

    from pettingflow.cli import app
    from pettingflow.configs.loader import load_config
    from pettingflow.runs.run import rerun_config, start_or_resume

    page = ROOT / "docs" / "guides" / "rerun-and-compare.md"
    command = typer.main.get_command(app)
    options = {o for p in command.commands["rerun"].params for o in getattr(p, "opts", [])}
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ref, _ = start_or_resume(config, "code-env", [f"run.storage_root={tmp_path}"], "run-g", {})
    lines = command_block(page, "rerun")
    assert len(lines) >= 3
    for words in lines:
        assert words[:3] == ["pettingflow", "rerun", "<run_id>"], words
        rest, overrides, from_step = words[3:], [], "filtered"
        while rest:
            word = rest.pop(0)
            if word.startswith("-"):
                assert word in options, (word, sorted(options))
                if word == "--from-step":
                    from_step = rest.pop(0)
                elif word in ("-k", "--iteration"):
                    int(rest.pop(0))
            else:
                overrides.append(word)
        rerun_config(ref, overrides, from_step)  # raises if the guide shows a refused combination
    for words in command_block(page, "compare"):
        if words[0] == "pettingflow":
            assert words[1] in command.commands and words[2] in command.commands[words[1]].commands, words


def test_rerun_guide_deployment_form_runs(tmp_path: Path, prefect_env, monkeypatch) -> None:
    """docs/guides/rerun-and-compare.md, "From the Prefect UI or a deployment": its parameter table names exactly
    the ``rerun`` flow's parameters, and each ``prefect deployment run rerun/code-env`` line, its ``--param`` values
    read as Prefect's CLI reads them, runs the flow on a stored run (the iteration itself replaced by a stand-in
    that records its call): the attempt gets the documented overrides and the flow runs are named after it."""
    import inspect

    from prefect import flow
    from prefect.cli._utilities import load_json_key_values
    from test_rerun_requests import commit_iteration, flow_run_names

    import pettingflow.flows.rerun as rerun_module
    from pettingflow.configs.loader import load_config
    from pettingflow.flows.iteration import _flow_run_name
    from pettingflow.runs.run import start_or_resume

    page = ROOT / "docs" / "guides" / "rerun-and-compare.md"
    text = page.read_text()
    section = text[text.index("## From the Prefect UI or a deployment") :]
    table = re.findall(r"^\| `(\w+)` \|", section[: section.index("<!-- commands: deployment -->")], re.M)
    assert sorted(table) == sorted(inspect.signature(rerun_module.rerun.fn).parameters), table

    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ref, _ = start_or_resume(config, "code-env", [], "run-d", {})
    for k in range(4):
        commit_iteration(ref.layout(), k)
    calls: list[dict] = []

    @flow(name="iteration", flow_run_name=_flow_run_name)
    def stand_in(run, iteration: int, attempt: int = 0, from_step: str = "rollouts", validate_now=None) -> dict:
        calls.append({"iteration": iteration, "attempt": attempt, "from_step": from_step, "validate": validate_now})
        return {"iteration": iteration, "attempt": attempt, "report": "-", "metrics": {}}

    monkeypatch.setattr(rerun_module, "iteration_flow", stand_in)
    lines = command_block(page, "deployment")
    assert len(lines) >= 2
    for attempt, words in enumerate(lines, start=1):
        assert words[:4] == ["prefect", "deployment", "run", "rerun/code-env"], words
        assert words[4::2] == ["--param"] * len(words[4::2]), words
        params = load_json_key_values(words[5::2], "parameter")
        params = {**params, "run_id": "run-d", "root": str(tmp_path)}  # the page's placeholders
        state = rerun_module.rerun(**params, return_state=True)
        assert state.is_completed(), state
        assert calls[-1] == {
            "iteration": params["iteration"],
            "attempt": attempt,
            "from_step": params["from_step"],
            "validate": params.get("with_validation", False),
        }
        assert ref.layout().read_attempt_info(params["iteration"], attempt)["overrides"] == params["overrides"]
        k, step = params["iteration"], params["from_step"]
        assert flow_run_names(state.state_details.flow_run_id) == [
            f"rerun run-d iter-{k}/attempt-{attempt} from {step}",
            f"run-d iter-{k}/attempt-{attempt}",
        ]


def test_inspect_guide_runs(tmp_path: Path) -> None:
    """docs/guides/inspect.md: the commands it shows exist with the options it uses, and its pandas script runs on
    a stored rollouts step and prints the episode's turns."""
    import typer
    from factories import trajectory_row

    from pettingflow.cli import app
    from pettingflow.storage import RunLayout, write_trajectories

    page = ROOT / "docs" / "guides" / "inspect.md"
    command = typer.main.get_command(app)
    for words in command_block(page, "inspect"):
        sub = command.commands[words[1]]
        sub = sub.commands[words[2]] if hasattr(sub, "commands") else sub
        options = {o for p in sub.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
        assert all(w in options for w in words if w.startswith("-")), (words, sorted(options))

    layout = RunLayout(str(tmp_path), "run-i")
    rows = [
        trajectory_row(env_idx=1, rollout_idx=5, sample_idx=1, turn_idx=t, agent_name=a, prompt_text=f"p{t}")
        for t, a in enumerate(["coder", "tester"])
    ]
    write_trajectories(layout.step(2, "rollouts").begin(), rows)
    write_guide_files(page, tmp_path)
    script = tmp_path / "one_episode.py"
    script.write_text(script.read_text().replace("outputs/runs/<run_id>", f"{tmp_path}/runs/run-i"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "turn 0 coder: reward 1.00, 3 model tokens" in done.stdout and "turn 1 tester" in done.stdout


def test_after_training_guide_runs(tmp_path: Path, tiny_model: Path) -> None:
    """docs/guides/after-training.md: each command it shows has options the CLI knows, the tasks it plays are
    accepted (a task id of the dataset, a task given as JSON), and its script loads an export of a stored run with
    transformers and generates from it."""
    import typer
    from test_after_training import invoke, stored_run

    from pettingflow.cli import app
    from pettingflow.configs.loader import load_config
    from pettingflow.runs.play import find_task, task_from_json

    page = ROOT / "docs" / "guides" / "after-training.md"
    command = typer.main.get_command(app)
    config = load_config("code-env")
    for name in ("eval", "export", "play"):
        lines = command_block(page, name)
        assert len(lines) >= 3, name
        options = {o for p in command.commands[name].params for o in [*p.opts, *getattr(p, "secondary_opts", [])]}
        for words in lines:
            assert words[:2] == ["pettingflow", name], words
            assert all(w in options for w in words if w.startswith("-")), (words, sorted(options))
            if "--task" in words:
                find_task(config, words[words.index("--task") + 1])
            if "--task-json" in words:
                assert task_from_json(config, words[words.index("--task-json") + 1])["entry_point"] == "inc"

    stored_run(tmp_path, tiny_model, "http://127.0.0.1:9")
    assert invoke("export", "run-t", "--out", str(tmp_path / "exported"), "--root", str(tmp_path)).exit_code == 0
    write_guide_files(page, tmp_path)
    done = subprocess.run([sys.executable, "load_export.py"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
