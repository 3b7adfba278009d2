"""One GRPO iteration: PettingFlow (train flow, vLLM + DeepSpeed) vs TRL's GRPOTrainer (HF generate), CPU.

    .venv/bin/python bench/iteration_vs_trl.py               # 4 tasks x G=2, 1 round each; ~6-8 min on 2 cores
    .venv/bin/python bench/iteration_vs_trl.py --tasks 8 --rounds 2

Both sides: the default model (SmolLM2-135M-Instruct, bf16), the same HumanEval prompts, group size G,
temperature 1, ``max_new_tokens`` = the code generator's ``max_tokens``, lr 1e-5, no KL (beta 0), clip
0.2/0.28, token-level loss, one iteration.

- PettingFlow: the real ``train`` flow (one iteration, Prefect temporary server whose start is not counted)
  against a vLLM server started before the timing (its start-up is reported separately, not counted: a run
  keeps it up across iterations). Counted: collect rollouts (the shipped two-agent, two-turn code env: the
  code generator and then the test generator, code run in the bubblewrap sandbox), filter, advantages,
  the DeepSpeed update job (own process: start, model load, micro-batches of 2 with one optimizer step
  each, checkpoint save), weight sync into vLLM (reload) and the report. Validation is off
  (``validation.frequency=0``).
- TRL 1.16.0 ``GRPOTrainer``: the same prompts (the code generator's first-turn prompts, already
  chat-templated, taken from PettingFlow's stored rollouts), ``use_vllm=False`` so it generates with HF
  ``generate()`` in the training process, one completion per sample (single turn, one agent), a cheap reward
  function (no code execution: this favours TRL), ``max_steps=1``: one optimizer step over the whole batch.
  "TRL total" counts trainer construction (model load) + ``train()``; ``train()`` alone is shown too.

The work differs (PettingFlow generates two agents' turns and runs the code), so the table shows the generated
tokens of each side and seconds per 1k generated tokens besides the wall-time ratio. The vLLM server stays up
(idle) while TRL runs; rounds alternate which side goes first.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

import common

STATE = common.temp_prefect_state("trl")  # Prefect's database and our state: temp only


def pettingflow_iteration(root: Path, model: Path, url: str, args: Any) -> dict[str, Any]:
    from pettingflow.flows.train import train
    from pettingflow.storage import RunLayout, read_step_trajectories

    overrides = [
        f"run.storage_root={root}",
        "run.iterations=1",
        f"policies.0.model={model}",
        f"inference.url={url}",
        "rollout.use_ray=false",
        f"env.tasks_per_iteration={args.tasks}",
        f"env.group_size={args.group_size}",
        f"agents.0.sampling.max_tokens={args.max_new_tokens}",
        "validation.frequency=0",
        "training.zero_stage=0",
        "training.lr=1e-5",
        "algorithm.kl_coef=0.0",
        *args.overrides,
    ]
    with common.Timer() as t:
        state = train("code-env", overrides, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"train flow failed: {state}")
    run_id = state.result()["run_id"]
    layout = RunLayout(str(root), run_id)
    metrics = layout.step(0, "report").read_json("metrics.json")
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    prompts: dict[int, str] = {}
    for r in rows:
        if r["agent_idx"] == 0 and r["turn_idx"] == 0:
            prompts.setdefault(r["env_idx"], r["prompt_text"])
    return {
        "wall": t.s,
        "tokens": int(metrics.get("rollout/tokens_generated", 0)),
        "trained": int(metrics.get("update/shared/model_tokens", 0)),
        "durations": {k[9:]: v for k, v in metrics.items() if k.startswith("duration/")},
        "prompts": [prompts[k] for k in sorted(prompts)],
    }


def trl_iteration(model: Path, prompts: list[str], args: Any, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], **_: Any) -> list[float]:  # cheap: no code execution
        return [1.0 if "def " in c and "return" in c else 0.0 for c in completions]

    n = len(prompts) * args.group_size
    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "bfloat16"},
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        max_steps=1,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=False,
        dataloader_num_workers=0,
        seed=0,
    )
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    with common.Timer() as build:
        trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config, train_dataset=dataset)
    with common.Timer() as run:
        trainer.train()
    gen_tokens = None
    for entry in trainer.state.log_history:
        for key in ("num_tokens", "completions/mean_length"):
            if key == "completions/mean_length" and key in entry:
                gen_tokens = int(entry[key] * n)
    del trainer
    return {"build": build.s, "train": run.s, "wall": build.s + run.s, "tokens": gen_tokens or n * args.max_new_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--url", help="attach to a running vLLM server (serving the default model, dev mode)")
    parser.add_argument("overrides", nargs="*", help="extra PettingFlow config overrides")
    args = common.parse_args(parser, argv, wait=False)  # waits below, after checking that TRL imports
    try:
        import trl

        trl_error = (
            None if trl.__version__ == "1.16.0" else f"trl {trl.__version__} installed, the bench targets 1.16.0"
        )
    except Exception as exc:
        trl_error = f"TRL cannot be imported ({type(exc).__name__}: {exc}); install it with pip install trl==1.16.0"
    if trl_error:
        print(f"NOTE: {trl_error}", flush=True)
    if not args.no_wait:
        common.wait_for_quiet()

    from prefect.testing.utilities import prefect_test_harness

    model = common.model_dir()
    pf_rows: list[dict[str, Any]] = []
    trl_rows: list[dict[str, Any]] = []
    trl_failure = None
    with (
        common.temp_dir("iteration-vs-trl") as root,
        common.vllm_server(model, common.DEFAULT_MODEL, url=args.url, dev_mode=True) as server,
        prefect_test_harness(server_startup_timeout=180),
    ):
        startup = getattr(server, "startup_seconds", None)
        for r in range(args.rounds):

            def pf(r: int = r) -> None:
                pf_rows.append(pettingflow_iteration(root / f"pf-{r}", model, server.url, args))
                x = pf_rows[-1]
                print(
                    f"  PettingFlow round {r + 1}: {x['wall']:.1f} s, {x['tokens']} generated tokens, "
                    f"{x['trained']} trained tokens; steps (s): "
                    + ", ".join(f"{k} {v:.1f}" for k, v in x["durations"].items()),
                    flush=True,
                )

            def tr(r: int = r) -> None:
                nonlocal trl_failure
                if trl_error or trl_failure:
                    return
                prompts = pf_rows[0]["prompts"]
                try:
                    trl_rows.append(trl_iteration(model, prompts, args, root / f"trl-{r}"))
                except Exception as exc:
                    trl_failure = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    return
                x = trl_rows[-1]
                print(
                    f"  TRL round {r + 1}: construct {x['build']:.1f} s + train {x['train']:.1f} s, "
                    f"~{x['tokens']} generated tokens",
                    flush=True,
                )

            arms = [pf, tr] if (r % 2 == 0 or not pf_rows) else [tr, pf]  # TRL needs PettingFlow's prompts first
            for arm in arms:
                arm()

    med = common.median
    pf_wall = med([x["wall"] for x in pf_rows])
    pf_tok = med([x["tokens"] for x in pf_rows])
    table = [
        (
            "PettingFlow iteration (vLLM + DeepSpeed)",
            pf_wall,
            pf_tok,
            1000 * pf_wall / pf_tok if pf_tok else float("nan"),
            1.0,
        )
    ]
    if trl_rows:
        t_wall = med([x["wall"] for x in trl_rows])
        t_tok = med([x["tokens"] for x in trl_rows])
        t_train = med([x["train"] for x in trl_rows])
        table += [
            ("TRL GRPOTrainer, construct + train()", t_wall, t_tok, 1000 * t_wall / t_tok, t_wall / pf_wall),
            ("TRL GRPOTrainer, train() only", t_train, t_tok, 1000 * t_train / t_tok, t_train / pf_wall),
        ]
    common.print_table(
        ["side", "wall s", "gen tokens", "s / 1k tok", "vs PF"],
        table,
        title=f"{args.tasks} prompts x G={args.group_size}, max_new_tokens {args.max_new_tokens}; medians over "
        f"{args.rounds} round(s)",
    )
    if startup:
        print(f"vLLM server start-up (not counted above, paid once per run): {startup:.0f} s")
    if trl_rows:
        print(
            f"TRL wall / PettingFlow wall: {table[1][1] / pf_wall:.2f} (construct + train), "
            f"{table[2][1] / pf_wall:.2f} (train only); per 1k generated tokens: "
            f"{table[1][3] / table[0][3]:.2f} / {table[2][3] / table[0][3]:.2f}"
        )
    else:
        print(f"TRL not measured: {trl_error or trl_failure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
