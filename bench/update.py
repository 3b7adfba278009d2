"""Update throughput: the DeepSpeed update worker (``run_update``) vs a bare torch loop on the same batch.

    .venv/bin/python -m bench.update                         # 8 rows x 512 tokens, default model, bf16
    .venv/bin/python -m bench.update --rows 32 --seq-len 1024 --rounds 3

Batch: N synthetic rows (random token ids) of L tokens each: a prompt of ``--prompt-len`` tokens and a
response of L - prompt tokens, every response token trained (mask 1), advantages +1/-1, sampler log-probs
used as the old log-probs (``algorithm.use_sampler_logprobs=true``, so neither arm runs an extra no-grad
pass), no KL reference. Both arms: default model in bf16, ``training.micro_batch_size`` rows per
micro-batch, one optimizer step per micro-batch (gradient accumulation 1), PPO clipped loss with token-mean,
gradient clipping at ``max_grad_norm``, AdamW at the same lr, logits only for the response positions.

- worker: ``run_update(spec)`` in its own process (ZeRO-0, 1 process, bf16). "train" tokens/s = trained
  tokens / the worker's ``train_s`` (forward, loss, backward, step of every micro-batch; excludes process
  start, imports, model load, DeepSpeed init and checkpoint save). "end to end" = trained tokens / the
  launch-to-exit ``wall_s``, which includes all of those.
- bare: the same loop in this process with plain ``torch.optim.AdamW``. By default it keeps fp32 master
  weights (grads cast to fp32, clip and AdamW on the fp32 copy, copied back into the bf16 model), as
  DeepSpeed's bf16 mode does; ``--bare-bf16-adam`` steps the bf16 parameters directly instead (less work,
  so a stricter baseline). Model load is
  excluded; the first micro-batch (first-call allocations) is timed, as it is in the worker's ``train_s``.

Rounds alternate which arm runs first. The ratio is worker train tokens/s over bare tokens/s (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench import common


def bare_loop(
    model_path: Path, batch: Path, config: Any, warmup: bool = False, fp32_master: bool = True
) -> tuple[float, int]:
    """Plain torch: forward, PPO loss, backward, clip, AdamW step per micro-batch. Returns (seconds, trained tokens).

    ``fp32_master``: keep fp32 master weights for AdamW and copy them back into the bf16 model after each step
    (what DeepSpeed's bf16 mode does); otherwise AdamW updates the bf16 parameters directly (less work).
    """
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tr, algo = config.training, config.algorithm
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, local_files_only=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params] if fp32_master else params
    opt = torch.optim.AdamW(master, lr=tr.lr, weight_decay=tr.weight_decay)
    table = pq.read_table(batch).to_pylist()
    mbs = []
    for start in range(0, len(table), tr.micro_batch_size):
        chunk = table[start : start + tr.micro_batch_size]
        p = len(chunk[0]["prompt_ids"])
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"] for r in chunk])
        old = torch.tensor([r["sampler_logprobs"] for r in chunk], dtype=torch.float32)
        adv = torch.tensor([r["advantage"] for r in chunk], dtype=torch.float32)[:, None]
        mask = torch.tensor([r["response_mask"] for r in chunk], dtype=torch.float32)
        mbs.append((ids, p, old, adv, mask))

    def step(ids: Any, p: int, old: Any, adv: Any, mask: Any) -> None:
        n_resp = ids.shape[1] - p
        logits = model(input_ids=ids, logits_to_keep=n_resp + 1).logits[:, :-1].float()  # predict response tokens
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        low, high = 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
        loss = (pg * mask).sum() / mask.sum().clamp(min=1)
        for w in params:
            w.grad = None
        loss.backward()
        if fp32_master:
            for m, w in zip(master, params, strict=True):
                m.grad = w.grad.float()
        torch.nn.utils.clip_grad_norm_(master, tr.max_grad_norm)
        opt.step()
        if fp32_master:
            with torch.no_grad():
                for m, w in zip(master, params, strict=True):
                    w.copy_(m)

    if warmup:  # first-call allocations; then restore nothing: the timed pass continues from here
        step(*mbs[0])
    with common.Timer() as t:
        for _ in range(tr.epochs):
            for mb in mbs:
                step(*mb)
    tokens = int(sum(float(mb[4].sum()) for mb in mbs)) * tr.epochs

    return t.s, tokens


def worker_update(config: Any, model: Path, batch: Path, out: Path) -> dict[str, Any]:
    """One update of ``batch`` by the DeepSpeed worker in its own process, from the base weights, no resume state
    saved; returns its metrics (``timings.train_s`` is the training pass alone)."""
    from pettingflow.training.checkpoint import PolicyWeights
    from pettingflow.training.launch import spec_from_config
    from pettingflow.training.learner import run_update

    start = PolicyWeights(policy="shared", base_dir=str(model), model_dir=str(model))
    spec = spec_from_config(config, policy="shared", batch_uri=str(batch), out_dir=str(out), start=start)
    return run_update(spec.model_copy(update={"save_resume_state": False}), timeout_s=3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.update", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument(
        "--bare-bf16-adam", action="store_true", help="bare arm: AdamW on the bf16 params (no fp32 master weights)"
    )
    args = common.parse_args(parser, argv)

    model = common.model_dir()
    config = common.code_env_config(
        model,
        "training.dtype=bf16",
        f"training.zero_stage={args.zero_stage}",
        f"training.micro_batch_size={args.micro_batch_size}",
        "training.gradient_accumulation_steps=1",
        "training.epochs=1",
        f"training.max_seq_len={max(args.seq_len, 16)}",
        "algorithm.use_sampler_logprobs=true",
        "algorithm.kl_coef=0.0",
    )
    import json

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = []
    ratios = []
    with common.temp_dir("update") as tmp:
        batch = tmp / "batch-shared.parquet"
        trained = common.write_random_batch(batch, args.rows, args.seq_len, args.prompt_len, vocab, group_size=2)
        print(
            f"batch: {args.rows} rows x {args.seq_len} tokens ({trained} trained tokens), micro-batch "
            f"{args.micro_batch_size}, ZeRO-{args.zero_stage}, bf16, "
            f"OMP_NUM_THREADS={common.os.environ['OMP_NUM_THREADS']}",
            flush=True,
        )
        for r in range(args.rounds):
            res: dict[str, Any] = {}

            def worker(r: int = r, res: dict[str, Any] = res) -> None:
                res["worker"] = worker_update(config, model, batch, tmp / f"out-{r}")

            def bare(res: dict[str, Any] = res) -> None:
                res["bare_s"], res["bare_tokens"] = bare_loop(model, batch, config, fp32_master=not args.bare_bf16_adam)

            for arm in common.alternate(r, worker, bare):
                arm()
            m = res["worker"]
            w_tps = m["model_tokens"] / m["timings"]["train_s"]
            b_tps = res["bare_tokens"] / res["bare_s"]
            ratios.append(w_tps / b_tps)
            rows.append((m, w_tps, b_tps, res["bare_s"]))
            print(
                f"  round {r + 1}: worker train {w_tps:6.1f} tok/s (train_s {m['timings']['train_s']:.1f}, wall "
                f"{m['wall_s']:.1f} s, timings {m['timings']})   bare {b_tps:6.1f} tok/s ({res['bare_s']:.1f} s)",
                flush=True,
            )

    med = common.median
    common.print_table(
        ["arm", "trained tok", "seconds", "tok/s", "vs bare"],
        [
            (
                "DeepSpeed worker, train_s",
                rows[0][0]["model_tokens"],
                med([x[0]["timings"]["train_s"] for x in rows]),
                med([x[1] for x in rows]),
                med(ratios),
            ),
            (
                "DeepSpeed worker, end to end",
                rows[0][0]["model_tokens"],
                med([x[0]["wall_s"] for x in rows]),
                med([x[0]["model_tokens"] / x[0]["wall_s"] for x in rows]),
                med([(x[0]["model_tokens"] / x[0]["wall_s"]) / x[2] for x in rows]),
            ),
            ("bare torch loop (same process)", trained, med([x[3] for x in rows]), med([x[2] for x in rows]), 1.0),
        ],
        title=f"medians over {args.rounds} alternating rounds",
    )
    t0 = rows[0][0]["timings"]
    print("worker timings of round 1 (s): " + ", ".join(f"{k} {v:.1f}" for k, v in t0.items()))
    print(common.ratio_line("worker/bare update tokens/s ratio (train_s)", ratios, 0.9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
