"""Prefect flows end to end under Prefect's test harness, with a scripted LLM server and a tiny model.

Real: Prefect (temporary server), storage, the code env with the bubblewrap sandbox, the DeepSpeed
update worker (on a tiny random Llama sharing the default tokenizer). Scripted: the LLM's answers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.compute as pc
import pytest
from run_outputs import check_against_golden, run_outputs

from bench.scripted_server import ScriptedServer
from pettingflow.envs import load_humaneval
from pettingflow.envs.basic_python import load_basic_python
from pettingflow.storage import RunLayout, list_runs, read_step_trajectories

STEPS = ["rollouts", "filtered", "advantages", "update-shared", "sync", "validation", "report"]


@pytest.fixture(scope="module")
def scripted(default_tokenizer):
    tasks = [*load_humaneval(), *load_basic_python()]
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in tasks}
    with ScriptedServer(default_tokenizer, solutions) as server:
        yield server


def overrides(root: Path, model: Path, url: str, *extra: str) -> list[str]:
    return [
        f"run.storage_root={root}",
        "run.iterations=2",
        f"policies.0.model={model}",
        f"inference.url={url}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        # smaller than the default run (basic-python, G=4, 3 turns, dapo, validation only after the last iteration)
        "env.group_size=2",
        "env.max_turns=2",
        "algorithm.filter_method=none",
        "training.lr=1e-5",
        "validation.schedule=periodic",
        "validation.num_tasks=2",
        "validation.samples_per_task=1",
        "validation.temperature=0",
        "training.zero_stage=0",
        *extra,
    ]


def flow_run_task_states(flow_run_id) -> dict[str, list[str]]:
    """Task name -> state messages, for every task run of a flow run and its subflows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read() -> dict[str, list[str]]:
        async with get_client() as client:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *[c.id for c in children]]
            out: dict[str, list[str]] = {}
            for fid in ids:
                for tr in await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [fid]})):
                    out.setdefault(tr.name.rsplit("-", 1)[0], []).append(tr.state.message or tr.state.name)
            return out

    return asyncio.run(read())


def test_train_two_iterations_then_resume_then_rerun(tmp_path, prefect_env, tiny_model, scripted) -> None:
    from pettingflow.flows.rerun import rerun
    from pettingflow.flows.train import train
    from pettingflow.runs.run import RerunOverrideError

    # a fixed run id: UIDs are derived from it, so the outputs can be compared with the stored record
    state = train("code-env", overrides(tmp_path, tiny_model, scripted.url), run_id="two-iterations", return_state=True)
    assert state.is_completed(), state
    result = state.result()
    run_id = result["run_id"]
    assert list_runs(str(tmp_path)) == [run_id] == ["two-iterations"]
    layout = RunLayout(str(tmp_path), run_id)
    # rows, UIDs, advantages and metrics equal those the code made before the pipeline was restructured
    check_against_golden(run_outputs(layout, 2, ["shared"]))
    for k in (0, 1):
        for name in STEPS:
            assert layout.step(k, name).is_committed(), (k, name)
    # validation.at_start: the base weights were scored before iteration 0's update, once per run
    assert layout.step(0, "baseline").is_committed() and not layout.fs.exists(layout.step(1, "baseline").path)
    baseline = read_step_trajectories(layout.step(0, "baseline"))
    assert baseline.num_rows > 0 and set(baseline.column("iteration").to_pylist()) == {0}
    rows = read_step_trajectories(layout.step(0, "rollouts"))
    assert rows.num_rows > 0
    for mask, ids in zip(
        rows.column("response_mask").to_pylist(), rows.column("response_ids").to_pylist(), strict=True
    ):
        assert len(mask) == len(ids) and set(mask) == {1}
    # a UID groups the 2 samples of one task at one turn for one agent
    counts = pc.value_counts(rows.column("uid")).field("counts").to_pylist()
    assert set(counts) <= {1, 2} and 2 in counts
    # the policy was trained and the server was told to load the new weights of each iteration
    ckpt0 = layout.step(0, "update-shared")
    assert any(f.name.startswith("model/") for f in ckpt0.manifest().files)
    reloaded = [r["kwargs"]["weights_path"] for r in scripted.reloads if r.get("method") == "reload_weights"]
    assert reloaded[0].endswith("iter-0/update-shared/model")
    assert reloaded[-1].endswith("iter-1/update-shared/model")
    # iteration 1 started from iteration 0's checkpoint, in the same resident learner (started once per run)
    assert layout.step(1, "update-shared").manifest().metadata["starts_from"].endswith("iter-0/update-shared")
    upd = [layout.step(k, "update-shared").manifest().metadata["metrics"] for k in (0, 1)]
    assert [m["optimizer_state"] for m in upd] == ["new", "resident"]
    assert [m["learner_loaded"] for m in upd] == [True, False]
    # the report holds metrics for every agent and the update
    metrics = layout.step(1, "report").read_json("metrics.json")
    assert "rollouts/code_generator/reward_mean" in metrics and "validation/code_generator/success_rate" in metrics
    assert "baseline/code_generator/success_rate" in layout.step(0, "report").read_json("metrics.json")
    assert "baseline/code_generator/success_rate" not in metrics
    assert any(k.startswith("update/shared/") for k in metrics)
    assert 0.0 <= metrics["orchestration/outside_step_tasks_share"] < 1.0
    assert metrics["duration/iteration_before_report_s"] >= metrics["duration/update-shared_s"]
    # TensorBoard's event file holds each iteration's report metrics at step k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs" / run_id / "tensorboard"))
    events.Reload()
    reported = [layout.step(k, "report").read_json("metrics.json") for k in (0, 1)]
    for tag in ("rollouts/code_generator/reward_mean", "update/shared/loss"):
        got = [(e.step, round(e.value, 5)) for e in events.Scalars(tag)]
        assert got == [(k, round(reported[k][tag], 5)) for k in (0, 1)], tag
    # the run's summary (make run's last lines, the last artifact): held-out before -> after with an interval
    summary = (tmp_path / "runs" / run_id / "summary.md").read_text()
    assert "held-out success of code_generator (2 tasks, 2 episodes)" in summary and "95 % CI" in summary
    # every asked episode is counted, with how it ended (analysis/outcomes.py)
    assert "held-out episodes after: 2 tasks x 1 samples = 2 episodes (" in summary
    assert "iter 0:" in summary and "iter 1:" in summary and "tokens generated in training" in summary
    # the last update's optimizer snapshot was written after its commit, off the critical path, and resume finds it
    assert upd[1]["optimizer_snapshot"] == "background" and not upd[1]["optimizer_saved"]
    assert not any(f.name.startswith("deepspeed/") for f in layout.step(1, "update-shared").manifest().files)
    snapshot = layout.step(1, "optimizer-shared")
    assert snapshot.is_committed() and any(f.name.startswith("deepspeed/") for f in snapshot.manifest().files)
    from pettingflow.runs.lineage import weights_before
    from pettingflow.runs.run import RunRef, load_run_config

    cfg = load_run_config(RunRef(root=str(tmp_path), run_id=run_id))
    start = weights_before(layout, cfg, "shared", 2)
    assert start.deepspeed_dir.endswith("iter-1/optimizer-shared/deepspeed") and start.optimizer_age == 0

    # resume: the same run again walks past iteration 0 (iteration 1 finished after it), re-enters the last finished
    # iteration, skips every committed step and adds no rows
    again = train("code-env", overrides(tmp_path, tiny_model, scripted.url), run_id=run_id, return_state=True)
    assert again.is_completed()
    assert [(x["iteration"], x.get("passed", False)) for x in again.result()["iterations"]] == [(0, True), (1, False)]
    assert again.result()["iterations"][0]["metrics"] == layout.step(0, "report").read_json("metrics.json")
    assert read_step_trajectories(layout.step(0, "rollouts")).num_rows == rows.num_rows
    messages = flow_run_task_states(again.state_details.flow_run_id)
    assert messages["rollouts"] and all("already committed" in m for m in messages["rollouts"])
    assert messages["update[shared]"] and all("already committed" in m for m in messages["update[shared]"])
    assert not messages.get("baseline")  # iteration 0's step: that iteration was not entered again

    # re-run iteration 0 from its stored trajectories with another filter and learning rate: a new attempt folder
    before = [f.sha256 for f in layout.step(0, "filtered").manifest().files]
    original = layout.step(0, "filtered").manifest().metadata
    assert (original["method"], original["rows_kept"]) == ("none", original["rows_in"])
    overrides_ = ["algorithm.filter_method=std", "algorithm.filter_ratio=0.5", "training.lr=1e-6"]
    out = rerun(run_id=run_id, iteration=0, from_step="filtered", root=str(tmp_path), overrides=overrides_)
    assert out["attempt"] == 1
    assert [(c["key"], c["new"]) for c in out["config_changes"]] == [
        ("algorithm.filter_method", "std"),
        ("algorithm.filter_ratio", 0.5),
        ("training.lr", 1e-6),
    ]
    # the new attempt's batch and update ran under the overrides; the attempt stores the config it ran under
    filtered = layout.step(0, "filtered", attempt=1).manifest().metadata
    assert (filtered["method"], filtered["ratio"]) == ("std", 0.5)
    assert filtered["rows_in"] == original["rows_in"] and 0 < filtered["rows_kept"] < filtered["rows_in"]
    assert layout.step(0, "advantages", attempt=1).manifest().rows == filtered["rows_kept"]
    spec = layout.step(0, "update-shared", attempt=1).read_json("spec.json")
    assert spec["training"]["lr"] == 1e-6 and spec["algorithm"]["filter_method"] == "std"
    stored = layout.read_attempt_info(0, 1)
    assert stored["overrides"] == overrides_ and stored["config"]["training"]["lr"] == 1e-6
    assert layout.read_run_info()["config"]["training"]["lr"] == 1e-5  # the run's config is untouched
    assert layout.step(0, "report", attempt=1).read_json("metrics.json")["filtered/rows_kept"] == filtered["rows_kept"]
    assert layout.step(0, "update-shared", attempt=1).is_committed()
    assert layout.step(0, "report", attempt=1).is_committed()
    # env, agents, policies, ...: the stored trajectories were made under them; refused before anything is written
    with pytest.raises(RerunOverrideError, match=r"env\.group_size: the stored trajectories.*start a new run"):
        rerun(run_id=run_id, iteration=0, root=str(tmp_path), overrides=["training.lr=1e-6", "env.group_size=4"])
    with pytest.raises(RerunOverrideError, match=r"agents\.code_generator\.policy"):
        rerun(run_id=run_id, iteration=0, root=str(tmp_path), overrides=["agents.code_generator.policy=other"])
    assert layout.attempts(0) == [0, 1]
    assert [f.sha256 for f in layout.step(0, "filtered").manifest().files] == before
    assert not layout.step(0, "rollouts", attempt=1).is_committed()  # rollouts were reused, not collected
    # no servers in a re-run: the update ran in its own process, from the base weights like the original
    rerun_metrics = layout.step(0, "update-shared", attempt=1).manifest().metadata["metrics"]
    assert rerun_metrics["optimizer_state"] == "new" and "learner_loaded" in rerun_metrics
    check_control_rerun(layout, rerun, tmp_path)
    check_viewer_on_real_run(layout, rows, tmp_path)


def check_control_rerun(layout: RunLayout, rerun, tmp_path: Path) -> None:
    """A control re-run (no override) of iteration 1 from its batch replays the original update exactly:
    the resident learner's state (fp32 weights, Adam moments and step) comes back from iteration 0's snapshot, kept by
    training.replay_snapshots, under the original's thread count; the weights file is the same bitwise, loss and
    gradient norm are equal. The lr-override re-run of iteration 0 started from the same state and trained other
    weights. runs show lists each attempt's optimizer state and whether it replays."""
    from rich.console import Console

    from pettingflow.analysis.inspect import show_run

    assert layout.step(0, "optimizer-shared").is_committed()  # iteration 0's snapshot (not due by the schedule)
    out = rerun(run_id=layout.run_id, iteration=1, from_step="update", root=str(tmp_path))
    assert out["attempt"] == 1 and out["config_changes"] == []
    assert layout.read_attempt_info(1, 1)["replay"]["exact"] is True
    steps = [layout.step(1, "update-shared", attempt=a) for a in (None, 1)]
    original, replay = (s.manifest().metadata["metrics"] for s in steps)
    assert (original["optimizer_state"], replay["optimizer_state"]) == ("resident", "restored"), replay
    assert replay["exact_replay"] is True and replay["replay_reason"] == ""
    assert replay["torch_threads"] == original["torch_threads"]
    assert replay["global_step_start"] == original["global_step_start"] > 0
    assert (replay["loss"], replay["grad_norm"]) == (original["loss"], original["grad_norm"])
    weights = [{f.name: f.sha256 for f in s.manifest().files if f.name.startswith("model/")} for s in steps]
    assert "model/model.safetensors" in weights[0] and weights[0] == weights[1]
    lr = [layout.step(0, "update-shared", attempt=a).manifest() for a in (None, 1)]
    assert lr[1].metadata["metrics"]["exact_replay"] is True  # the same start; the overrides are the difference
    assert len({next(f.sha256 for f in m.files if f.name == "model/model.safetensors") for m in lr}) == 2
    console = Console(record=True, width=400)
    show_run(layout, console)
    text = console.export_text()
    assert "optimizer of shared, attempt 0 (original): resident, from step" in text
    assert "optimizer of shared, attempt 1: restored, from step" in text and "exact replay" in text


def check_viewer_on_real_run(layout: RunLayout, rows, tmp_path: Path) -> None:
    """The trajectory viewer on this run: the policy's own tokenizer splits each response into as many tokens
    as it has ids, the sandbox's verdicts are shown, and the two attempts differ where the std filter dropped
    rows; then the episode page in headless Chromium (where one is installed; CI has it)."""
    from browser import chromium_or_skip, dom, serving
    from fastapi.testclient import TestClient

    from pettingflow.analysis.viewer_app import create_app

    app = create_app(layout)  # the real decoder: the tokenizer of the run's model folder
    client = TestClient(app)
    episode = rows.filter(pc.equal(rows.column("rollout_idx"), 0)).to_pylist()
    page = client.get("/episode/0/0").text
    assert page.count('class="tok model"') == sum(len(r["response_ids"]) for r in episode)
    assert "sandbox output" in page and ("passed" in page or "failed" in page)
    compare = client.get("/compare/0", params={"a": 0, "b": 1}).text
    assert "algorithm.filter_method=std" in compare and "dropped" in compare
    links = client.get("/iteration/0").text
    assert links.count('class="episode-row"') == len(set(rows.column("rollout_idx").to_pylist()))
    browser = chromium_or_skip()
    with serving(app) as url:
        shown = dom(browser, f"{url}/episode/0/0", tmp_path / "chromium-profile")
    assert shown.count('class="tok model"') == sum(len(r["response_ids"]) for r in episode)


def test_resumed_run_with_other_config_is_refused(tmp_path, prefect_env, tiny_model, scripted) -> None:
    from pettingflow.flows.train import train
    from pettingflow.runs.run import RunConfigMismatchError

    base = overrides(tmp_path, tiny_model, scripted.url, "run.iterations=1", "validation.frequency=0")
    state = train("code-env", base, return_state=True)
    run_id = state.result()["run_id"]
    with pytest.raises(RunConfigMismatchError, match=r"algorithm\.filter_method"):
        train("code-env", [*base, "algorithm.filter_method=dapo"], run_id=run_id)


def test_lora_per_agent_run_serves_each_agent_its_adapter(tmp_path, prefect_env, tiny_model, scripted) -> None:
    """L2: one base model, one adapter per agent, trained on its own rows and served by name."""
    from pettingflow.flows.train import train

    extra = ["specialization=lora", "policies.0.lora.rank=4", "validation.frequency=0"]
    state = train("code-env", overrides(tmp_path, tiny_model, scripted.url, *extra), return_state=True)
    assert state.is_completed(), state
    layout = RunLayout(str(tmp_path), state.result()["run_id"])
    files = {f.name for f in layout.step(0, "update-shared").manifest().files}
    for agent in ("code_generator", "test_generator"):
        assert f"adapters/{agent}/adapter_config.json" in files
    assert not any(name.startswith("model/") for name in files)  # no full weights in L2
    loaded = {r["lora_name"] for r in scripted.reloads if "lora_name" in r}
    assert {"lora-code_generator", "lora-test_generator"} <= loaded
    # iteration 0 sampled from the base model; iteration 1 from each agent's own adapter
    rows0 = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    rows1 = read_step_trajectories(layout.step(1, "rollouts")).to_pylist()
    assert {r["lora_name"] for r in rows0} == {None}
    assert {(r["agent_name"], r["lora_name"]) for r in rows1} <= {
        ("code_generator", "lora-code_generator"),
        ("test_generator", "lora-test_generator"),
    }
    assert "lora-code_generator" in {r["model"] for r in scripted.requests}


def test_generation_budget_ends_the_run_early(tmp_path, prefect_env, tiny_model, scripted) -> None:
    """run.max_generated_tokens: the run stops after the iteration that spends the budget, however many
    iterations run.iterations allows; the report of that iteration says how much was spent."""
    from pettingflow.flows.train import train
    from pettingflow.steps.report import generated_tokens

    base = overrides(tmp_path, tiny_model, scripted.url, "run.iterations=3", "validation.frequency=0")
    out = train("code-env", [*base, "run.max_generated_tokens=1"])
    layout = RunLayout(str(tmp_path), out["run_id"])
    assert len(out["iterations"]) == 1 and layout.iterations() == [0]
    assert generated_tokens(layout) >= 1


@pytest.mark.slow  # the study runner (`learn`), about 30 s here: kept out of the quick loop, run by `make test`
def test_learn_scores_a_lora_team_with_its_roles_swapped(tmp_path, prefect_env, tiny_model, scripted) -> None:
    """The positive control: an arm whose two agents have adapters of their own is also scored after training
    with each agent played by the other's adapter (view ``swapped``), stored, reported and rebuilt from storage."""
    import json

    from pettingflow.analysis.learning import arm_from_runs
    from pettingflow.flows.learn import learn

    extra = [
        f"run.storage_root={tmp_path}",
        "run.iterations=1",
        f"policies.0.model={tiny_model}",
        "specialization=lora",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        "env.group_size=2",
        "env.max_turns=2",
        "validation.num_tasks=2",
        "validation.frequency=0",
    ]
    seen = len(scripted.requests)
    out = learn(["code-env-learn"], extra, url=scripted.url)
    (row,) = out["rows"]
    assert row["swapped_after"] is not None and "roles swapped, after" in Path(out["uri"], "learning.md").read_text()
    (arm,) = json.loads(Path(out["uri"], "learning.json").read_text())["arms"]
    assert set(arm["evaluations"]["after"]) == {"sampled", "greedy", "swapped"}
    assert set(arm["evaluations"]["before"]) == {"sampled", "greedy"}  # nothing to swap before training
    info = RunLayout(str(tmp_path), arm["evaluations"]["after"]["swapped"]).read_run_info()
    assert info["evaluates"]["roles_swapped"] is True
    # the swapped evaluation ran last: there the code agent's prompts went to the test agent's adapter
    last = scripted.requests[seen:][-1]
    prompt = scripted.tokenizer.decode(last["prompt"])
    want = "lora-code_generator" if "careful Python tester" in prompt else "lora-test_generator"
    assert last["model"] == want, (last["model"], prompt[-200:])
    rebuilt = arm_from_runs(str(tmp_path), arm["run_id"])
    assert rebuilt.evaluations == arm["evaluations"] and rebuilt.headline("after", "swapped") == row["swapped_after"]


@pytest.mark.slow  # the study runner (`learn`), about a minute here: kept out of the quick loop, run by `make test`
def test_learn_evaluates_trains_and_reevaluates_each_config(tmp_path, prefect_env, tiny_model, scripted) -> None:
    """The learn flow: base evaluation, training, final evaluation per config, then one summary."""
    import json

    from pettingflow.analysis.learning import arm_from_runs
    from pettingflow.flows.learn import learn

    extra = [
        f"run.storage_root={tmp_path}",
        "run.iterations=2",
        f"policies.0.model={tiny_model}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        "env.group_size=2",
        "validation.num_tasks=4",
        "validation.samples_per_task=2",
        "validation.temperature=1.0",
        "validation.frequency=0",
        "env.dataset.validation_fraction=0.97",  # 3 train tasks, 2 per iteration: iteration 1 draws one again
    ]
    reloads_before = len(scripted.reloads)
    out = learn(["code-env-learn-solo", "code-env-learn"], extra, url=scripted.url, seeds=[3], prune_checkpoints=True)
    rows = {r["config"]: r for r in out["rows"]}
    assert set(rows) == {"code-env-learn-solo", "code-env-learn"}
    summary = json.loads(Path(out["uri"], "learning.json").read_text())
    assert [arm["seed"] for arm in summary["arms"]] == [3, 3]  # --seeds reached each run's config
    (compared,) = summary["comparisons"]  # solo vs team, paired at seed 3
    assert (compared["a"], compared["b"], compared["seeds"]) == ("code-env-learn-solo", "code-env-learn", [3])
    assert compared["delta"] == 0.0  # the scripted server ignores the weights: no arm changes
    assert compared["a_tokens"][0] > 0 and compared["b_tokens"][0] > compared["a_tokens"][0]  # 3 turns vs 1
    assert Path(out["uri"], "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "code-env-learn-solo" in Path(out["uri"], "learning.md").read_text()
    for arm in summary["arms"]:
        layout = RunLayout(str(tmp_path), arm["run_id"])
        assert all(layout.step(k, "update-shared").is_committed() for k in (0, 1))
        assert [p["iteration"] for p in arm["curve"]] == [0.0, 1.0]
        assert arm["before"]["sampled"]["code_generator"]["episodes"] == 8.0  # 4 held-out tasks x 2 samples
        assert arm["before"]["greedy"]["code_generator"]["episodes"] == 4.0  # one greedy answer per task
        # the scripted server ignores the weights and both evaluations use the same seeds: equal scores
        assert arm["before"] == arm["after"]
        assert arm["paired"]["sampled"]["delta"] == arm["paired"]["sampled"]["ci95_high"] == 0.0
        assert arm["paired"]["sampled"]["tasks"] == 4.0
        assert arm["revisits"]["tasks"] == 1.0
        assert set(arm["evaluations"]["after"]) == {"sampled", "greedy"}
        # the same summary rebuilt from the stored runs alone (`pettingflow runs learning-report`)
        rebuilt = arm_from_runs(str(tmp_path), arm["run_id"])
        assert rebuilt.evaluations == arm["evaluations"] and rebuilt.paired == arm["paired"]
        for when in ("before", "after"):
            for view, agents in arm[when].items():
                got = getattr(rebuilt, when)[view]["code_generator"]
                want = agents["code_generator"]
                assert (got["success_rate"], got["episodes"]) == (want["success_rate"], want["episodes"])
    # the scripted server solves even seeds only, so not every held-out episode passes
    assert 0.0 < rows["code-env-learn-solo"]["heldout_before"] < 1.0
    # each config started from the base weights, and the final evaluations synced the trained ones
    paths = [
        r["kwargs"]["weights_path"] for r in scripted.reloads[reloads_before:] if r.get("method") == "reload_weights"
    ]
    assert sum(path == str(tiny_model) for path in paths) >= 2
    # the newest update that changed weights: iteration 1's, or 0's when the DAPO filter left iteration 1 no rows
    for arm in summary["arms"]:
        layout = RunLayout(str(tmp_path), arm["run_id"])
        last = max(k for k in (0, 1) if not layout.step(k, "update-shared").manifest().metadata.get("skipped"))
        assert any(path.endswith(f"{arm['run_id']}/iter-{last}/update-shared/model") for path in paths), paths
        # prune_checkpoints: the last update keeps its weights, an earlier one (when it trained) lost them
        assert "model/config.json" in layout.step(last, "update-shared").files()
        if last == 1 and not layout.step(0, "update-shared").manifest().metadata.get("skipped"):
            assert layout.step(0, "update-shared").pruned() and not any(
                f.startswith("model/") for f in layout.step(0, "update-shared").files()
            )
