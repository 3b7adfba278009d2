"""The malloc choice for processes the project starts (pettingflow/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pettingflow import allocator


@pytest.fixture
def fake_tcmalloc(tmp_path, monkeypatch):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: str(lib))
    return str(lib)


def test_auto_preloads_tcmalloc_when_installed_and_keeps_an_existing_preload(fake_tcmalloc):
    assert allocator.preload_env("auto", {}) == {"LD_PRELOAD": fake_tcmalloc}
    kept = allocator.preload_env("auto", {"LD_PRELOAD": "/x/libfoo.so"})
    assert kept == {"LD_PRELOAD": f"{fake_tcmalloc}:/x/libfoo.so"}
    # already preloaded: unchanged, not twice
    assert allocator.preload_env("tcmalloc", {"LD_PRELOAD": fake_tcmalloc}) == {"LD_PRELOAD": fake_tcmalloc}
    assert allocator.preload_env("system", {}) == {}
    assert allocator.describe("auto") == "tcmalloc"


def test_missing_tcmalloc_falls_back_on_auto_and_fails_when_required(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.preload_env("auto", {}) == {}
    assert allocator.describe("auto") == "system"
    with pytest.raises(allocator.MallocError, match="libtcmalloc-minimal4"):
        allocator.preload_env("tcmalloc", {})


def test_find_tcmalloc_looks_in_the_given_folders(tmp_path):
    allocator.find_tcmalloc.cache_clear()
    try:
        assert allocator.find_tcmalloc((str(tmp_path),)) is None
        (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
        allocator.find_tcmalloc.cache_clear()
        assert allocator.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")
    finally:
        allocator.find_tcmalloc.cache_clear()


def test_loaded_malloc_reads_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.9\n")
    assert allocator.loaded_malloc(str(maps)) == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded_malloc(str(maps)) == "system"
    assert allocator.loaded_malloc(str(tmp_path / "absent")) == "unknown"


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="no tcmalloc (scripts/bootstrap.sh installs it)")
def test_a_child_started_with_the_preload_runs_tcmalloc():
    env = {**os.environ, **allocator.preload_env("tcmalloc")}
    code = "from pettingflow.allocator import loaded_malloc; print(loaded_malloc())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "tcmalloc"
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "system"
