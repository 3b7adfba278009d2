"""Which weights a policy has at the start of an iteration, and where they are on this machine.

The truth is in storage: the weights after iteration k are the checkpoint in the committed
``update-<policy>`` step of iteration k (attempt 0). Iteration k therefore starts from the newest
committed update before k, or from the base model. Because this is derived from committed files,
a resumed run (new process, fresh vLLM server) serves and trains from exactly the right weights.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.inference.models import resolve_model
from pettingflow.paths import home
from pettingflow.storage import RunLayout, Step
from pettingflow.storage.fs import join, uri_of
from pettingflow.storage.layout import OPTIMIZER_STEP_PREFIX, UPDATE_STEP_PREFIX
from pettingflow.storage.steps import CorruptFileError, FileEntry
from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, DEEPSPEED_SUBDIR, MODEL_SUBDIR, PolicyWeights

__all__ = [
    "PolicyWeights",
    "PrunedWeightsError",
    "base_model_dir",
    "start_version",
    "update_step_name",
    "weights_before",
    "weights_in_step",
]


def update_step_name(policy: str) -> str:
    return f"{UPDATE_STEP_PREFIX}{policy}"


def base_model_dir(config: ExperimentConfig, policy: str) -> str:
    """The local folder of the policy's base model (KL reference, tokenizer, what adapters sit on)."""
    return str(resolve_model(config.policy(policy).model))


def weights_before(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> PolicyWeights:
    """The weights ``policy`` has when iteration ``iteration`` starts, with the newest optimizer snapshot.

    The weights come from the newest committed, non-skipped update before ``iteration``. The optimizer
    snapshot (``deepspeed_dir``) is the newest one at or before those weights, in the update step itself
    (``training.optimizer_snapshot: inline``) or in the ``optimizer-<policy>`` step committed after it
    (``background``); ``optimizer_age`` counts the updates between the two (0: exact).
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
            if (snapshot := snapshot_of(layout, k, policy, step)) is not None:
                return replace(weights, deepspeed_dir=snapshot)
        else:
            age += 1
            if (snapshot := snapshot_of(layout, k, policy, step)) is not None:
                return replace(weights, deepspeed_dir=snapshot, optimizer_age=age)
    return weights or PolicyWeights(policy=policy, base_dir=base, model_dir=base)


def snapshot_of(layout: RunLayout, iteration: int, policy: str, update: Step) -> str | None:
    """The local folder of the optimizer snapshot of ``policy``'s update at ``iteration``, if one was committed:
    in the update step, or in the ``optimizer-<policy>`` step written after it in the background."""
    for step in (update, layout.step(iteration, f"{OPTIMIZER_STEP_PREFIX}{policy}")):
        if step is not update and not step.is_committed():
            continue
        if any(e.name.startswith(DEEPSPEED_SUBDIR + "/") for e in step.manifest().files):
            return str(local_copy(step) / DEEPSPEED_SUBDIR)
    return None


def start_version(layout: RunLayout, policy: str, iteration: int) -> int:
    """The version of the weights ``policy`` starts ``iteration`` from (``weights_before(...).version``), read from
    the commit markers alone: no model folder is resolved or downloaded."""
    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, update_step_name(policy))
        if step.is_committed() and not step.manifest().metadata.get("skipped"):
            return k + 1
    return 0


def weights_in_step(step: Step, policy: str, base_dir: str, version: int) -> PolicyWeights:
    """The checkpoint stored in a committed update step, as local folders; ``version``: its iteration + 1.

    Only folders the commit marker lists count (a folder an interrupted prune left behind is not a checkpoint),
    and weights removed by ``pettingflow runs prune`` raise ``PrunedWeightsError``: falling back to the base
    model would silently restart training.
    """
    manifest = step.manifest()
    gone = pruned_weights(manifest.metadata)
    if gone:
        raise PrunedWeightsError(
            f"the weights of {policy} after iteration {version - 1} ({step.uri}) were removed by `pettingflow runs "
            f"prune` ({gone}); what starts from them (resuming or re-running iteration {version}, evaluating this "
            "run at that point) needs them. Re-run a later iteration whose starting weights were kept "
            "(`pettingflow runs show <run_id>` lists them), or train again."
        )
    root = local_copy(step)
    listed = {e.name.split("/", 1)[0] for e in manifest.files}
    adapters_root = root / ADAPTERS_SUBDIR
    adapters = (
        {p.name: str(p) for p in sorted(adapters_root.iterdir()) if p.is_dir()}
        if ADAPTERS_SUBDIR in listed and adapters_root.is_dir()
        else {}
    )
    return PolicyWeights(
        policy=policy,
        base_dir=base_dir,
        model_dir=str(root / MODEL_SUBDIR) if MODEL_SUBDIR in listed else base_dir,
        adapters=adapters,
        deepspeed_dir=str(root / DEEPSPEED_SUBDIR) if DEEPSPEED_SUBDIR in listed else None,
        source=step.uri,
        version=version,
    )


class PrunedWeightsError(FileNotFoundError):
    """The weights an operation starts from were deleted by ``pettingflow runs prune``."""


def pruned_weights(metadata: dict) -> str:
    """A description of the weight folders (model, adapters) a prune removed from an update step; "" if none.
    An optimizer-only prune (``deepspeed/``) leaves the weights usable and returns ""."""
    for entry in metadata.get("pruned", []):
        hit = [p for p in entry.get("prefixes", []) if p.rstrip("/") in (MODEL_SUBDIR, ADAPTERS_SUBDIR)]
        if hit:
            return f"{', '.join(hit)} pruned {entry.get('at', '?')}"
    return ""


def cached_copy_dir(step: Step) -> Path:
    """Where ``local_copy`` keeps a downloaded copy of a remote step (pruning removes it too)."""
    return home() / "cache" / step.path.strip("/").replace("/", "__")


COMPLETE = ".complete"  # in a cached copy: the commit marker it was downloaded from


def local_copy(step: Step) -> Path:
    """A local folder holding the step's files: the step itself when storage is local, else a verified download
    under ``$PETTINGFLOW_HOME/cache`` (vLLM and transformers need local paths).

    The download goes to a temp folder beside the target and is renamed into place once every file matched its
    size and sha256, so a reader never sees a half-written checkpoint: not after a crash mid-download, and not
    while another task of the same process (rollouts collected ahead, the update) downloads the same step. A
    cached copy is used only when it was made from the marker the step has now.
    """
    if step.local_path is not None:
        return step.local_path
    manifest = step.manifest()
    expected = manifest.to_json()
    target = cached_copy_dir(step)
    if _cached(target, expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        for entry in manifest.files:
            _download(step, entry, tmp / entry.name)
        (tmp / COMPLETE).write_text(expected)
        if target.exists() and not _cached(target, expected):  # a partial copy of old code, or of another marker
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another download of the same step won the rename: use its (identical) copy
            if not _cached(target, expected):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cached(target: Path, marker_json: str) -> bool:
    done = target / COMPLETE
    return done.is_file() and done.read_text() == marker_json


def _download(step: Step, entry: FileEntry, dest: Path) -> None:
    """Stream one committed file to ``dest`` (checkpoint files can be GBs: not through memory), then check its
    size and sha256 against the marker."""
    remote = join(step.path, entry.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        step.fs.get_file(remote, str(dest))
    except FileNotFoundError as exc:
        raise CorruptFileError(f"{uri_of(step.fs, remote)} is listed in the commit marker but missing") from exc
    digest = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    size = dest.stat().st_size
    if size != entry.bytes:
        raise CorruptFileError(f"{uri_of(step.fs, remote)} has {size} bytes, the marker recorded {entry.bytes}")
    if digest.hexdigest() != entry.sha256:
        raise CorruptFileError(f"{uri_of(step.fs, remote)} does not match the sha256 in its commit marker")
