"""The learning-run summary: curves from stored reports, the results table, the plot."""

from __future__ import annotations

import math

import pytest

from pettingflow.analysis.figures import learning_png, markdown_table
from pettingflow.analysis.learning import ArmResult, final_successes, results_table
from pettingflow.analysis.stats import first_last_mean, paired_bootstrap, smooth


def _arm(config: str, before: float, after: float, rewards: list[float]) -> ArmResult:
    def scores(rate: float) -> dict:
        return {
            "sampled": {"code_generator": {"success_rate": rate, "reward_mean": rate, "episodes": 120.0}},
            "greedy": {"code_generator": {"success_rate": rate / 2, "reward_mean": rate / 2, "episodes": 30.0}},
        }

    curve = [{"iteration": float(i), "train_reward": r} for i, r in enumerate(rewards)]
    return ArmResult(config, f"run-{config}", f"file:///runs/{config}", scores(before), scores(after), curve)


def test_smooth_is_a_trailing_mean():
    assert smooth([0.0, 1.0, 2.0, 3.0, 4.0], window=2) == [0.0, 0.5, 1.5, 2.5, 3.5]
    assert smooth([]) == []


def test_first_last_mean_uses_at_most_half_of_the_points():
    assert first_last_mean([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]) == (0.0, 1.0)
    assert first_last_mean([0.0, 1.0, 2.0]) == (0.0, 2.0)  # n shrinks to 1 for 3 points
    start, end = first_last_mean([])
    assert math.isnan(start) and math.isnan(end)


def test_results_table_reports_held_out_change_and_train_trend():
    solo = _arm("solo", 0.25, 0.40, [0.1, 0.2, 0.2, 0.3, 0.5, 0.5, 0.6, 0.6])
    solo.wall_s = 90.0
    rows = results_table([solo])
    (row,) = rows
    assert row["heldout_before"] == 0.25 and row["heldout_after"] == 0.40
    assert math.isclose(row["heldout_delta"], 0.15)
    assert (row["greedy_before"], row["greedy_after"]) == (0.125, 0.20)
    assert math.isclose(row["train_reward_first4"], 0.2) and math.isclose(row["train_reward_last4"], 0.55)
    assert row["iterations"] == 8
    table = markdown_table(rows)
    expected = (
        "| `solo` | 25.0 % | 40.0 % | +15.0 pts | 12.5 % | 20.0 % | n/a "
        "| n/a (no task drawn twice) | 0.200 | 0.550 | 8 | 0.0 | 1.5 |"  # no tokens counted in this curve
    )
    assert expected in table
    arm = _arm("solo", 0.25, 0.40, [0.1, 0.2])
    arm.revisits = {"first_mean": 0.25, "last_mean": 0.5, "ci95_low": 0.1, "ci95_high": 0.4, "tasks": 12.0}
    assert "25.0 % → 50.0 % [+10.0, +40.0], 12 tasks" in markdown_table(results_table([arm]))


def test_missing_agent_scores_show_as_not_available():
    arm = _arm("duo", 0.5, 0.5, [0.5])
    arm.after = {}
    (row,) = results_table([arm])
    assert row["heldout_after"] is None and row["heldout_delta"] is None
    assert "n/a" in markdown_table([row])


def test_plot_is_a_png():
    png = learning_png([_arm("solo", 0.2, 0.3, [0.1, 0.3]), _arm("duo", 0.1, 0.2, [0.2, 0.2])])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_successes_take_each_episodes_last_turn_of_the_agent():
    rows = [
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 0, "agent_name": "code_generator", "success": False},
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 1, "agent_name": "test_generator", "success": True},
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 2, "agent_name": "code_generator", "success": True},
        {"env_idx": 0, "sample_idx": 1, "turn_idx": 0, "agent_name": "code_generator", "success": False},
        {"env_idx": 1, "sample_idx": 0, "turn_idx": 0, "agent_name": "code_generator", "success": True},
    ]
    assert final_successes(rows) == {0: [True, False], 1: [True]}
    # episodes that ended before the test writer's turn are its failures, not left out
    assert final_successes(rows, "test_generator") == {0: [True, False], 1: [False]}
    # an asked episode that left no row at all (task 2) counts too, as a failure
    asked = [(t, s) for t in range(3) for s in range(2)]
    assert final_successes(rows, asked=asked) == {0: [True, False], 1: [True, False], 2: [False, False]}


def test_paired_bootstrap_counts_tasks_and_brackets_the_change():
    before = {t: [False, False, True, False] for t in range(10)}
    after = {t: [True, True, True, False] if t < 6 else [False, False, True, False] for t in range(10)}
    out = paired_bootstrap(before, after, n_boot=2000, seed=1)
    assert math.isclose(out["delta"], 0.3)  # 6 of 10 tasks gained 2 of 4 samples
    assert (out["tasks"], out["tasks_better"], out["tasks_worse"]) == (10.0, 6.0, 0.0)
    assert 0.0 < out["ci95_low"] < out["delta"] < out["ci95_high"] <= 0.5
    same = paired_bootstrap(before, before)
    assert same["delta"] == same["ci95_low"] == same["ci95_high"] == 0.0


def test_paired_bootstrap_needs_shared_tasks():
    import pytest

    with pytest.raises(ValueError, match="share no held-out task"):
        paired_bootstrap({0: [True]}, {1: [True]})


def test_iteration_metrics_report_the_time_outside_step_tasks():
    from pettingflow.steps.report import iteration_metrics

    flat = iteration_metrics({}, {"rollouts": 10.0, "update-shared": 28.0}, iteration_s=40.0)
    assert flat["orchestration/outside_step_tasks_s"] == 2.0
    assert flat["orchestration/outside_step_tasks_share"] == 0.05
    assert "orchestration/outside_step_tasks_s" not in iteration_metrics({}, {"rollouts": 1.0})


def test_paired_arm_difference_by_hand():
    """Two seeds, three tasks, two samples each. Seed 0: A gains 0.5 on task 0 where B gains nothing;
    seed 1: B gains 1.0 on task 2 where A gains 0.5. Per task, averaged over seeds: +0.25, 0, -0.25."""
    import pytest

    from pettingflow.analysis.stats import paired_arm_difference

    base = {0: [False, False], 1: [True, False], 2: [False, False]}
    a = [
        (base, {0: [True, False], 1: [True, False], 2: [False, False]}),
        (base, {0: [False, False], 1: [True, False], 2: [True, False]}),
    ]
    b = [(base, base), (base, {0: [False, False], 1: [True, False], 2: [True, True]})]
    out = paired_arm_difference(a, b, n_boot=500)
    assert out["delta"] == pytest.approx(0.0)
    assert out["per_seed"] == pytest.approx([0.5 / 3, -0.5 / 3])
    assert (out["tasks"], out["tasks_better"], out["tasks_worse"]) == (3, 1, 1)
    assert out["ci95_low"] < 0 < out["ci95_high"]
    with pytest.raises(ValueError, match="same number"):
        paired_arm_difference(a, b[:1])


def test_seeds_that_agree_exactly_give_no_interval_over_seeds():
    """Two seeds with the same change (+1/6 each, on different tasks) say nothing about the spread between
    training runs: no zero-width interval, no detectable effect of 0, and the table says why."""
    from pettingflow.analysis.figures import _difference
    from pettingflow.analysis.stats import paired_arm_difference

    base = {0: [False, False], 1: [True, False], 2: [False, False]}
    a = [
        (base, {0: [True, False], 1: [True, False], 2: [False, False]}),
        (base, {0: [False, False], 1: [True, False], 2: [True, False]}),
    ]
    out = paired_arm_difference(a, n_boot=200)
    assert out["per_seed"][0] == out["per_seed"][1] > 0
    assert (out["ci95_seeds"], out["detectable_seeds"], out["seed_sd"]) == (None, None, 0.0)
    assert out["detectable_tasks"] is not None
    assert "n/a (seeds agree exactly) | n/a, " in _difference(out)
    assert "n/a (1 seed)" in _difference(paired_arm_difference(a[:1], n_boot=200))


def _seeded_arm(config: str, seed: int, before: dict, after: dict, tokens: float) -> ArmResult:
    def scores(outcomes: dict) -> dict:
        rate = sum(sum(v) for v in outcomes.values()) / sum(len(v) for v in outcomes.values())
        return {"sampled": {"executor": {"success_rate": rate, "reward_mean": rate, "episodes": 4.0}}}

    return ArmResult(
        config,
        f"run-{config}-{seed}",
        "file:///runs",
        scores(before),
        scores(after),
        curve=[{"iteration": 0.0, "tokens_generated": tokens}],
        headline_agent="executor",
        seed=seed,
        outcomes={"before": {"sampled": before}, "after": {"sampled": after}},
    )


def test_compare_arms_pairs_configs_seed_by_seed_and_prints_the_table():
    from pettingflow.analysis.figures import comparison_table, summary_table
    from pettingflow.analysis.learning import compare_arms, config_summaries

    base = {0: [False, False], 1: [False, True]}
    good = {0: [True, True], 1: [False, True]}
    arms = [
        _seeded_arm("tree", 0, base, good, 1000.0),
        _seeded_arm("indep", 0, base, base, 1200.0),
        _seeded_arm("tree", 1, base, good, 1100.0),
        _seeded_arm("indep", 1, base, good, 900.0),
        _seeded_arm("solo", 7, base, base, 500.0),  # no seed in common with the others: not compared
    ]
    (c,) = compare_arms(arms)
    assert (c["a"], c["b"], c["seeds"]) == ("tree", "indep", [0, 1])
    assert c["per_seed"] == [0.5, 0.0]  # seed 0: tree gained 1.0 on task 0, indep nothing; seed 1: both did
    assert c["delta"] == 0.25 and c["a_tokens"] == [1000, 1100] and c["b_tokens"] == [1200, 900]
    assert "| `tree` (seed 1) | 25.0 % | 75.0 % |" in markdown_table(results_table(arms))
    # over seeds (the training run as the unit): differences 0.5 and 0.0, sd/sqrt(2) = 0.25, t(.975, 1 df) = 12.706
    assert c["ci95_seeds"] == pytest.approx([0.25 - 12.706 * 0.25, 0.25 + 12.706 * 0.25])
    assert c["detectable_seeds"] == pytest.approx((12.706 + 1.376) * 0.25)  # two seeds see only huge effects
    tree, indep, solo = config_summaries(arms)
    assert (tree["config"], tree["seeds"], tree["per_seed"]) == ("tree", [0, 1], [0.5, 0.5])
    assert (tree["before"], tree["after"], tree["tokens_generated"]) == (0.25, 0.75, 1050.0)
    assert indep["per_seed"] == [0.0, 0.5] and indep["delta"] == 0.25 and indep["wall_s"] is None  # not timed
    assert solo["seeds"] == [7] and solo["ci95_seeds"] is None
    summary = summary_table([tree, indep]).splitlines()
    assert summary[-2].startswith("| `tree` | 0, 1 | 25.0 | 75.0 | +50.0 pts [+0.0, +100.0] | +50.0, +50.0 |")
    assert summary[-1].endswith("| 1.1 | 1.0 | n/a |")
    line = comparison_table([c]).splitlines()[-1]
    assert line == (
        "| `tree` vs `indep` | 0, 1 | 25.0, 25.0 → 75.0, 75.0 | 25.0, 25.0 → 25.0, 75.0 | +25.0 pts "
        f"[{100 * c['ci95_low']:+.1f}, {100 * c['ci95_high']:+.1f}] | +50.0, +0.0 | [-292.6, +342.6] | "
        f"352.1 pts, {100 * c['detectable_tasks']:.1f} pts | 1.0 / 1.2, 1.1 / 0.9 |"
    )


def test_role_swap_effect_is_the_swapped_score_minus_the_trained_one_paired_by_seed_and_task():
    """The positive control: seed 0's trained pair solves task 0 twice and fails it swapped (-1.0 on task 0,
    0 on task 1: -0.5); seed 1 loses one of two samples on task 1 (-0.25). Arms without a swapped view are left out."""
    from pettingflow.analysis.figures import role_swap_table
    from pettingflow.analysis.learning import role_swap_effects, write_learning_report

    base = {0: [False, False], 1: [False, True]}
    trained = {0: [True, True], 1: [False, True]}
    arms = [
        _seeded_arm("lora", 1, base, trained, 900.0),
        _seeded_arm("lora", 0, base, trained, 1000.0),
        _seeded_arm("shared", 0, base, trained, 1000.0),  # prompt specialisation: nothing to swap
    ]
    arms[0].outcomes["after"]["swapped"] = {0: [True, True], 1: [False, False]}
    arms[1].outcomes["after"]["swapped"] = {0: [False, False], 1: [False, True]}
    for arm in arms[:2]:
        rate = sum(map(sum, arm.outcomes["after"]["swapped"].values())) / 4
        arm.after["swapped"] = {"executor": {"success_rate": rate, "reward_mean": rate, "episodes": 4.0}}

    (effect,) = role_swap_effects(arms)
    assert (effect["config"], effect["seeds"]) == ("lora", [0, 1])  # seed order, whatever the arms' order
    assert effect["trained"] == [0.75, 0.75] and effect["swapped"] == [0.25, 0.5]
    assert effect["per_seed"] == pytest.approx([-0.5, -0.25]) and effect["delta"] == pytest.approx(-0.375)
    assert effect["ci95_seeds"] == pytest.approx([-0.375 - 12.706 * 0.125, -0.375 + 12.706 * 0.125])
    line = role_swap_table([effect]).splitlines()[-1]
    assert line.startswith("| `lora` | 0, 1 | 75.0, 75.0 | 25.0, 50.0 | -37.5 pts [")
    assert "| -50.0, -25.0 | [-196.3, +121.3] |" in line
    assert role_swap_effects(arms[2:]) == []
    table = write_learning_report(arms[:2], "memory://swap-report")
    assert "roles swapped (positive control)" in table


def test_detectable_effect_and_seeds_needed_follow_the_t_distribution():
    from pettingflow.analysis.stats import T_975, Z_975, detectable_effect, t_quantile, units_needed

    assert t_quantile(T_975, 2, Z_975) == 4.303 and t_quantile(T_975, 11, Z_975) == 2.228  # 11 df -> 10's value
    assert t_quantile(T_975, 500, Z_975) == Z_975
    assert detectable_effect(0.1, 3) == pytest.approx((4.303 + 1.061) * 0.1 / 3**0.5)
    # a run-to-run spread of 5 pts per seed needs about (1.96 + 0.84)^2 ~ 8 seeds (more with t) to see 5 pts
    n = units_needed(0.05, 0.05)
    assert detectable_effect(0.05, n) <= 0.05 < detectable_effect(0.05, n - 1) and 9 <= n <= 12
    with pytest.raises(ValueError, match="at least 2"):
        detectable_effect(0.1, 1)


def test_outcome_agent_is_the_role_whose_last_turn_is_the_result():
    import pytest

    from pettingflow.analysis.learning import outcome_agent
    from pettingflow.configs import load_config

    assert outcome_agent(load_config("code-env-learn", [])) == "code_generator"
    assert outcome_agent(load_config("plan-path-learn-tree", [])) == "executor"
    assert outcome_agent(load_config("plan-path-learn-solo", [])) == "walker"
    cfg = load_config("plan-path-learn", [])
    cfg.agents = cfg.agents[:1]  # the planner alone never moves
    with pytest.raises(ValueError, match="decides_outcome"):
        outcome_agent(cfg)


def test_arms_that_score_the_base_model_alike_share_one_base_evaluation() -> None:
    """A tree arm and an independent arm of one team score the base model identically (validation runs independent
    episodes, same seeds): the study evaluates it once. Agents, seed or validation settings that differ do not."""
    from pettingflow.configs import load_config
    from pettingflow.flows.learn import base_evaluation_key, base_evaluations

    team, tree = load_config("plan-path-learn"), load_config("plan-path-learn-tree")
    assert team.rollout.mode != tree.rollout.mode
    assert base_evaluation_key(team) == base_evaluation_key(tree)
    assert base_evaluation_key(team) != base_evaluation_key(load_config("plan-path-learn-solo"))
    assert base_evaluation_key(team) != base_evaluation_key(load_config("plan-path-learn", ["run.seed=7"]))
    assert base_evaluation_key(team) != base_evaluation_key(load_config("plan-path-learn", ["validation.num_tasks=3"]))
    assert base_evaluation_key(team) == base_evaluation_key(
        load_config(
            "plan-path-learn",
            ["algorithm.filter_method=mean", "rollout.mode=tree", "rollout.tree.branches=4", "env.group_size=1"],
        )
    )

    calls = []

    def fake_evaluate(name, overrides):
        calls.append((name, tuple(overrides)))
        return {"run_id": f"eval-{len(calls)}", "agents": {}}

    done: dict = {}
    first, reused = base_evaluations("plan-path-learn", [], done, fake_evaluate)
    assert reused is None and len(calls) == 2  # the sampled and the greedy view
    again, reused = base_evaluations("plan-path-learn-tree", [], done, fake_evaluate)
    assert reused == "plan-path-learn" and again is first and len(calls) == 2
    base_evaluations("plan-path-learn-solo", [], done, fake_evaluate)
    assert len(calls) == 4


def test_the_role_swap_control_gives_each_agent_the_other_agents_weights() -> None:
    """lora: the adapters change hands; full: the policies do; one shared model has no roles to swap."""
    from pettingflow.configs import load_config
    from pettingflow.flows.evaluate import swap_roles
    from pettingflow.runs.endpoint import PolicyEndpoint

    lora = load_config("plan-path-learn", ["specialization=lora"])
    adapters = {"planner": "lora-planner", "executor": "lora-executor"}
    endpoints = {"shared": PolicyEndpoint("shared", "http://x", "m", "/m", adapters=adapters)}
    config, swapped = swap_roles(lora, endpoints)
    assert config is lora and swapped["shared"].adapters == {"planner": "lora-executor", "executor": "lora-planner"}
    assert endpoints["shared"].adapters == adapters  # the runtime's endpoints are left alone

    two = [
        "specialization=full",
        "policies=[{name: p, model: smollm2-135m-instruct}, {name: e, model: smollm2-135m-instruct}]",
        "agents.planner.policy=p",
        "agents.executor.policy=e",
    ]
    config, _ = swap_roles(load_config("plan-path-learn", two), {})
    assert {a.name: a.policy for a in config.agents} == {"planner": "e", "executor": "p"}
    with pytest.raises(ValueError, match="two agents with weights of their own"):
        swap_roles(load_config("plan-path-learn"), {})


def test_reports_of_single_seeds_combine_into_the_report_of_all_seeds(tmp_path) -> None:
    """A study run a seed per session: each invocation's learning.json, read back and combined, gives the same
    comparison as the arms compared in one go (the held-out task positions survive JSON's string keys)."""
    import json

    from typer.testing import CliRunner

    from pettingflow.analysis.learning import (
        arms_from_learning_json,
        combine_arms,
        compare_arms,
        write_learning_report,
    )
    from pettingflow.cli import app

    base = {0: [False, False], 1: [False, True]}
    good = {0: [True, True], 1: [False, True]}
    seed0 = [_seeded_arm("tree", 0, base, good, 1000.0), _seeded_arm("indep", 0, base, base, 1200.0)]
    seed1 = [_seeded_arm("tree", 1, base, good, 1100.0), _seeded_arm("indep", 1, base, good, 900.0)]
    write_learning_report(seed0, str(tmp_path / "seed0"))
    write_learning_report(seed1, str(tmp_path / "seed1"))

    combined = combine_arms(
        [*arms_from_learning_json(str(tmp_path / "seed0")), *arms_from_learning_json(str(tmp_path / "seed1"))]
    )
    assert combined[0].outcomes == seed0[0].outcomes  # int task keys again, not "0", "1"
    assert compare_arms(combined) == compare_arms([*seed0, *seed1])
    whole_study = combine_arms(arms_from_learning_json(str(tmp_path)))  # the folder of both reports, read whole
    assert compare_arms(whole_study) == compare_arms(combined)

    out = tmp_path / "all"
    reports = ["--from-json", str(tmp_path / "seed0" / "learning.json"), "--from-json", str(tmp_path / "seed1")]
    result = CliRunner().invoke(app, ["runs", "learning-report", *reports, "--out", str(out)])
    assert result.exit_code == 0, result.output
    (comparison,) = json.loads((out / "learning.json").read_text())["comparisons"]
    assert comparison["seeds"] == [0, 1] and comparison["per_seed"] == [0.5, 0.0]

    seed0_twice = ["--from-json", str(tmp_path / "seed0"), "--from-json", str(tmp_path / "seed0")]
    twice = CliRunner().invoke(app, ["runs", "learning-report", *seed0_twice, "--out", str(tmp_path / "twice")])
    assert twice.exit_code == 0, twice.output
    assert len(json.loads((tmp_path / "twice" / "learning.json").read_text())["arms"]) == 2  # each run once
    rerun = _seeded_arm("tree", 0, base, base, 900.0)
    rerun.run_id = "run-tree-0-again"
    with pytest.raises(ValueError, match="two runs of tree with seed 0"):
        combine_arms([*seed0, rerun])
    missing = CliRunner().invoke(app, ["runs", "learning-report", "--from-json", str(tmp_path / "nowhere")])
    assert missing.exit_code != 0 and "no learning report at" in missing.output
    assert CliRunner().invoke(app, ["runs", "learning-report"]).exit_code != 0


def test_a_failed_arm_leaves_the_report_of_the_others_and_fails_the_study(tmp_path, prefect_env, monkeypatch) -> None:
    """Hours of a study must not be lost to one arm: the others are scored and reported, the failure is named."""
    import json
    from contextlib import nullcontext
    from datetime import datetime
    from types import SimpleNamespace

    from pettingflow.flows import learn as learn_flow

    config = SimpleNamespace(run=SimpleNamespace(storage_root=str(tmp_path), storage_options={}))
    config.specialization, config.policies = SimpleNamespace(value="prompt"), ["shared"]
    monkeypatch.setattr(learn_flow, "_shared_model", lambda names, overrides: (tmp_path, [config] * len(names)))

    class Server(nullcontext):
        url = "http://127.0.0.1:1"

    monkeypatch.setattr(learn_flow, "shared_service", lambda *a, **k: SimpleNamespace(server=Server()))
    base = {0: [False, True]}

    def run_arm(name, label, run_overrides, cfg, shared, base_done):
        if name == "broken":
            raise RuntimeError("the server went away")
        return _seeded_arm(name, int(run_overrides[-1].split("=")[1]), base, {0: [True, True]}, 100.0)

    monkeypatch.setattr(learn_flow, "_run_arm", run_arm)
    with pytest.raises(RuntimeError, match=r"1 of 3 arms failed") as failure:
        learn_flow.learn(["tree", "broken", "indep"], url=Server.url, seeds=[0])
    assert "broken (seed 0): RuntimeError: the server went away" in str(failure.value)
    (report,) = (tmp_path / "learning").iterdir()
    stored = json.loads((report / "learning.json").read_text())
    assert [a["config"] for a in stored["arms"]] == ["tree", "indep"]  # the arm after the failure still ran
    assert stored["failed"] == ["broken (seed 0): RuntimeError: the server went away"]

    class Stopped(BaseException):  # the session's end, mid-study: no arm after it runs, no final report
        pass

    def stopped_after_first(name, label, run_overrides, cfg, shared, base_done):
        if name == "stopped":
            raise Stopped
        return run_arm(name, label, run_overrides, cfg, shared, base_done)

    monkeypatch.setattr(learn_flow, "_run_arm", stopped_after_first)
    later = datetime(2030, 1, 1)  # a stamp of its own: the first study's folder is not reused
    monkeypatch.setattr(learn_flow, "datetime", SimpleNamespace(now=lambda tz: later))
    with pytest.raises(Stopped):
        learn_flow.learn(["tree", "stopped", "indep"], url=Server.url, seeds=[1])
    partial = json.loads((tmp_path / "learning" / "20300101-000000" / "learning.json").read_text())
    assert [a["config"] for a in partial["arms"]] == ["tree"]  # written after each arm, not only at the end


def test_an_arm_of_several_full_models_runs_on_servers_of_its_own(tmp_path, prefect_env, monkeypatch) -> None:
    """One shared server holds one model; an L3 arm (a full model per agent, the full-weight positive control)
    gets no ``inference.url``, so its subflows start a server per policy, while the other arms keep sharing."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from pettingflow.configs import load_config
    from pettingflow.flows import learn as learn_flow

    full = load_config("plan-path-learn-lookahead-full", [f"run.storage_root={tmp_path}"])
    prompt = load_config("plan-path-learn-lookahead", [f"run.storage_root={tmp_path}"])
    assert learn_flow.own_servers(full) and not learn_flow.own_servers(prompt)
    assert not learn_flow.own_servers(load_config("plan-path-learn-lookahead-lora"))  # adapters: one server
    configs = {"full": full, "prompt": prompt}
    monkeypatch.setattr(learn_flow, "_shared_model", lambda names, o: (tmp_path, [configs[n] for n in names]))
    started: list[str] = []

    class Server(nullcontext):
        url, log_path = "http://127.0.0.1:1", tmp_path / "vllm.log"

        def __enter__(self):
            started.append(self.url)

    monkeypatch.setattr(learn_flow, "shared_service", lambda *a, **k: SimpleNamespace(server=Server()))
    seen: dict[str, tuple[list[str], object]] = {}

    def run_arm(name, label, run_overrides, cfg, shared, base_done):
        seen[name] = (run_overrides, shared)
        return _seeded_arm(name, 0, {0: [False, True]}, {0: [True, True]}, 100.0)

    monkeypatch.setattr(learn_flow, "_run_arm", run_arm)
    learn_flow.learn(["full", "prompt"], ["run.iterations=1"], seeds=[0])
    assert started == [Server.url]  # one shared server, for the prompt arm
    assert seen["full"] == (["run.iterations=1", "run.seed=0"], None)
    assert seen["prompt"][0] == ["run.iterations=1", f"inference.url={Server.url}", "run.seed=0"]
    assert seen["prompt"][1] is not None
    started.clear()
    learn_flow.learn(["full"], seeds=[0])
    assert started == []  # nothing shares: no server idles beside the arm's own
    with pytest.raises(ValueError, match=r"--url attaches every arm to one server, but \['full'\]"):
        learn_flow.learn(["full", "prompt"], url=Server.url)
