"""The malloc choice for processes the project starts (pettingflow/allocator.py)."""

from __future__ import annotations

import json
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


RELEASE_CHILD = """
import json, psutil, torch
from pettingflow.allocator import loaded_malloc, release_free_memory
me = psutil.Process()
# micro-batch-like churn: tensors of many sizes, all freed; the allocator keeps their memory for reuse
for n in range(1, 41):
    batch = [torch.ones(n * 65536 + 4096 * k) for k in range(8)]  # up to 8 x 10 MB
    del batch
held = me.memory_info().rss
by = release_free_memory()
after = me.memory_info().rss
print(json.dumps({"malloc": loaded_malloc(), "by": by, "held_mb": held / 2**20, "after_mb": after / 2**20}))
"""


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="no tcmalloc (scripts/bootstrap.sh installs it)")
def test_releasing_free_memory_gives_tcmalloc_s_kept_spans_back():
    """What a learner rank does after each update (UpdateWorker.release_memory): tcmalloc keeps freed spans (the rank's
    resident memory climbs to the high-water mark of its longest batch); releasing returns them to the kernel."""
    env = {**os.environ, **allocator.preload_env("tcmalloc"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert (got["malloc"], got["by"]) == ("tcmalloc", "tcmalloc")
    assert got["held_mb"] - got["after_mb"] > 50, got  # ~80 MB of freed tensors were still resident before
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], env=plain, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["by"] == "glibc"


def test_learner_ranks_bound_onednns_caches_unless_the_driver_sets_them(monkeypatch):
    """oneDNN's and ideep's caches grew a training process with every new row length (docs/training.md): the ranks
    start with them bounded; a capacity in the driver's environment is kept."""
    from pettingflow.training.learner import RANK_CACHE_ENV, rank_cache_env

    for name in RANK_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert rank_cache_env() == RANK_CACHE_ENV and int(RANK_CACHE_ENV["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) > 0
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    assert rank_cache_env()["LRU_CACHE_CAPACITY"] == "64"


def test_onednn_cache_env_names_both_spellings_and_keeps_the_callers_own() -> None:
    from pettingflow.allocator import onednn_cache_env

    assert onednn_cache_env(0, env={}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "DNNL_PRIMITIVE_CACHE_CAPACITY": "0"}
    chosen = onednn_cache_env(128, 8, env={"DNNL_PRIMITIVE_CACHE_CAPACITY": "7"})
    assert chosen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "DNNL_PRIMITIVE_CACHE_CAPACITY": "7",
                      "LRU_CACHE_CAPACITY": "8"}  # fmt: skip
