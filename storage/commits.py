"""Committed steps and their markers: how an iteration's outputs become visible, exactly once.

A *step* is a folder (``.../iter-<k>/<step>/``) of immutable files. It becomes visible when its
marker ``_COMMITTED.json`` exists; the marker is written last and lists every file with its row
count, byte size and sha256. Consequences:

- a crash before the marker leaves the step invisible; the next attempt clears the leftovers and
  writes again, so rows are never duplicated;
- readers read only files named in the marker, and check size (and sha256 when asked) so a
  truncated or swapped file is an error naming its path, never silently fewer rows;
- committing a committed step is a no-op that returns the existing manifest (idempotent).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pettingflow.faults import maybe_crash
from pettingflow.storage.fs import filesystem, is_local, join, uri_of, write_bytes_atomic
from pettingflow.storage.schema import READABLE_VERSIONS, SCHEMA_VERSION, schema_version_of, upgrade_table

MARKER = "_COMMITTED.json"
DEFAULT_ROW_GROUP_SIZE = 1024  # trajectory rows are KBs each: ~MB-sized row groups


class StepNotCommittedError(FileNotFoundError):
    """The step has no commit marker: it is in flight, crashed, or was never written."""


class StepAlreadyCommittedError(RuntimeError):
    """Writing into a committed step would change data readers already rely on."""


class CorruptFileError(OSError):
    """A committed file is missing, truncated or does not match its recorded checksum."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a committed step."""

    name: str
    bytes: int
    sha256: str
    rows: int | None = None


@dataclass(frozen=True)
class Manifest:
    """What a commit marker holds."""

    step: str
    files: list[FileEntry]
    committed_at: float
    schema_version: str = SCHEMA_VERSION
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(f.rows or 0 for f in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        raw["files"] = [FileEntry(**f) for f in raw["files"]]
        return cls(**raw)


class Step:
    """A step folder on any fsspec filesystem; see the module docstring for the protocol."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, name: str | None = None):
        self.fs = fs
        self.path = path.rstrip("/")
        self.name = name or self.path.rsplit("/", 1)[-1]
        self._pending: list[FileEntry] = []

    @classmethod
    def from_uri(cls, uri: str, storage_options: dict[str, Any] | None = None) -> Step:
        """The step at ``uri`` (``Step.uri`` of another process: a learner rank on another node)."""
        fs, path = filesystem(uri, storage_options)
        return cls(fs, path)

    @property
    def uri(self) -> str:
        return uri_of(self.fs, self.path)

    @property
    def marker_path(self) -> str:
        return join(self.path, MARKER)

    def __repr__(self) -> str:
        return f"Step({self.uri!r})"

    # ---------------------------------------------------------------- state
    def is_committed(self) -> bool:
        return self.fs.exists(self.marker_path)

    def is_skipped(self) -> bool:
        """Committed without doing its work (e.g. an update with no rows after filtering: its metadata says
        ``skipped``); False when not committed."""
        return self.is_committed() and bool(self.manifest().metadata.get("skipped"))

    def did_work(self) -> bool:
        """Committed and not skipped: the step's outputs exist (an update step then holds new weights)."""
        return self.is_committed() and not self.manifest().metadata.get("skipped")

    def manifest(self) -> Manifest:
        """The commit manifest; ``StepNotCommittedError`` if the step is not committed."""
        try:
            with self.fs.open(self.marker_path, "rb") as f:
                text = f.read().decode()
        except FileNotFoundError as exc:
            raise StepNotCommittedError(
                f"step {self.uri} is not committed (no {MARKER}); it is in flight, crashed, or was never run"
            ) from exc
        try:
            return Manifest.from_json(text)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptFileError(f"commit marker {uri_of(self.fs, self.marker_path)} is unreadable: {exc}") from exc

    # ---------------------------------------------------------------- writing
    def begin(self, keep: tuple[str, ...] = ()) -> Step:
        """Start (or restart) writing: clear files a crashed attempt left behind, except the entries named in
        ``keep`` (e.g. the committed shards a sharded writer resumes from).

        Raises ``StepAlreadyCommittedError`` for a committed step: callers check ``is_committed()``
        first and skip the work, which is what makes re-running an iteration cheap.
        """
        if self.is_committed():
            raise StepAlreadyCommittedError(f"step {self.uri} is already committed; read it instead of rewriting it")
        if self.fs.exists(self.path):
            for leftover in self.fs.ls(self.path, detail=False):
                if posixpath.basename(leftover.rstrip("/")) not in keep:
                    self.fs.rm(leftover, recursive=True)
        else:
            self.fs.makedirs(self.path, exist_ok=True)
        self._pending = []
        return self

    def write_bytes(self, name: str, data: bytes, rows: int | None = None) -> FileEntry:
        """Write one file of this step (atomic); it stays invisible until ``commit``."""
        _check_name(name, self.uri)
        if self.is_committed():
            raise StepAlreadyCommittedError(f"step {self.uri} is committed; cannot add {name}")
        write_bytes_atomic(self.fs, join(self.path, name), data)
        entry = FileEntry(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=rows)
        self._pending = [e for e in self._pending if e.name != name] + [entry]
        return entry

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> FileEntry:
        """Upload a local file (streamed, hashed on the way) into this step."""
        _check_name(name, self.uri)
        if self.is_committed():
            raise StepAlreadyCommittedError(f"step {self.uri} is committed; cannot add {name}")
        target = join(self.path, name)
        digest, size = _sha256_file(local_path)
        if is_local(self.fs):
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            tmp = join(posixpath.dirname(target), f".tmp-{uuid.uuid4().hex}")
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, target)
        else:
            self.fs.put_file(str(local_path), target)
        entry = FileEntry(name=name, bytes=size, sha256=digest)
        self._pending = [e for e in self._pending if e.name != name] + [entry]
        return entry

    def add_tree(self, local_dir: str | os.PathLike[str], prefix: str = "") -> list[FileEntry]:
        """Add every file under ``local_dir`` as ``prefix/<relative path>``.

        When ``local_dir`` already *is* this step's folder on a local filesystem (a worker process
        wrote its checkpoint straight into the step), files are registered in place, not copied.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        in_place = is_local(self.fs) and root.resolve() == Path(self.path).resolve() / prefix
        entries = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            name = "/".join(filter(None, [prefix, path.relative_to(root).as_posix()]))
            if in_place:
                digest, size = _sha256_file(path)
                entry = FileEntry(name=name, bytes=size, sha256=digest)
                self._pending = [e for e in self._pending if e.name != name] + [entry]
            else:
                entry = self.write_file(name, path)
            entries.append(entry)
        return entries

    def add_entries(self, entries: list[FileEntry]) -> None:
        """Register files another process already wrote into this step's folder (a learner rank on another node
        uploads its part of a checkpoint with ``add_tree`` on its own ``Step`` and returns the entries). Each one
        must be there with the size it was hashed at; the sha256 is the writer's, computed from its local file
        before the upload."""
        for entry in entries:
            _check_name(entry.name, self.uri)
            path = join(self.path, entry.name)
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                size = None
            if size != entry.bytes:
                found = "is missing" if size is None else f"has {size} bytes"
                raise CorruptFileError(f"{uri_of(self.fs, path)} {found}; its writer uploaded {entry.bytes} bytes")
            self._pending = [e for e in self._pending if e.name != entry.name] + [entry]

    @property
    def local_path(self) -> Path | None:
        """The folder on this machine, for tools that need a local path (vLLM, transformers)."""
        return Path(self.path) if is_local(self.fs) else None

    def write_json(self, name: str, obj: Any) -> FileEntry:
        return self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_table(self, name: str, table: pa.Table, row_group_size: int = DEFAULT_ROW_GROUP_SIZE) -> FileEntry:
        """Write a Parquet file (zstd); the schema's metadata (version) travels with it."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", row_group_size=row_group_size)
        return self.write_bytes(name, buf.getvalue(), rows=table.num_rows)

    def commit(self, metadata: dict[str, Any] | None = None) -> Manifest:
        """Write the marker last. Idempotent: a committed step returns its existing manifest."""
        if self.is_committed():
            return self.manifest()
        manifest = Manifest(
            step=self.name,
            files=sorted(self._pending, key=lambda e: e.name),
            committed_at=time.time(),
            metadata=metadata or {},
        )
        maybe_crash(f"before_marker:{self.name}", self.path)  # kill matrix: every file written, the marker not
        write_bytes_atomic(self.fs, self.marker_path, manifest.to_json().encode())
        self._pending = []
        return manifest

    def prune(self, prefixes: tuple[str, ...], metadata: dict[str, Any]) -> list[FileEntry]:
        """Drop the files under ``prefixes`` (e.g. ``("model/", "deepspeed/")``) from a committed step, for disk
        retention (``pettingflow runs prune``). Returns the entries dropped (none: nothing to do).

        The marker is rewritten first, without those files and with ``metadata["pruned"]`` recording what went,
        then the files are deleted. A crash in between leaves unlisted files that no reader opens (pruning again
        deletes them); a reader never sees a listed file that is gone. The step stays committed: its other files
        (metrics, trajectories) keep their checksums.
        """
        manifest = self.manifest()
        dropped = [e for e in manifest.files if e.name.startswith(prefixes)]
        if dropped:
            kept = [e for e in manifest.files if not e.name.startswith(prefixes)]
            history = [
                *manifest.metadata.get("pruned", []),
                {**metadata, "files": len(dropped), "bytes": sum(e.bytes for e in dropped), "prefixes": list(prefixes)},
            ]
            pruned = Manifest(
                step=manifest.step,
                files=kept,
                committed_at=manifest.committed_at,
                schema_version=manifest.schema_version,
                metadata={**manifest.metadata, "pruned": history},
            )
            write_bytes_atomic(self.fs, self.marker_path, pruned.to_json().encode())
            maybe_crash("prune:mid", self.path)  # kill matrix: the marker says pruned, its files are still there
        for prefix in prefixes:  # also what an interrupted prune left behind
            folder = join(self.path, prefix.rstrip("/"))
            if self.fs.exists(folder):
                self.fs.rm(folder, recursive=True)
        return dropped

    def pruned(self) -> list[dict[str, Any]]:
        """What ``prune`` removed from this committed step, oldest first (empty: nothing)."""
        return list(self.manifest().metadata.get("pruned", []))

    # ---------------------------------------------------------------- reading
    def read_bytes(self, name: str, verify: bool = True) -> bytes:
        """Read a committed file, checking its size and (by default) its sha256."""
        entry = self._entry(name)
        path = join(self.path, name)
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError as exc:
            raise CorruptFileError(f"{uri_of(self.fs, path)} is listed in the commit marker but missing") from exc
        if len(data) != entry.bytes:
            raise CorruptFileError(f"{uri_of(self.fs, path)} has {len(data)} bytes, the marker recorded {entry.bytes}")
        if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CorruptFileError(f"{uri_of(self.fs, path)} does not match the sha256 in its commit marker")
        return data

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

    def read_table(
        self, name: str, columns: list[str] | None = None, filters: Any = None, verify: bool = True
    ) -> pa.Table:
        """Read a committed Parquet file; corrupt content raises ``CorruptFileError`` naming the path."""
        data = self.read_bytes(name, verify=verify)
        uri = uri_of(self.fs, join(self.path, name))
        try:
            pf = pq.ParquetFile(io.BytesIO(data))
            version = schema_version_of(pf.schema_arrow)
            if version is not None and version not in READABLE_VERSIONS:
                raise CorruptFileError(
                    f"{uri} has trajectory schema version {version}; this pettingflow reads "
                    f"{', '.join(READABLE_VERSIONS)} (a newer pettingflow wrote it: upgrade to read it)"
                )
            if version is None or version == SCHEMA_VERSION:
                return pq.read_table(io.BytesIO(data), columns=columns, filters=filters)
            # an older file: read whole, fill in the columns added since, then select
            table = upgrade_table(pq.read_table(io.BytesIO(data), filters=filters), version)
            return table.select(columns) if columns is not None else table
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            if isinstance(exc, CorruptFileError):
                raise
            raise CorruptFileError(f"{uri} is not a readable Parquet file: {exc}") from exc

    def files(self) -> list[str]:
        return [e.name for e in self.manifest().files]

    def _entry(self, name: str) -> FileEntry:
        for entry in self.manifest().files:
            if entry.name == name:
                return entry
        raise FileNotFoundError(f"{name} is not part of committed step {self.uri}")


def _check_name(name: str, step_uri: str) -> None:
    """File names are relative paths inside the step: no marker clash, no escaping the folder."""
    parts = name.split("/")
    if name == MARKER or not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid file name {name!r} in step {step_uri}")


def _sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
