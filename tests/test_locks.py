"""The two locks (requirements/cpu.lock, requirements/gpu.lock): each pins every dependency pyproject.toml
declares for its flavor, within the declared ranges, and the two agree on every pure-Python package they share
(the same wheel on either machine, so a different version would only be drift)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pins(flavor: str) -> dict[str, str]:
    """``name -> version`` of ``requirements/<flavor>.lock`` (names canonical, local versions kept)."""
    lock = ROOT / "requirements" / f"{flavor}.lock"
    assert lock.is_file(), f"{lock} is missing: see docs/dependencies.md for the command that writes it"
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def declared(flavor: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras[flavor], *extras["dev"]]]


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_each_lock_pins_every_declared_dependency_within_its_range(flavor: str) -> None:
    locked = pins(flavor)
    missing = [str(r) for r in declared(flavor) if canonicalize_name(r.name) not in locked]
    assert not missing, f"{flavor}.lock does not pin {missing}"
    outside = [
        f"{r} (locked {locked[canonicalize_name(r.name)]})"
        for r in declared(flavor)
        if not r.specifier.contains(locked[canonicalize_name(r.name)].split("+")[0], prereleases=True)
    ]
    assert not outside, f"{flavor}.lock pins outside pyproject.toml's ranges: {outside}"
    for extra in ("cpu", "gpu"):  # the other flavor's vLLM build is not in this lock
        if extra != flavor:
            for r in declared(extra):
                if r not in declared(flavor):
                    assert canonicalize_name(r.name) not in locked, f"{flavor}.lock pins {r.name} of the {extra} extra"


def test_the_locks_agree_on_the_pure_python_packages_they_share() -> None:
    """Pure Python: the wheel this environment installed says ``Root-Is-Purelib: true``. Platform builds (torch
    +cpu vs CUDA, vLLM's two builds, triton) may differ; nothing else may."""
    cpu, gpu = pins("cpu"), pins("gpu")
    shared = sorted(set(cpu) & set(gpu))
    assert len(shared) > 100, "the locks share too little to be locks of the same project"
    differ = []
    for name in shared:
        try:
            wheel = metadata.distribution(name).read_text("WHEEL") or ""
        except metadata.PackageNotFoundError:
            continue
        if "Root-Is-Purelib: true" in wheel and cpu[name] != gpu[name]:
            differ.append(f"{name}: cpu {cpu[name]}, gpu {gpu[name]}")
    assert not differ, f"the locks disagree on pure-Python packages: {differ}"
    assert cpu["torch"].endswith("+cpu") and "+" not in gpu["torch"]  # PyPI's torch is the CUDA build


def test_bootstrap_picks_the_gpu_lock_where_nvidia_smi_finds_a_gpu() -> None:
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "nvidia-smi -L" in script and "FLAVOR=gpu" in script and "LOCK=requirements/$FLAVOR.lock" in script
