"""Which weights a policy has at the start of an iteration, and where they are on this machine.

The truth is in storage: the weights after iteration k are the checkpoint in the committed
``update-<policy>`` step of iteration k (attempt 0). Iteration k therefore starts from the newest
committed update before k, or from the base model. Because this is derived from committed files,
a resumed run (new process, fresh vLLM server) serves and trains from exactly the right weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.inference.models import resolve_model
from pettingflow.paths import home
from pettingflow.storage import RunLayout, Step

MODEL_SUBDIR = "model"
ADAPTERS_SUBDIR = "adapters"
DEEPSPEED_SUBDIR = "deepspeed"


@dataclass(frozen=True)
class PolicyWeights:
    """A policy's weights as local folders."""

    policy: str
    base_dir: str  # the base model: reference for KL, tokenizer, what LoRA adapters sit on
    model_dir: str  # full weights to serve and to train from (== base_dir for LoRA or before any update)
    adapters: dict[str, str] = field(default_factory=dict)  # agent -> adapter folder (LoRA, after an update)
    deepspeed_dir: str | None = None  # optimizer state to resume from
    source: str = "base"  # "base" or the URI of the update step they come from


def update_step_name(policy: str) -> str:
    return f"update-{policy}"


def base_model_dir(config: ExperimentConfig, policy: str) -> str:
    """The local folder of the policy's base model (KL reference, tokenizer, what adapters sit on)."""
    return str(resolve_model(config.policy(policy).model))


def weights_before(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> PolicyWeights:
    """The weights ``policy`` has when iteration ``iteration`` starts."""
    base = base_model_dir(config, policy)
    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, update_step_name(policy))
        if step.is_committed() and not step.manifest().metadata.get("skipped"):
            return weights_in_step(step, policy, base)
    return PolicyWeights(policy=policy, base_dir=base, model_dir=base)


def weights_in_step(step: Step, policy: str, base_dir: str) -> PolicyWeights:
    """The checkpoint stored in a committed update step, as local folders."""
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
