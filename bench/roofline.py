"""The update on W-shaped rows against this machine's measured peaks, both measured in one run.

    .venv/bin/python -m bench.roofline                     # probe + 2 rounds, all cores
    .venv/bin/python -m bench.roofline --threads 1 --rounds 3

First ``pettingflow/hardware_probe.py`` measures matmul FLOP/s at SmolLM2's shapes (bf16) and memory bandwidth
with ``--threads`` threads; then the DeepSpeed update worker trains a W-shaped batch (8 groups x 4 rows, prompts of
~256 tokens shared per group, responses of 128, as W's code agent; random ids) with the same threads, and so
does a bare torch loop (``bench/update.py``'s). For each: tokens/s of the training pass, its matmul FLOP/s
(``pettingflow/roofline.py``: 6 N per token, attention scores not counted) and that as a fraction of the probe's
model-shape peak. The fraction is the number to read; the worker/bare ratio says how much of the gap is
PettingFlow's and how much is torch's on this CPU. Goal: the update at >= 0.5 of the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from bench import common
from pettingflow.hardware import cpu_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.roofline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: every allowed core)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more arm: the worker with these config overrides, comma-separated; repeat for more arms, e.g. "
        "--variant training.head_chunk_tokens=256 --variant training.micro_batch_size=8",
    )
    args = common.parse_args(parser, argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the worker's process inherits it

    import torch

    from bench.update import bare_loop, worker_update
    from pettingflow import hardware_probe
    from pettingflow.roofline import ModelShape, model_shape_peak, update_fraction

    torch.set_num_threads(threads)
    model = common.model_dir()
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    probe = hardware_probe.probe(shape, threads, progress=lambda line: print("  probe: " + line, flush=True))
    peak = model_shape_peak(shape, probe["matmul_flops"]["bf16"])
    print(f"model-shape peak, bf16, {threads} thread(s): {peak / 1e12:.3f} TFLOP/s", flush=True)

    rows_n = args.groups * args.group_size
    seq = args.prompt_len + args.response_len
    config_overrides = (
        "training.dtype=bf16",
        f"training.micro_batch_size={args.micro_batch_size}",
        "training.gradient_accumulation_steps=1",
        "training.epochs=1",
        f"training.max_seq_len={seq}",
        f"training.num_threads={threads}",
        "algorithm.use_sampler_logprobs=true",
        "algorithm.kl_coef=0.0",
    )
    config = common.code_env_config(model, *config_overrides)
    vocab = shape.vocab
    variants = {
        f"variant{k + 1}": common.code_env_config(model, *config_overrides, *spec.split(","))
        for k, spec in enumerate(args.variant)
    }
    results: list[dict[str, float]] = []
    with common.temp_dir("roofline") as tmp:
        batch = tmp / "batch-shared.parquet"
        common.write_random_batch(
            batch, rows_n, seq, args.prompt_len, vocab, group_size=args.group_size, shared_prompts=True
        )
        for r in range(args.rounds):
            res: dict[str, float] = {}

            def worker(r: int = r, res: dict[str, float] = res, name: str = "worker", cfg=config) -> None:
                m = worker_update(cfg, model, batch, tmp / f"out-{name}-{r}")
                res[f"{name}_tokens"] = float(m["computed_tokens"])  # a group's shared prompt once, then responses
                res[f"{name}_head_tokens"] = float(m["model_tokens"])
                res[f"{name}_s"] = float(m["timings"]["train_s"])

            def bare(res: dict[str, float] = res) -> None:
                res["bare_s"], trained = bare_loop(model, batch, config)
                res["bare_tokens"] = float(rows_n * seq)  # no prompt sharing: every row's every position
                res["bare_head_tokens"] = float(trained)

            def variant_arm(name: str, r: int = r, res: dict[str, float] = res) -> Callable[[], None]:
                return lambda: worker(r, res, name, variants[name])

            for arm in common.rotate(r, worker, bare, *(variant_arm(name) for name in variants)):
                arm()
            results.append(res)
            print(f"  round {r + 1}: {res}", flush=True)

    table = []
    fractions = {}
    for arm in ("worker", "bare", *variants):
        tps = common.median([x[f"{arm}_tokens"] / x[f"{arm}_s"] for x in results])
        head = common.median([x[f"{arm}_head_tokens"] / x[f"{arm}_s"] for x in results])
        achieved, fraction = update_fraction(shape, tps, peak, head)
        fractions[arm] = fraction
        table.append((arm, round(tps, 1), round(achieved / 1e12, 3), round(fraction, 3)))
    common.print_table(
        ["arm", "tokens/s (training pass)", "matmul TFLOP/s", "fraction of model-shape peak"],
        table,
        title=f"medians over {args.rounds} alternating rounds; W-shaped batch {rows_n} rows x {seq} tokens",
    )
    print(f"memory bandwidth (copy): {probe['bandwidth'] / 1e9:.1f} GB/s; machine: {cpu_model()}, {threads} thread(s)")
    print(f"update (worker) / model-shape peak: {fractions['worker']:.3f}   (goal >= 0.5)")
    print(f"bare torch loop / model-shape peak: {fractions['bare']:.3f}")
    for name, spec in zip(variants, args.variant, strict=True):
        ratio = common.median([x[f"{name}_s"] / x["worker_s"] for x in results])
        print(
            f"{name} ({spec}) / model-shape peak: {fractions[name]:.3f}; "
            f"{name} / worker training-pass time: median {ratio:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
