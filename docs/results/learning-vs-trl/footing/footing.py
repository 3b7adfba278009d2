# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: why TRL's iteration-0 train reward differs from PettingFlow's (issue 48 footing check)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, "/work/main")

from bench import learning_vs_trl as lvt
from bench.common import model_dir

OUT = Path("/tmp/lvt-footing")


def setup(tasks_n: int) -> tuple[Any, ...]:
    from transformers import AutoTokenizer

    from pettingflow.agents.base import build_agent
    from pettingflow.configs.loader import load_config
    from pettingflow.envs.registry import EnvCache, env_spec_from_settings
    from pettingflow.steps.rollouts import select_train_tasks

    args = lvt.parser().parse_args(["--out", "/tmp/x", "--iterations", "2", "--tasks", str(tasks_n)])
    args.dtype = "bf16"
    config = load_config(lvt.CONFIG, lvt.shared_overrides(args, 0))
    model = model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    factory = EnvCache().get(env_spec_from_settings(config.env))
    agent_settings = config.agents[0]

    def agent() -> Any:
        return build_agent(agent_settings, agent_idx=0, tokenizer=tok, layout=config.env.sample_layout)

    tasks = select_train_tasks(config, 0)
    prompt_ids = [agent().update_from_env(0, factory.create(t, seed=0)).token_ids for t in tasks]

    async def score(texts: list[str], task_index: list[int]) -> list[float]:
        async def one(i: int, text: str, index: int) -> float:
            env = factory.create(tasks[index], env_idx=index, rollout_idx=i, seed=0)
            a = agent()
            a.update_from_env(0, env)
            a.update_from_model(0, env, text)
            await a.step(env)
            return float(a.agent_reward or 0.0)

        return list(await asyncio.gather(*(one(i, t, x) for i, (t, x) in enumerate(zip(texts, task_index)))))

    return config, model, tok, tasks, prompt_ids, score


def summarize(name: str, rows: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    from collections import defaultdict

    import numpy as np

    by: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by[r["task_index"]].append(r["reward"])
    per_task = np.array([np.mean(by[k]) for k in sorted(by)])
    rng = np.random.default_rng(0)
    boots = per_task[rng.integers(0, len(per_task), size=(5000, len(per_task)))].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    solved = np.mean([r["reward"] >= 1.0 for r in rows])
    lens = [r["n_tokens"] for r in rows]
    eos = np.mean([r["eos"] for r in rows])
    out = {
        "name": name,
        "reward_mean": float(np.mean([r["reward"] for r in rows])),
        "ci95_tasks": [float(lo), float(hi)],
        "solved": float(solved),
        "per_task": [float(x) for x in per_task],
        "mean_tokens": float(np.mean(lens)),
        "ended_eos": float(eos),
        **extra,
    }
    print(json.dumps(out), flush=True)
    (OUT / f"{name}.json").write_text(json.dumps({"summary": out, "rows": rows}, indent=1))


def hf(mode: str, samples: int, tasks_n: int, threads: int) -> None:
    """TRL's real training loop for one optimizer step (lr 0): its first generation batch is every task x
    ``samples`` completions, generated and scored exactly as in the study (modes: trl = bf16 autocast as the
    pilot, fp32 = bf16 off)."""
    import torch

    torch.set_num_threads(threads)
    config, model, tok, tasks, prompt_ids, score = setup(tasks_n)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [tok.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
    s = config.agents[0].sampling
    cfg = GRPOConfig(
        output_dir=str(OUT / "trainer"),
        use_cpu=True,
        bf16=mode != "fp32",
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=samples,
        steps_per_generation=tasks_n,
        num_generations=samples,
        shuffle_dataset=False,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        learning_rate=0.0,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=False,
        seed=0,
        disable_tqdm=True,
    )
    rows: list[dict[str, Any]] = []
    trainer_box: list[Any] = []

    def reward(completions: list[Any], completion_ids: list[list[int]], task_index: list[int], **_: Any) -> list[float]:
        trainer = trainer_box[0]
        print("model.forward:", trainer.model_wrapped.forward, flush=True)
        values = asyncio.run(score(list(completions), list(task_index)))
        for c, t, r, ti in zip(completion_ids, completions, values, task_index):
            rows.append(
                {
                    "task_index": ti,
                    "reward": r,
                    "text": t,
                    "n_tokens": len(c),
                    "eos": bool(c and c[-1] in trainer.eos_token_ids),
                }
            )
        return values

    ds = Dataset.from_list([{"prompt": p, "task_index": i} for i, p in enumerate(prompts)])
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=cfg, train_dataset=ds)
    trainer_box.append(trainer)
    trl_ids, _, _ = trainer._tokenize_prompts(prompts)
    print("trl prompt ids == agent ids:", [list(a) == list(b) for a, b in zip(trl_ids, prompt_ids)], flush=True)
    print("trl generation_config:", trainer.generation_config.to_diff_dict(), flush=True)
    print("model.generation_config:", trainer.model.generation_config.to_diff_dict(), flush=True)
    print("eos ids", trainer.eos_token_ids, "pad", tok.pad_token_id, tok.padding_side, flush=True)
    t0 = time.time()
    trainer.train()
    summarize(f"hf-{mode}", rows, {"wall_s": time.time() - t0, "samples": samples, "tasks": tasks_n})


def vllm(url: str, samples: int, tasks_n: int) -> None:
    config, model, tok, tasks, prompt_ids, score = setup(tasks_n)
    from pettingflow.inference.client import InferenceClient

    s = config.agents[0].sampling
    params = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_tokens": s.max_tokens,
        "stop": list(s.stop) or None,
    }
    print("pf sampling params:", params, flush=True)

    async def go() -> list[dict[str, Any]]:
        client = InferenceClient(url)
        rows = []
        t0 = time.time()

        async def one(ti: int, k: int) -> Any:
            return ti, await client.complete_one(
                prompt_ids[ti], model="smollm2-135m-instruct", seed=1000 * ti + k, **params
            )

        results = await asyncio.gather(*(one(ti, k) for ti in range(len(prompt_ids)) for k in range(samples)))
        texts = [c.text for _, c in results]
        rewards = await score(texts, [ti for ti, _ in results])
        for (ti, c), r in zip(results, rewards):
            rows.append(
                {
                    "task_index": ti,
                    "reward": r,
                    "text": c.text,
                    "n_tokens": len(c.token_ids),
                    "eos": c.finish_reason == "stop",
                }
            )
        print(f"vllm {time.time() - t0:.0f} s", flush=True)
        return rows

    rows = asyncio.run(go())
    summarize("vllm", rows, {"samples": samples, "tasks": tasks_n})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["hf", "vllm"])
    p.add_argument("--mode", default="trl")
    p.add_argument("--url")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.side == "hf":
        hf(a.mode, a.samples, a.tasks, a.threads)
    else:
        vllm(a.url, a.samples, a.tasks)
