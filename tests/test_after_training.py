"""After training: `pettingflow eval` (and --compare), `pettingflow export`, `pettingflow play` on stored runs.

Real: the code env with its sandbox, the validation step, storage, the evaluation runs, the CLI. Scripted: the LLM
(``bench.scripted_server``), made to answer by the weights it last loaded, so a score says which weights served it.
The stored run is a folder of committed steps whose update holds the tiny model's files: no training here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.scripted_server import ScriptedServer
from pettingflow.configs.loader import load_config
from pettingflow.envs.basic_python import load_basic_python
from pettingflow.runs.run import start_or_resume
from pettingflow.storage import RunLayout

TRAINED = "iter-0/update-shared/model"


class WeightAwareServer(ScriptedServer):
    """The scripted server, solving every task while it holds a run's trained weights (the last full reload was of
    an update step's ``model/``) and only on even seeds otherwise (the base model, as the flow tests script it)."""

    def holds_trained(self) -> bool:
        paths = [r["kwargs"]["weights_path"] for r in self.reloads if r.get("method") == "reload_weights"]
        return bool(paths) and paths[-1].endswith(TRAINED)

    def answer(self, prompt: str, seed: int) -> str:
        return super().answer(prompt, 0 if self.holds_trained() else seed)


@pytest.fixture(scope="module")
def scripted(default_tokenizer):
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in load_basic_python()}
    with WeightAwareServer(default_tokenizer, solutions) as server:
        yield server


def overrides(root: Path, model: Path, url: str) -> list[str]:
    return [
        f"run.storage_root={root}",
        f"policies.0.model={model}",
        f"inference.url={url}",
        "rollout.use_ray=false",
        "env.max_turns=2",
        "validation.num_tasks=4",
        "validation.samples_per_task=2",
        "validation.temperature=1.0",
    ]


def stored_run(root: Path, model: Path, url: str, run_id: str = "run-t", update: bool = True) -> RunLayout:
    """A run of one iteration whose update committed ``model`` as its trained weights (or no update at all)."""
    ovr = overrides(root, model, url)
    ref, _ = start_or_resume(load_config("code-env", ovr), "code-env", ovr, run_id, {})
    layout = ref.layout()
    for name in ("rollouts", "filtered", "advantages"):
        step = layout.step(0, name).begin()
        step.write_json("metrics.json", {})
        step.commit()
    if update:
        step = layout.step(0, "update-shared").begin()
        step.add_tree(model, prefix="model")
        step.commit({"skipped": False})
    return layout


def invoke(*args: str) -> Any:
    from pettingflow.cli import app

    return CliRunner().invoke(app, list(args))


def test_eval_compares_trained_weights_with_the_base_paired_by_task(tmp_path, tiny_model, scripted) -> None:
    stored_run(tmp_path, tiny_model, scripted.url)
    seen = len(scripted.reloads)
    out = invoke(
        "eval", "code-env", "--weights", "run-t", "--compare", "base", *overrides(tmp_path, tiny_model, scripted.url)
    )
    assert out.exit_code == 0, out.output
    # the attached server was reset to the base, then served the trained weights, then the base again
    paths = [r["kwargs"]["weights_path"] for r in scripted.reloads[seen:] if r.get("method") == "reload_weights"]
    assert [p.endswith(TRAINED) for p in paths] == [False, True, False], paths
    evals = sorted(r for r in (tmp_path / "runs").iterdir() if r.name.startswith("eval-code-env-"))
    assert len(evals) == 2
    infos = {r.name: RunLayout(str(tmp_path), r.name).read_run_info()["evaluates"] for r in evals}
    trained = next(name for name, info in infos.items() if info["weights"] == "run")
    base = next(name for name, info in infos.items() if info["weights"] == "base")
    assert infos[trained] == {"weights": "run", "run_id": "run-t", "after_iteration": 0, "split": "validation"}
    report = json.loads((tmp_path / "runs" / trained / "evaluation.json").read_text())
    ours, theirs = report["scores"], json.loads((tmp_path / "runs" / base / "evaluation.json").read_text())["scores"]
    assert ours["tasks"] == theirs["tasks"] and len(ours["tasks"]) == 4  # the same held-out tasks on both sides
    assert ours["agents"]["code_generator"]["episodes"] == 8 == theirs["agents"]["code_generator"]["episodes"]
    before = theirs["agents"]["code_generator"]["success_rate"]
    after = ours["agents"]["code_generator"]["success_rate"]
    assert after == 1.0 and 0.0 < before < 1.0  # trained: every task; base: even seeds only
    # the test writer never had a turn with the trained weights (solved at the first): scored 0, not left out
    assert (
        ours["agents"]["test_generator"]["success_rate"] == 0.0 and "test_generator" in report["comparison"]["agents"]
    )
    paired = report["comparison"]["agents"]["code_generator"]
    assert paired["delta"] == pytest.approx(after - before)  # equal samples per task: the paired mean is the change
    assert paired["tasks_worse"] == 0 and paired["ci95_low"] <= paired["delta"] <= paired["ci95_high"]
    low, high = ours["agents"]["code_generator"]["ci95"]
    assert low <= after <= high
    text = out.output
    assert f"change {100 * paired['delta']:+.1f} pts" in text and report["comparison"]["verdict"] in text
    assert re.search(r"code_generator: success 100\.0% \(95 % CI \[100\.0%, 100\.0%\]\)", text), text
    assert (tmp_path / "runs" / trained / "evaluation.md").read_text().count("paired by task") == 1
    # runs list shows the evaluation runs and what they evaluated
    listed = invoke("runs", "list", "--root", str(tmp_path))
    assert listed.exit_code == 0 and "eval-code-env-" in listed.output and "run-t" in listed.output


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ("run-t:3", r"run 'run-t' has no iteration 3: it has iterations 0-0"),
        ("run-t:x", r"ITER in RUN:ITER must be an iteration number, got 'x'"),
        ("run-u", r"run 'run-u' has no committed update at or before iteration 0: .* \(--weights base\)"),
        ("no-such-model", r"--weights no-such-model: not base, not a run under .* and not a model"),
        ("run-t", r"were removed by `pettingflow runs prune`"),
    ],
)
def test_eval_refuses_weights_it_cannot_score_in_one_line(tmp_path, tiny_model, weights, expected) -> None:
    from pettingflow.runs.retention import plan_prune, prune

    url = "http://127.0.0.1:9"  # never reached: the weights are refused before anything starts
    layout = stored_run(tmp_path, tiny_model, url)
    stored_run(tmp_path, tiny_model, url, run_id="run-u", update=False)
    if "prune" in expected:
        stored = layout.step(1, "rollouts").begin()  # a second iteration so that iteration 0's weights may go
        stored.commit()
        step = layout.step(1, "update-shared").begin()
        step.add_tree(tiny_model, prefix="model")
        step.commit({"skipped": False})
        prune(plan_prune(layout, keep_last=1))
        weights = "run-t:0"
    out = invoke("eval", "code-env", "--weights", weights, *overrides(tmp_path, tiny_model, url))
    assert out.exit_code == 2, out.output
    assert re.search(expected, out.output) and len(out.output.strip().splitlines()) == 1, out.output
    assert not any(r.name.startswith("eval-") for r in (tmp_path / "runs").iterdir())  # nothing written
