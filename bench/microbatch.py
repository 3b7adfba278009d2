"""One W-shaped micro-batch's loss + backward: shared prompts vs padded rows, and the entropy metric's cost.

    .venv/bin/python bench/microbatch.py                       # 6 rounds, 1 thread, CPU seconds
    .venv/bin/python bench/microbatch.py --threads 2 --clock wall --rounds 4

The micro-batch is what W's update trains on: 2 GRPO groups x 4 rows, prompts of 240 and 270 tokens,
responses of 100-128 tokens (random token ids, fixed seed), every response token trained, the default model
(SmolLM2-135M-Instruct) in fp32, ``micro_batch_loss`` with the old log-probs taken from the same forward (one
epoch, as on W). Arms, alternating order per round, the first round dropped as warm-up:

- ``shared``: ``training.share_prompts`` (each group's prompt once, its 4 responses on the prompt's KV cache);
- ``padded``: the same rows right-padded, every row its own prompt (what a padded trainer computes).

Then the entropy metric on the shared arm's response logits: ``entropy_metric`` (what the update uses when
``entropy_coef == 0``) vs ``entropy_from_logits`` under ``no_grad`` (what it used before).
``--clock cpu`` (default) reads process CPU time, which another job on the machine disturbs less than wall
time; ratios are per round, side by side.
"""

from __future__ import annotations

import argparse
import time

import common


def build_micro_batch(seed: int = 0):  # -> MicroBatch
    import numpy as np

    from pettingflow.training.data import Sample, collate

    rng = np.random.default_rng(seed)
    samples = []
    for prompt_len in (240, 270):
        prompt = rng.integers(100, 40_000, prompt_len)
        for _ in range(4):
            n = int(rng.integers(100, 129))
            samples.append(
                Sample(
                    row=len(samples),
                    agent_name="code_generator",
                    policy_name="shared",
                    lora_name=None,
                    prompt_ids=prompt,
                    response_ids=rng.integers(100, 40_000, n),
                    response_mask=np.ones(n, np.int8),
                    sampler_logprobs=np.full(n, -2.0, np.float32),
                    advantage=float(rng.normal()),
                )
            )
    return collate(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds; the first is warm-up and not counted")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = common.parse_args(parser, argv)

    import torch
    from transformers import AutoModelForCausalLM

    from pettingflow.configs.settings import AlgorithmSettings
    from pettingflow.rl.losses import entropy_from_logits, entropy_metric
    from pettingflow.training.logprobs import micro_batch_loss, response_logits

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = AutoModelForCausalLM.from_pretrained(common.model_dir(), dtype=torch.float32)
    model.train()
    mb, algo = build_micro_batch(), AlgorithmSettings()

    def step(share: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0 = clock()
        loss, _ = micro_batch_loss(model, mb, algo, old_is_current=True, share_prompts=share)
        loss.backward()
        return clock() - t0, float(loss.detach())

    times: dict[str, list[float]] = {"shared": [], "padded": []}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for arm in common.alternate(r, "shared", "padded"):
            seconds, losses[arm] = step(arm == "shared")
            if r > 0:
                times[arm].append(seconds)
            print(f"round {r + 1} {arm:7s} {seconds:6.2f} s  loss {losses[arm]:.6f}", flush=True)

    with torch.no_grad():
        logits = response_logits(model, mb, share_prompts=True)
    ent: dict[str, list[float]] = {"entropy_metric": [], "entropy_from_logits": []}
    for r in range(args.rounds):
        for name in common.alternate(r, "entropy_metric", "entropy_from_logits"):
            t0 = clock()
            with torch.no_grad():
                (entropy_metric if name == "entropy_metric" else entropy_from_logits)(logits)
            if r > 0:
                ent[name].append(clock() - t0)

    rows = [[arm, len(v), common.median(v)] for arm, v in times.items()]
    rows += [[name, len(v), common.median(v)] for name, v in ent.items()]
    common.print_table(["arm", "rounds", f"median {args.clock} s"], rows, title="one W micro-batch")
    shared_over_padded = [s / p for s, p in zip(times["shared"], times["padded"], strict=True)]
    print(f"shared / padded time per round: {', '.join(f'{x:.3f}' for x in shared_over_padded)}")
    ent_ratio = common.median(ent["entropy_metric"]) / common.median(ent["entropy_from_logits"])
    print(f"entropy_metric / entropy_from_logits: {ent_ratio:.3f}")
    same = abs(losses["shared"] - losses["padded"]) < 1e-4
    print(f"same loss in both arms: {same} ({losses['shared']:.6f}, {losses['padded']:.6f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
