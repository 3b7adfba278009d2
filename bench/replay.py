"""Exact replay on the default model: does a re-run's update equal the resident original's, and what does the
optimizer snapshot that makes it possible cost on disk?

    .venv/bin/python -m bench.replay                    # SmolLM2-135M, the code-env training settings
    .venv/bin/python -m bench.replay --rows 8 --seq-len 256 --threads 2

In this process, as the flow does it: a resident ``UpdateWorker`` makes update 0 (base weights), writes its
optimizer snapshot afterwards (``training.optimizer_snapshot: background``) and makes update 1 in memory (the
original). Then fresh workers make update 1 again from update 0's ``model/`` and:

- ``control``: the snapshot, the original's thread count (what a control re-run does now);
- ``threads``: the snapshot, another thread count;
- ``reset``: no snapshot (Adam restarts from the bf16 ``model/`` weights: what a re-run without one does);
- ``lr``: the snapshot, ``training.lr`` 1e-6 instead of the config's (an override's effect, for scale);
- ``control_process``, ``threads_process``: ``control`` and ``threads`` in a new process (``run_update``), as a
  re-run without servers makes its update.

Each is compared with the original: bitwise equal or not, and ``|w - w_orig| / |w_orig - w_start|`` over all
weights (how far apart, as a fraction of how far update 1 moved them). Prints one JSON object, with the bytes of
the snapshot (``deepspeed/``) and of ``model/``. Synthetic rows (random tokens, +-1 advantages), as bench.update.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from bench import common


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def weights(metrics: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(metrics["outputs"]["model"]) / "model.safetensors"))


def compare(got: dict[str, Any], want: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """Bitwise equality and the distance relative to the update's size (``tests/test_learner.update_distance``)."""
    import torch

    apart = math.sqrt(sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want))
    moved = math.sqrt(sum(float((want[k].double() - start[k].double()).pow(2).sum()) for k in want))
    return {"bitwise": all(torch.equal(got[k], want[k]) for k in want), "relative_distance": apart / moved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="the original's torch threads")
    args = common.parse_args(parser, argv)

    from pettingflow.training.checkpoint import BASE_WEIGHTS, DEEPSPEED_SUBDIR, PolicyWeights
    from pettingflow.training.launch import spec_from_config
    from pettingflow.training.learner import run_update
    from pettingflow.training.worker import UpdateWorker, ensure_dist_env

    ensure_dist_env()
    model = common.model_dir()
    config = common.code_env_config(model, f"training.max_seq_len={args.seq_len}")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out: dict[str, Any] = {"rows": args.rows, "seq_len": args.seq_len, "threads": args.threads}
    with common.temp_dir("replay") as tmp:
        batches = [tmp / f"batch-{k}.parquet" for k in (0, 1)]
        for k, path in enumerate(batches):
            common.write_random_batch(path, args.rows, args.seq_len, args.prompt_len, vocab, group_size=2, seed=k)

        def spec(k: int, name: str, start: PolicyWeights, threads: int, **training: Any) -> Any:
            s = spec_from_config(
                config,
                policy="shared",
                batch_uri=str(batches[k]),
                out_dir=str(tmp / name),
                start=start,
                iteration=k,
                weights_uri=f"v{k}",
                save_optimizer=False,
                num_threads=threads,
            )
            return s.model_copy(update={"training": s.training.model_copy(update=training)}) if training else s

        base = PolicyWeights(policy="shared", base_dir=str(model), model_dir=str(model), source=BASE_WEIGHTS)
        resident = UpdateWorker()
        try:
            m0 = resident.update(spec(0, "u0", base, args.threads))
            snap = tmp / "snapshot"
            resident.save_optimizer_snapshot(str(snap), "v0")
            original = resident.update(spec(1, "u1", base, args.threads).model_copy(update={"start_weights": "v0"}))
        finally:
            resident.cleanup()
        out["snapshot_bytes"] = folder_bytes(snap / DEEPSPEED_SUBDIR)
        out["model_bytes"] = folder_bytes(Path(m0["outputs"]["model"]))
        keys = ("optimizer_state", "loss", "grad_norm", "sampler_logprob_abs_diff", "master_weights")
        out["original"] = {k: original.get(k) for k in keys}
        after0 = PolicyWeights(
            policy="shared", base_dir=str(model), model_dir=m0["outputs"]["model"], source="v0", version=1
        )
        restored = dataclasses.replace(after0, deepspeed_dir=str(snap / DEEPSPEED_SUBDIR))
        want, start = weights(original), weights(m0)
        other = 1 if args.threads != 1 else 2
        cases = {
            "control": spec(1, "control", restored, args.threads),
            "threads": spec(1, "threads", restored, other),
            "reset": spec(1, "reset", after0, args.threads),
            "lr": spec(1, "lr", restored, args.threads, lr=1e-6),
        }
        # the same two in a new process, as a re-run without servers runs its update (``run_update``)
        cases["control_process"] = spec(1, "control_process", restored, args.threads)
        cases["threads_process"] = spec(1, "threads_process", restored, other)
        for name, s in cases.items():
            if name.endswith("_process"):
                m = run_update(s, timeout_s=1800)
            else:
                worker = UpdateWorker()
                try:
                    m = worker.update(s)
                finally:
                    worker.cleanup()
            out[name] = {
                "threads": m["torch_threads"],
                "optimizer_state": m["optimizer_state"],
                "loss": m["loss"],
                "grad_norm": m["grad_norm"],
                # over the windows after the first, taken from the starting weights before any step
                "sampler_logprob_abs_diff": m.get("sampler_logprob_abs_diff"),
                **compare(weights(m), want, start),
            }
            print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
