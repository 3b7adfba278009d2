"""A committed step as a local folder on this node: vLLM, transformers and DeepSpeed read only local paths.

Every node that needs a step's files (the flow's node for serving, a learner rank on another node for its start
weights and optimizer snapshot) calls ``local_copy``: with local storage it is the step folder itself, with remote
storage (``s3://``) a verified download into this node's ``$PETTINGFLOW_HOME/cache``. Nothing here needs a disk
shared between nodes.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from pettingflow.paths import home
from pettingflow.storage.commits import CorruptFileError, FileEntry, Step
from pettingflow.storage.fs import join, uri_of

__all__ = ["COMPLETE", "cached_copy_dir", "local_copy"]


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
