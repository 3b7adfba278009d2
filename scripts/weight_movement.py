"""How far training moved a run's weights from the base model, per attention projection.

Why: a LoRA pair whose roles, swapped, score the same as trained (the plan-path study's positive control) is either
not specialised or barely trained. This prints ``||dW|| / ||W||`` (mean and max over the q/k/v/o projections) for a
full fine-tune's last saved model, or for each adapter of a LoRA run (``dW = alpha / r * B @ A``), and for a LoRA
pair or a pair of full models (L3) also how far apart the two updates are (``||dW_a - dW_b|| / ||W||``: the change a
role swap makes) and the cosine of their updates.

    .venv/bin/python scripts/weight_movement.py <run_id> [--root <storage root>]

The weights are the run's last committed update per policy and the base model its config names, found the way a
resumed run finds them (``runs.lineage.weights_before``), so pruned weights fail with the same message.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pettingflow.runs.lineage import weights_before
from pettingflow.runs.run import RunRef, load_run_config
from pettingflow.storage.run_index import find_run

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _adapter_updates(folder: str) -> dict[str, torch.Tensor]:
    """Module weight name -> the adapter's update ``alpha / r * B @ A``."""
    cfg = json.loads(Path(folder, "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(Path(folder, "adapter_model.safetensors")))
    return {
        key.split("base_model.model.")[-1].replace(".lora_A.weight", ".weight"): scale
        * tensors[key.replace("lora_A", "lora_B")].float()
        @ tensors[key].float()
        for key in tensors
        if "lora_A" in key
    }


def _relative(updates: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> str:
    """``||dW|| / ||W||`` per module, as mean and max."""
    rel = [(d.norm() / base[k].float().norm()).item() for k, d in updates.items()]
    return f"mean {sum(rel) / len(rel):.2e}, max {max(rel):.2e} over {len(rel)} projections"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_id", help="a run whose last update's weights were kept (`pettingflow runs list`)")
    parser.add_argument("--root", help="its storage root (default: where this machine's run index says it is)")
    args = parser.parse_args()
    root = args.root or (find_run(args.run_id) or {}).get("root")
    if not root:
        raise SystemExit(f"run {args.run_id!r} is not in this machine's run index; pass its storage root with --root")
    ref = RunRef(root=root, run_id=args.run_id)
    config, layout = load_run_config(ref), ref.layout()
    full_updates: dict[str, dict[str, torch.Tensor]] = {}  # policy -> its update, for a pair of full models (L3)
    for policy in config.policies:
        weights = weights_before(layout, config, policy.name, len(layout.iterations()))
        base = load_file(str(Path(weights.base_dir, "model.safetensors")))
        print(f"{policy.name}: weights of {weights.source}")
        if weights.adapters:
            updates = {agent: _adapter_updates(folder) for agent, folder in weights.adapters.items()}
            for agent, upd in updates.items():
                print(f"  {agent}: ||dW||/||W|| {_relative(upd, base)}")
            if len(updates) == 2:
                _print_pair(updates, base)
        else:
            after = load_file(str(Path(weights.model_dir, "model.safetensors")))
            moved = {k: after[k].float() - w.float() for k, w in base.items() if any(p in k for p in PROJECTIONS)}
            print(f"  ||W_after - W||/||W|| {_relative(moved, base)}")
            full_updates[policy.name] = moved
    if len(full_updates) == 2:  # one full model per agent: a role swap changes the weights by their difference
        _print_pair(full_updates, base)


def _print_pair(updates: dict[str, dict[str, torch.Tensor]], base: dict[str, torch.Tensor]) -> None:
    """How far apart two updates of the same base are (what swapping them changes) and how aligned."""
    (a, da), (b, db) = updates.items()
    cos = [torch.nn.functional.cosine_similarity(da[k].flatten(), db[k].flatten(), dim=0) for k in da]
    print(
        f"  {a} - {b}: ||dW_a - dW_b||/||W|| {_relative({k: da[k] - db[k] for k in da}, base)}; "
        f"cosine of the updates, mean {sum(cos).item() / len(cos):.3f}"
    )


if __name__ == "__main__":
    main()
