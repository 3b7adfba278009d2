"""How far training moved a run's weights from the base model, per attention projection.

Why: a LoRA pair whose roles, swapped, score the same as trained (the plan-path study's positive control) is either
not specialised or barely trained. This prints ``||dW|| / ||W||`` (mean and max over the q/k/v/o projections) for a
full fine-tune's last saved model, or for each adapter of a LoRA run (``dW = alpha / r * B @ A``), and for a LoRA
pair also how far apart the two adapters are (``||dW_a - dW_b|| / ||W||``: the change a role swap makes) and the
cosine of their updates.

    .venv/bin/python scripts/weight_movement.py outputs/runs/<run>        # the base model from the cache
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _by_iteration(run: str, pattern: str) -> list[str]:
    """Files matching ``pattern`` in a run's iteration folders, oldest iteration first."""
    return sorted(glob.glob(f"{run}/iter-*/{pattern}"), key=lambda p: int(p.split("/iter-")[1].split("/")[0]))


def _adapter_updates(folder: str) -> dict[str, torch.Tensor]:
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


def _summary(rel: list[float]) -> str:
    return f"mean {sum(rel) / len(rel):.2e}, max {max(rel):.2e} over {len(rel)} projections"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (outputs/runs/<run>) with its last update's weights kept")
    parser.add_argument("--base", default=str(Path.home() / ".cache/pettingflow/models/smollm2-135m-instruct"))
    args = parser.parse_args()
    base = load_file(str(Path(args.base, "model.safetensors")))
    adapters = _by_iteration(args.run, "update-*/adapters/*/adapter_model.safetensors")
    if adapters:
        last_iter = adapters[-1].split("/update-")[0]
        folders = sorted({str(Path(p).parent) for p in adapters if p.startswith(last_iter + "/")})
        updates = {Path(f).name: _adapter_updates(f) for f in folders}
        for name, upd in updates.items():
            print(
                f"{name}: ||dW||/||W|| {_summary([(d.norm() / base[k].float().norm()).item() for k, d in upd.items()])}"
            )
        if len(updates) == 2:
            (a, da), (b, db) = updates.items()
            apart = [((da[k] - db[k]).norm() / base[k].float().norm()).item() for k in da]
            cos = [torch.nn.functional.cosine_similarity(da[k].flatten(), db[k].flatten(), dim=0).item() for k in da]
            mean_cos = sum(cos) / len(cos)
            print(f"{a} - {b}: ||dW_a - dW_b||/||W|| {_summary(apart)}; cosine of the updates, mean {mean_cos:.3f}")
        return
    models = _by_iteration(args.run, "update-*/model/model.safetensors")
    if not models:
        raise SystemExit(f"no saved adapters or model under {args.run}/iter-*/update-*/; was it pruned to nothing?")
    after = load_file(models[-1])
    rel = [
        ((after[k].float() - w.float()).norm() / w.float().norm()).item()
        for k, w in base.items()
        if k in after and any(p in k for p in PROJECTIONS)
    ]
    print(f"{models[-1]}: ||W_after - W||/||W|| {_summary(rel)}")


if __name__ == "__main__":
    main()
