"""Which weights a policy has at the start of an iteration, and where they are on this machine.

The truth is in storage: the weights after iteration k are the checkpoint in the committed
``update-<policy>`` step of iteration k (attempt 0). Iteration k therefore starts from the newest
committed update before k, or from the base model. Because this is derived from committed files,
a resumed run (new process, fresh vLLM server) serves and trains from exactly the right weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.inference.models import resolve_model
from pettingflow.paths import home
from pettingflow.storage import RunLayout, Step
from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, DEEPSPEED_SUBDIR, MODEL_SUBDIR, PolicyWeights

__all__ = ["PolicyWeights", "base_model_dir", "update_step_name", "weights_before", "weights_in_step"]


def update_step_name(policy: str) -> str:
    return f"update-{policy}"


def base_model_dir(config: ExperimentConfig, policy: str) -> str:
    """The local folder of the policy's base model (KL reference, tokenizer, what adapters sit on)."""
    return str(resolve_model(config.policy(policy).model))


def weights_before(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> PolicyWeights:
    """The weights ``policy`` has when iteration ``iteration`` starts, with the newest optimizer snapshot.

    The weights come from the newest committed, non-skipped update before ``iteration``. The optimizer
    snapshot (``deepspeed_dir``) is the newest one at or before those weights; ``optimizer_age`` counts the
    updates between the two (0: exact).
    """
    base = base_model_dir(config, policy)
    weights: PolicyWeights | None = None
    age = 0
    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, update_step_name(policy))
        if not step.is_committed() or step.manifest().metadata.get("skipped"):
            continue
        if weights is None:
            weights = weights_in_step(step, policy, base, version=k + 1)
            if weights.deepspeed_dir is not None:
                return weights
        else:
            age += 1
            if any(e.name.startswith(DEEPSPEED_SUBDIR + "/") for e in step.manifest().files):
                snapshot = weights_in_step(step, policy, base, version=k + 1).deepspeed_dir
                return replace(weights, deepspeed_dir=snapshot, optimizer_age=age)
    return weights or PolicyWeights(policy=policy, base_dir=base, model_dir=base)


def weights_in_step(step: Step, policy: str, base_dir: str, version: int) -> PolicyWeights:
    """The checkpoint stored in a committed update step, as local folders; ``version``: its iteration + 1."""
    root = local_copy(step)
    model = root / MODEL_SUBDIR
    adapters_root = root / ADAPTERS_SUBDIR
    adapters = {p.name: str(p) for p in sorted(adapters_root.iterdir()) if p.is_dir()} if adapters_root.is_dir() else {}
    ds = root / DEEPSPEED_SUBDIR
    return PolicyWeights(
        policy=policy,
        base_dir=base_dir,
        model_dir=str(model) if model.is_dir() else base_dir,
        adapters=adapters,
        deepspeed_dir=str(ds) if ds.is_dir() else None,
        source=step.uri,
        version=version,
    )


def local_copy(step: Step) -> Path:
    """A local folder holding the step's files: the step itself when storage is local, else a
    verified download under ``$PETTINGFLOW_HOME/cache`` (vLLM and transformers need local paths)."""
    if step.local_path is not None:
        return step.local_path
    manifest = step.manifest()
    target = home() / "cache" / step.path.strip("/").replace("/", "__")
    done = target / ".complete"
    if done.exists():
        return target
    for entry in manifest.files:
        dest = target / entry.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(step.read_bytes(entry.name))  # checks size and sha256
    done.write_text(manifest.to_json())
    return target
