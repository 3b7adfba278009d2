"""Inference throughput: raw vLLM HTTP vs InferenceClient on the same server, and HF generate() as baseline.

    .venv/bin/python -m bench.inference               # starts its own vLLM server
    .venv/bin/python -m bench.inference --url URL     # uses a running server (not stopped)

Same prompts for every engine: 32 chat prompts of ~100 tokens, 128 new tokens each, temperature 1,
``ignore_eos`` so every request generates exactly 128 tokens. Raw requests are direct ``httpx`` POSTs with
the same JSON body the client sends (token-id prompt, ``logprobs: 1``, ``return_token_ids``), so the
server does identical work; only the client-side code differs. Raw and client rounds alternate (raw
first in even rounds, client first in odd rounds) after one warm-up round, and the table shows medians.
The server is stopped before the HF baseline so that it does not compete for the cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (as bench.common)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench import common
from pettingflow.inference.client import InferenceClient
from pettingflow.inference.models import DEFAULT_MODEL, prepare_model
from pettingflow.inference.server import ExternalServer, VLLMServer

WORDS = [
    "river",
    "mountain",
    "signal",
    "vector",
    "garden",
    "planet",
    "engine",
    "python",
    "function",
    "memory",
    "kernel",
    "token",
    "circuit",
    "harbor",
    "lantern",
    "orbit",
    "cluster",
    "matrix",
    "gradient",
    "lambda",
    "window",
    "castle",
    "bridge",
    "market",
    "winter",
    "summer",
    "protocol",
    "channel",
    "buffer",
    "socket",
    "thread",
    "process",
    "dragon",
    "forest",
    "ocean",
    "desert",
    "valley",
    "meadow",
]


@dataclass
class Result:
    name: str
    requests: int
    new_tokens: int
    wall_s: float

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s


def make_prompts(tokenizer: Any, count: int, target_len: int, seed: int = 0) -> list[list[int]]:
    """``count`` different chat prompts of about ``target_len`` tokens (content cut at the token level)."""
    rng = random.Random(seed)
    overhead = len(_chat_ids(tokenizer, ""))
    prompts = []
    for i in range(count):
        text = f"Request {i}: summarize these notes. " + " ".join(rng.choice(WORDS) for _ in range(4 * target_len))
        content_ids = tokenizer.encode(text, add_special_tokens=False)[: max(1, target_len - overhead)]
        prompts.append(_chat_ids(tokenizer, tokenizer.decode(content_ids)))
    return prompts


def _chat_ids(tokenizer: Any, content: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in out["input_ids"]]


async def raw_round(http: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]], new: int) -> Result:
    async def one(i: int, p: list[int]) -> int:
        resp = await http.post(f"{url}/v1/completions", json=common.request_body(model, p, new, seed=i))
        resp.raise_for_status()
        return len(resp.json()["choices"][0]["token_ids"])

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return Result("vLLM, raw httpx POSTs", len(prompts), sum(counts), time.perf_counter() - started)


async def client_round(client: InferenceClient, model: str, prompts: list[list[int]], new: int) -> Result:
    started = time.perf_counter()
    outs = await asyncio.gather(
        *(
            client.complete_one(p, model=model, max_tokens=new, temperature=1.0, seed=i, ignore_eos=True)
            for i, p in enumerate(prompts)
        )
    )
    return Result(
        "vLLM, InferenceClient", len(prompts), sum(len(c.token_ids) for c in outs), time.perf_counter() - started
    )


async def compare(url: str, model: str, prompts: list[list[int]], new: int, rounds: int) -> list[tuple[Result, Result]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with (
        httpx.AsyncClient(timeout=600, limits=limits) as http,
        InferenceClient(url, max_concurrency=len(prompts), timeout_s=600) as client,
    ):
        await raw_round(http, url, model, prompts, new)  # warm-up (connections, server caches)
        await client_round(client, model, prompts, new)
        pairs = []
        for r in range(rounds):
            if r % 2 == 0:
                raw = await raw_round(http, url, model, prompts, new)
                via = await client_round(client, model, prompts, new)
            else:
                via = await client_round(client, model, prompts, new)
                raw = await raw_round(http, url, model, prompts, new)
            print(f"  round {r + 1}: raw {raw.tok_s:7.1f} tok/s   client {via.tok_s:7.1f} tok/s", flush=True)
            pairs.append((raw, via))
    return pairs


def hf_generate(model_dir: Any, prompts: list[list[int]], new: int, batch: int) -> Result:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    generated = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad,
            )
        generated += (out.shape[1] - width) * len(chunk)
    return Result(f"HF generate(), bf16, batch {batch}", len(prompts), generated, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.inference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="use this running server (serving --model-name) instead of starting one")
    parser.add_argument("--model-name", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--lora", action="store_true", help="start the server with --enable-lora (slower on CPU)")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate() baseline")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from transformers import AutoTokenizer

    model_dir = prepare_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = make_prompts(tok, args.requests, args.prompt_tokens)
    mean_len = statistics.mean(len(p) for p in prompts)
    print(
        f"{args.requests} concurrent requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(mean {mean_len:.0f}), {args.new_tokens} new tokens each, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )

    if args.url:
        server: VLLMServer | ExternalServer = ExternalServer(args.url, served_model_name=args.model_name).start()
    else:
        server = VLLMServer(
            model_dir, served_model_name=args.model_name, kv_cache_gib=args.kv_cache_gib, enable_lora=args.lora
        )
        server.start()
        print(f"vLLM started in {server.startup_seconds:.0f} s (log {server.log_path})")
    try:
        pairs = asyncio.run(compare(server.url, args.model_name, prompts, args.new_tokens, args.rounds))
    finally:
        server.stop()

    raw_med = statistics.median(r.tok_s for r, _ in pairs)
    via_med = statistics.median(v.tok_s for _, v in pairs)
    ratios = [v.tok_s / r.tok_s for r, v in pairs]
    rows = [
        (
            pairs[0][0].name,
            args.requests,
            pairs[0][0].new_tokens,
            statistics.median(r.wall_s for r, _ in pairs),
            raw_med,
        ),
        (
            pairs[0][1].name,
            args.requests,
            pairs[0][1].new_tokens,
            statistics.median(v.wall_s for _, v in pairs),
            via_med,
        ),
    ]
    if not args.no_hf:
        print("HF generate() baseline (vLLM stopped) ...", flush=True)
        hf = hf_generate(model_dir, prompts, args.new_tokens, args.hf_batch)
        rows.append((hf.name, hf.requests, hf.new_tokens, hf.wall_s, hf.tok_s))

    print()
    header = f"{'engine':<34} {'requests':>8} {'new tok':>8} {'wall s':>8} {'tok/s':>8} {'vs raw':>7}"
    print(header)
    print("-" * len(header))
    for name, n, new, wall, tps in rows:
        print(f"{name:<34} {n:>8} {new:>8} {wall:>8.2f} {tps:>8.1f} {tps / raw_med:>7.2f}")
    print("-" * len(header))
    verdict = "OK" if statistics.median(ratios) >= 0.95 else "BELOW GOAL"
    print(
        f"client/raw throughput ratio: median {statistics.median(ratios):.3f} "
        f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}); goal >= 0.95: {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
