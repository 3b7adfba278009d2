"""Measure the log-prob noise floors that ``tests/test_inference_vllm.py`` derives its tolerances from.

Why: a tolerance is only as tight as the claim it makes when it sits a small multiple above the noise the
comparison has with no bug in it. bf16 rounding is that noise; this script measures it in transformers alone
(no server needed), on the test's prompts:

- the default model in bf16 against the same model in fp32, on sampled tokens (the floor of vLLM vs transformers);
- a random PEFT adapter (the test's recipe) against its merged weights, both bf16, on the adapter's greedy tokens
  (the floor of LoRA-served vs merged-served), and the same adapter at 1.5x its scale (the planted error).

Run: ``.venv/bin/python tests/logprob_noise_floor.py MODEL_DIR`` (the prepared default model, e.g.
``~/.cache/pettingflow/models/smollm2-135m-instruct``). Results and the tolerances taken: docs/testing.md.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTIONS = [  # tests/test_inference_vllm.QUESTIONS
    "What is 2+2?",
    "Write a Python function that adds two numbers.",
    "Name three colors.",
    "Tell me a short story about a dragon.",
]


def token_logprobs(model, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the last ``n`` tokens of ``ids`` and the best log-prob at each of those positions."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    rows = logp[len(ids) - n - 1 : -1]
    return rows.gather(-1, torch.tensor(ids[-n:])[:, None])[:, 0], rows.max(-1).values


def continuations(model, prompts: list[list[int]], **generate) -> list[tuple[list[int], int]]:
    out = []
    for p in prompts:
        ids = model.generate(input_ids=torch.tensor([p]), **generate)[0].tolist()
        out.append((ids, len(ids) - len(p)))
    return out


def stats(diffs: list[float]) -> str:
    return f"max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} over {len(diffs)} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    model_dir = parser.parse_args().model_dir
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    torch.manual_seed(7)
    sampled = continuations(fp32, prompts, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=48)
    diffs = []
    for ids, n in sampled:
        diffs += (token_logprobs(bf16, ids, n)[0] - token_logprobs(fp32, ids, n)[0]).abs().tolist()
    print(f"bf16 vs fp32, base model, sampled tokens: {stats(diffs)}")

    torch.manual_seed(0)  # tests/test_inference_vllm._random_lora, std 0.1
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    adapter = get_peft_model(bf16, config)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    adapter.eval()
    greedy = continuations(adapter, prompts, do_sample=False, max_new_tokens=24)
    scaled = copy.deepcopy(adapter)
    for module in scaled.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {k: v * 1.5 for k, v in module.scaling.items()}
    served = [token_logprobs(adapter, ids, n)[0] for ids, n in greedy]
    planted = [token_logprobs(scaled, ids, n)[0] for ids, n in greedy]
    merged = adapter.merge_and_unload()
    lora, wrong, gaps = [], [], []
    for (ids, n), lp, lp_scaled in zip(greedy, served, planted, strict=True):
        ref, best = token_logprobs(merged, ids, n)
        lora += (lp - ref).abs().tolist()
        wrong += (lp_scaled - ref).abs().tolist()
        gaps += (best - ref).tolist()
    print(f"adapter vs merged (bf16), greedy tokens: {stats(lora)}; merged argmax gap max {max(gaps):.4f}")
    print(f"planted: adapter at 1.5x its scale vs merged: {stats(wrong)}")


if __name__ == "__main__":
    main()
