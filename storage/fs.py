"""fsspec access: one place that turns a URI into (filesystem, path) and writes files atomically.

Any fsspec URI works (local paths by default, ``s3://`` through s3fs, ``memory://`` in tests).
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


def filesystem(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve ``uri`` to a filesystem and a path on it (local paths are made absolute)."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    return fs, path.rstrip("/") or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Local filesystems need temp-then-rename for atomic writes; object stores do not."""
    return isinstance(fs, LocalFileSystem)


def join(*parts: str) -> str:
    """Join path segments with '/', the separator every fsspec filesystem uses."""
    return posixpath.join(*parts)


def uri_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URI for ``path`` that another process can pass back to ``filesystem``."""
    return fs.unstrip_protocol(path)


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file.

    Locally: write a hidden temp file in the same directory, then rename (atomic on POSIX).
    On object stores a single PUT is already atomic, so the data goes straight to its key.
    """
    parent = posixpath.dirname(path)
    if is_local(fs):
        fs.makedirs(parent, exist_ok=True)
        tmp = join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
        try:
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)
