"""bench/learning_vs_trl.py: the report's math on inputs whose answer is known, and the machinery end to end
(one tiny iteration of each trainer, then the shared evaluator scoring both) on a tiny model and the scripted
server. Not the study itself (hours of CPU; docs/results.md, "Learning vs TRL (planned)")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import learning_vs_trl as lvt
from pettingflow.analysis.stats import detectable_effect


# ------------------------------------------------------------------------------------------ pure math
def test_success_rate_counts_every_sample() -> None:
    assert lvt.success_rate({"a": [True, False], "b": [True, True]}) == 0.75
    with pytest.raises(ValueError, match="no samples"):
        lvt.success_rate({})


def test_interpolate_and_first_crossing() -> None:
    xs, ys = [0.0, 100.0, 300.0], [0.2, 0.4, 0.3]
    assert lvt.interpolate(xs, ys, 50.0) == pytest.approx(0.3)
    assert lvt.interpolate(xs, ys, 200.0) == pytest.approx(0.35)
    assert lvt.interpolate(xs, ys, 400.0) is None  # past the curve: no extrapolation
    assert lvt.first_crossing(xs, ys, 0.3) == pytest.approx(50.0)
    assert lvt.first_crossing(xs, ys, 0.45) is None
    assert lvt.first_crossing(xs, ys, 0.1) == 0.0
    # a target that is the curve's own end, one rounding above it (0.1 + 0.2 > 0.3), is reached at the end
    assert lvt.first_crossing([0.0, 10.0], [0.1, 0.3], 0.1 + 0.2) == pytest.approx(10.0)
    assert lvt.first_crossing([0.0, 10.0], [0.1, 0.3], 0.3001) is None
    with pytest.raises(ValueError, match="must not decrease"):
        lvt.interpolate([1.0, 0.0], [0.0, 1.0], 0.5)


def test_wall_per_point_and_checkpoints() -> None:
    assert lvt.wall_per_point(600.0, 0.15) == pytest.approx(40.0)  # 600 s for 15 points
    assert lvt.wall_per_point(600.0, 0.0) is None
    assert lvt.checkpoints(12, 4) == [4, 8, 12]
    assert lvt.checkpoints(10, 4) == [4, 8, 10]
    with pytest.raises(ValueError):
        lvt.checkpoints(0, 4)


def _synthetic() -> tuple[list[dict[int, list[bool]]], dict[str, list[dict[int, list[bool]]]]]:
    """2 seeds x 4 tasks x 2 samples. Base: 1 of 2 samples solved on every task (50 %). PettingFlow after: seed 0
    solves everything (+50 pts), seed 1 tasks 0-2 (+37.5 pts); TRL after: seed 0 tasks 0-1 but not 2-3 (0 pts),
    seed 1 as base (0 pts). Per task, PF gain - TRL gain: seed 0 [0, 0, 1, 1], seed 1 [.5, .5, .5, 0]; averaged over
    seeds [.25, .25, .75, .5]."""
    half = {t: [True, False] for t in range(4)}
    solved = {t: [True, True] for t in range(4)}
    pf1 = {t: [True, True] if t < 3 else [True, False] for t in range(4)}
    trl0 = {t: [True, True] if t < 2 else [False, False] for t in range(4)}
    return [half, half], {"pettingflow": [solved, pf1], "trl": [trl0, half]}


def test_compare_known_difference_intervals_and_verdicts() -> None:
    base, final = _synthetic()
    curves = {
        "pettingflow": {"tokens": [0.0, 1000.0], "wall_s": [0.0, 100.0], "success": [0.5, 0.9375]},
        "trl": {"tokens": [0.0, 2000.0], "wall_s": [0.0, 400.0], "success": [0.5, 0.5]},
    }
    c = lvt.compare(base, final, curves)
    d = c["difference"]
    per_task = [0.25, 0.25, 0.75, 0.5]
    assert d["delta"] == pytest.approx(sum(per_task) / 4)  # 0.4375
    assert d["per_seed"] == pytest.approx([0.5, 0.375])
    assert c["gain"]["pettingflow"]["delta"] == pytest.approx(0.4375)
    assert c["gain"]["trl"]["delta"] == pytest.approx(0.0)
    sd_tasks = math.sqrt(sum((x - 0.4375) ** 2 for x in per_task) / 3)
    assert d["detectable_tasks"] == pytest.approx(detectable_effect(sd_tasks, 4))
    sd_seeds = math.sqrt(((0.5 - 0.4375) ** 2 + (0.375 - 0.4375) ** 2) / 1)
    assert d["detectable_seeds"] == pytest.approx(detectable_effect(sd_seeds, 2))
    assert c["detectable_difference"] == pytest.approx(max(d["detectable_tasks"], d["detectable_seeds"]))
    assert c["non_inferior"] is True  # PettingFlow better on every task
    assert c["equal_tokens"]["tokens"] == 1000.0
    assert c["equal_tokens"]["gain"]["pettingflow"] == pytest.approx(0.4375)
    assert c["equal_tokens"]["gain"]["trl"] == pytest.approx(0.0)
    assert c["wall_per_point_s"]["pettingflow"] == pytest.approx(100.0 / 43.75)
    assert c["wall_per_point_s"]["trl"] is None  # no gain: no cost per point
    assert c["wall_goal_met"] is None  # TRL gained nothing: the same-gain comparison is undecided


def test_compare_flags_a_trainer_that_learns_less() -> None:
    """Swapping the roles (TRL learns, PettingFlow does not) must turn the verdict: the test can fail."""
    base, final = _synthetic()
    swapped = {"pettingflow": final["trl"], "trl": final["pettingflow"]}
    curves = {
        "pettingflow": {"tokens": [0.0, 1000.0], "wall_s": [0.0, 100.0], "success": [0.5, 0.5]},
        "trl": {"tokens": [0.0, 1000.0], "wall_s": [0.0, 400.0], "success": [0.5, 0.875]},
    }
    c = lvt.compare(base, swapped, curves)
    assert c["difference"]["delta"] == pytest.approx(-0.4375)
    assert c["non_inferior"] is False


def test_same_gain_wall_ratio() -> None:
    """Both gain; PettingFlow reaches TRL's smaller gain (+20 pts) at 50 s, TRL at 400 s: ratio 0.125, met."""
    base = [{t: [False, False] for t in range(2)}]
    final = {
        "pettingflow": [{0: [True, True], 1: [True, False]}],  # +75 pts
        "trl": [{0: [True, False], 1: [False, False]}],  # +25 pts
    }
    curves = {
        "pettingflow": {"tokens": [0.0, 100.0, 200.0], "wall_s": [0.0, 100.0, 200.0], "success": [0.0, 0.5, 0.75]},
        "trl": {"tokens": [0.0, 100.0, 200.0], "wall_s": [0.0, 200.0, 400.0], "success": [0.0, 0.1, 0.25]},
    }
    c = lvt.compare(base, final, curves)
    assert c["same_gain"]["target_gain"] == pytest.approx(0.25)
    assert c["same_gain"]["wall_s"]["pettingflow"] == pytest.approx(50.0)
    assert c["same_gain"]["wall_s"]["trl"] == pytest.approx(400.0)
    assert c["same_gain"]["ratio"] == pytest.approx(0.125)
    assert c["wall_goal_met"] is True
    assert c["non_inferior"] is None  # one seed x 2 tasks with equal differences: no spread, no margin


# ------------------------------------------------------------------------------------------ the footing
def test_sampling_mismatches_names_each_difference() -> None:
    """pf_sampling and trl_sampling speak one vocabulary: vLLM's top_k -1 and transformers' 0 are both "off", one
    EOS id and a list of one are alike; a real difference (transformers' own defaults top_k 50, or a repetition
    penalty from a model's generation_config) is named."""
    from pettingflow.configs.settings import SamplingSettings

    pf = lvt.pf_sampling(SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=128), eos_token_id=2)
    same = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
            "max_new_tokens": 128, "eos_token_id": 2, "pad_token_id": 2}  # fmt: skip
    assert lvt.sampling_mismatches(pf, lvt.trl_sampling(same)) == []
    assert lvt.sampling_mismatches(pf, lvt.trl_sampling({**same, "eos_token_id": [2]})) == []
    off = lvt.trl_sampling({**same, "top_k": 50, "repetition_penalty": 1.2, "max_new_tokens": 256})
    assert lvt.sampling_mismatches(pf, off) == [
        "max_new_tokens: PettingFlow 128, TRL 256",
        "repetition_penalty: PettingFlow 1.0, TRL 1.2",
        "top_k: PettingFlow None, TRL 50",
    ]


def _study_config(tmp_path: Path) -> tuple[object, dict[str, object]]:
    from pettingflow.configs.loader import load_config

    args = lvt.parser().parse_args(["--out", str(tmp_path), "--iterations", "1", "--tasks", "2", "--group-size", "2",
                                    "--micro-batch", "2"])  # fmt: skip
    config = load_config(lvt.CONFIG, lvt.shared_overrides(args, 0))
    return config, {"out": str(tmp_path), "iterations": 1, "seed": 0}


def test_trl_samples_on_pettingflow_footing(tmp_path: Path, tiny_model: Path) -> None:
    """A real GRPOTrainer built from the bench's GRPOConfig: the prompt ids its own tokenization feeds generate()
    are the code agent's (what PettingFlow sends vLLM), and its effective generation settings are PettingFlow's
    request. Planting a difference (a repetition penalty; a prompt re-tokenized with a BOS) makes the check fail."""
    if err := lvt.trl_import_error():
        pytest.skip(err)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from pettingflow.agents.base import build_agent
    from pettingflow.envs.registry import EnvCache, env_spec_from_settings
    from pettingflow.steps.rollouts import select_train_tasks

    config, spec = _study_config(tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    factory = EnvCache().get(env_spec_from_settings(config.env))
    agent_settings = config.agents[0]
    ids = [
        build_agent(agent_settings, agent_idx=0, tokenizer=tok, layout=config.env.sample_layout)
        .update_from_env(0, factory.create(t, seed=0))
        .token_ids
        for t in select_train_tasks(config, 0)
    ]
    prompts = [tok.decode(x, skip_special_tokens=False) for x in ids]

    def trainer(**change: object) -> object:
        kwargs = {**lvt.grpo_kwargs(config, spec, bf16=False), **change}
        return GRPOTrainer(
            model=str(tiny_model),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=GRPOConfig(**kwargs),
            train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        )

    built = trainer()
    checked = lvt.footing(built, tok, prompts, ids, agent_settings.sampling)
    assert checked["prompts_same_ids"] == len(ids) == 2
    assert checked["trl_sampling"] == checked["pettingflow_sampling"]
    assert checked["trl_sampling"]["top_k"] is None and checked["trl_sampling"]["max_new_tokens"] == 128
    with pytest.raises(RuntimeError, match=r"repetition_penalty: PettingFlow 1\.0, TRL 1\.1"):
        lvt.footing(trainer(repetition_penalty=1.1), tok, prompts, ids, agent_settings.sampling)
    with pytest.raises(RuntimeError, match=r"prompt ids differ for task draws \[0, 1\]"):
        lvt.footing(built, tok, prompts, [[tok.bos_token_id, *x] for x in ids], agent_settings.sampling)


# ------------------------------------------------------------------------------------------ the machinery
@pytest.mark.slow  # two trainers (DeepSpeed learner, a TRL child process) and four evaluations: about 2-3 min
def test_one_tiny_iteration_of_each_trainer_then_the_shared_evaluator(
    tmp_path: Path, prefect_env, tiny_model: Path, default_tokenizer
) -> None:
    from bench.scripted_server import ScriptedServer
    from pettingflow.envs.basic_python import load_basic_python
    from pettingflow.storage import RunLayout, read_step_trajectories
    from pettingflow.storage.layout import StepName

    if err := lvt.trl_import_error():
        pytest.skip(err)
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in load_basic_python()}
    out = tmp_path / "study"
    argv = [
        "--out", str(out), "--seeds", "0", "--iterations", "1", "--eval-every", "1", "--tasks", "2",
        "--group-size", "2", "--max-new-tokens", "64", "--micro-batch", "2", "--eval-samples", "2",
        "--eval-tasks", "2", "--dtype", "fp32", "--trl-threads", "1", "--model", str(tiny_model),
    ]  # fmt: skip
    args = lvt.parser().parse_args(argv)
    args.pf_overrides = [f"policies.0.model={tiny_model}", "rollout.use_ray=false"]
    with ScriptedServer(default_tokenizer, solutions) as server:
        args.pf_overrides.append(f"inference.url={server.url}")
        assert lvt.train_all(args, tiny_model) == []
        pf = json.loads((out / "seed-0" / "pettingflow" / "train.json").read_text())
        trl = json.loads((out / "seed-0" / "trl" / "train.json").read_text())
        for run in (pf, trl):
            (it,) = run["iterations"]
            assert it["tokens"] > 0 and it["wall_s"] > 0
        # the same prompts in the same order: TRL's generation batch is task draw 0 then 1, G times each, and its
        # prompt ids are those PettingFlow's rollouts stored for the code agent's first turn
        assert trl["prompts_same_ids"] == trl["prompts"] == 2
        assert trl["footing"]["trl_sampling"] == trl["footing"]["pettingflow_sampling"]
        assert trl["iterations"][0]["task_index"] == [0, 0, 1, 1]
        layout = RunLayout(pf["root"], pf["run_id"])
        rows = read_step_trajectories(layout.step(0, StepName.ROLLOUTS)).to_pylist()
        pf_prompts = {r["env_idx"]: list(r["prompt_ids"]) for r in rows if r["turn_idx"] == 0}
        assert [pf_prompts[k] for k in sorted(pf_prompts)] == trl["prompt_ids"]
        completions = (out / "seed-0" / "trl" / "completions.jsonl").read_text().splitlines()
        assert [json.loads(c)["task_index"] for c in completions] == [0, 0, 1, 1]
        assert trl["checkpoints"].keys() == {"1"}
        assert (Path(trl["checkpoints"]["1"]) / "config.json").is_file()
        assert lvt.evaluate_all(args, server.url) == []
    scored = {p.name: json.loads(p.read_text()) for p in (out / "seed-0" / "eval").glob("*.json")}
    assert scored.keys() == {"base-0.json", "pettingflow-1.json", "trl-1.json"}
    tasks = {tuple(r["tasks"]) for r in scored.values()}
    assert len(tasks) == 1 and len(next(iter(tasks))) == 2  # the same held-out tasks for every side
    for r in scored.values():
        assert all(len(v) == 2 for v in r["successes"].values())
    # the scripted server answers by seed, not by weights: every side sees the same episodes, so the same score
    assert len({r["success_rate"] for r in scored.values()}) == 1
    assert scored["base-0.json"]["success_rate"] > 0  # the sandbox ran the answers and passed the right ones
    full = lvt.report(args, [])
    assert full is not None and full["comparison"]["difference"]["delta"] == 0.0
    assert (out / "report.md").read_text().startswith("# Learning vs TRL")
    # resumable: a second pass finds everything done
    assert not lvt.pending_evaluations(args)
