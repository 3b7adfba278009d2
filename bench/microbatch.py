"""One W-shaped micro-batch's loss + backward: shared prompts vs padded rows vs the model's own logits, and
the token log-probs' cost as gather minus a chunked logsumexp vs a full fp32 log-softmax.

    .venv/bin/python -m bench.microbatch                       # 6 rounds, 1 thread, CPU seconds
    .venv/bin/python -m bench.microbatch --threads 2 --clock wall --rounds 4

The micro-batch is what W's update trains on: 2 GRPO groups x 4 rows, prompts of 240 and 270 tokens,
responses of 100-128 tokens (random token ids, fixed seed), every response token trained, the default model
(SmolLM2-135M-Instruct) in fp32, ``micro_batch_loss`` with the old log-probs taken from the same forward (one
epoch, as on W). Arms, alternating order per round, the first round dropped as warm-up:

- ``shared``: ``training.share_prompts`` (each group's prompt once, its 4 responses on the prompt's KV cache),
  the LM head at the loss positions only (the defaults);
- ``padded``: the same rows right-padded, every row its own prompt (what a padded trainer computes);
- ``window``: shared prompts, the model's own logits over the response window
  (``training.head_at_loss_positions=false``).

Then, on the shared arm's response logits in bf16 (as a bf16 update computes them), log-probs + entropy metric,
forward and backward: ``token_logprobs_and_entropy`` (gather minus a logsumexp taken 64 rows at a time, the
entropy from the same pass) vs ``log_softmax(logits.float()).gather`` + a chunked softmax entropy (the formula
before) vs the same formula's log-probs under ``torch.compile`` (inductor; its compile falls in the dropped
warm-up round), with the bytes each saves for its backward.
``--clock cpu`` (default) reads process CPU time, which another job on the machine disturbs less than wall
time; ratios are per round, side by side.
"""

from __future__ import annotations

import argparse
import time

from bench import common


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
    parser = argparse.ArgumentParser(
        prog="python -m bench.microbatch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds; the first is warm-up and not counted")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = common.parse_args(parser, argv)

    import torch
    from transformers import AutoModelForCausalLM

    from pettingflow.configs.settings import AlgorithmSettings
    from pettingflow.training.logprobs import micro_batch_loss, response_logits, token_logprobs_and_entropy

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = AutoModelForCausalLM.from_pretrained(common.model_dir(), dtype=torch.float32)
    model.train()
    mb, algo = build_micro_batch(), AlgorithmSettings()

    arms = {"shared": (True, 0), "padded": (False, 0), "window": (True, None)}  # (share_prompts, head_chunk_tokens)

    def step(arm: str) -> tuple[float, float]:
        share, head = arms[arm]
        model.zero_grad(set_to_none=True)
        t0 = clock()
        loss, _ = micro_batch_loss(model, mb, algo, old_is_current=True, share_prompts=share, head_chunk_tokens=head)
        loss.backward()
        return clock() - t0, float(loss.detach())

    times: dict[str, list[float]] = {arm: [] for arm in arms}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for arm in common.rotate(r, *arms):
            seconds, losses[arm] = step(arm)
            if r > 0:
                times[arm].append(seconds)
            print(f"round {r + 1} {arm:7s} {seconds:6.2f} s  loss {losses[arm]:.6f}", flush=True)

    with torch.no_grad():
        logits = response_logits(model, mb, share_prompts=True).to(torch.bfloat16)
    targets = mb.targets[mb.loss_mask != 0]

    def before(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(x.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():  # the entropy metric as it was: one softmax per 64 rows
            torch.cat([torch.special.entr(torch.softmax(c.float(), -1)).sum(-1) for c in x.split(64)])
        return logp

    def before_logp(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    compiled = torch.compile(before_logp, dynamic=False)  # inductor fuses the cast, softmax and gather

    def compiled_before(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp = compiled(x, t)
        with torch.no_grad():
            torch.cat([torch.special.entr(torch.softmax(c.float(), -1)).sum(-1) for c in x.split(64)])
        return logp

    heads = {
        "gather-lse": lambda x, t: token_logprobs_and_entropy(x, t)[0],
        "fp32-log-softmax": before,
        "compiled-log-softmax": compiled_before,
    }
    head_times: dict[str, list[float]] = {name: [] for name in heads}
    saved: dict[str, int] = {}
    for r in range(args.rounds):
        for name in common.rotate(r, *heads):
            x = logits.clone().requires_grad_()
            sizes: list[int] = []

            def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
                sizes.append(t.numel() * t.element_size())
                return t

            t0 = clock()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logp = heads[name](x, targets)
            logp.sum().backward()
            saved[name] = sum(sizes)
            if r > 0:
                head_times[name].append(clock() - t0)

    rows = [[arm, len(v), common.median(v), ""] for arm, v in times.items()]
    rows += [[name, len(v), common.median(v), f"{saved[name] / 2**20:.0f}"] for name, v in head_times.items()]
    common.print_table(
        ["arm", "rounds", f"median {args.clock} s", "MiB saved for backward"],
        rows,
        title=f"one W micro-batch ({int(mb.loss_mask.sum())} model tokens)",
    )
    for a, b in (("shared", "padded"), ("shared", "window")):
        per_round = [x / y for x, y in zip(times[a], times[b], strict=True)]
        print(f"{a} / {b} time per round: {', '.join(f'{x:.3f}' for x in per_round)}")
    for other in ("fp32-log-softmax", "compiled-log-softmax"):
        head_ratio = common.median(head_times["gather-lse"]) / common.median(head_times[other])
        print(f"gather-lse / {other} (log-probs + entropy metric, forward + backward): {head_ratio:.3f}")
    same = max(losses.values()) - min(losses.values()) < 1e-4
    print(f"same loss in every arm: {same} ({', '.join(f'{k} {v:.6f}' for k, v in losses.items())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
