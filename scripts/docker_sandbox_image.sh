#!/usr/bin/env bash
# Build the Docker sandbox's image locally, pulling nothing from a registry: a root filesystem holding only
# this machine's python3 (the interpreter, its standard library and the shared libraries they load), imported
# with `docker import`. The image has no shell, no package manager and no site-packages: model code gets the
# standard library, as in the bubblewrap sandbox's -I -S interpreter.
#   scripts/docker_sandbox_image.sh [TAG]        (default pettingflow-sandbox:py3; DOCKER_HOST is honoured)
# then set sandbox.backend=docker and sandbox.docker_image=TAG in the env's options.
set -euo pipefail
TAG=${1:-pettingflow-sandbox:py3}
# the distribution's interpreter (a pyenv or venv python3 on PATH is a shim or a link into a larger tree)
PY=$(readlink -f "${PYTHON:-/usr/bin/python3}")
STDLIB=$("$PY" -S -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
copy() { mkdir -p "$ROOT$(dirname "$1")"; cp -aL "$1" "$ROOT$1"; }
copy "$PY"
mkdir -p "$ROOT/usr/bin"
[ -e "$ROOT/usr/bin/python3" ] || ln -s "$PY" "$ROOT/usr/bin/python3"
mkdir -p "$ROOT$(dirname "$STDLIB")"
# the standard library without its own tests, IDLE, tkinter and ensurepip's bundled wheels
tar -C "$(dirname "$STDLIB")" --exclude='*/test' --exclude='*/idlelib' --exclude='*/tkinter' \
  --exclude='*/ensurepip' --exclude='*/__pycache__' -cf - "$(basename "$STDLIB")" | tar -C "$ROOT$(dirname "$STDLIB")" -xf -
# every shared library the interpreter and its extension modules load (ldd resolves them here)
{ ldd "$PY"; find "$STDLIB" -name '*.so' -exec ldd {} \; 2>/dev/null; } \
  | grep -oE '/[^ ]+\.so[^ ]*' | sort -u | while read -r lib; do [ -e "$lib" ] && copy "$lib"; done
mkdir -p "$ROOT/etc"  # /tmp, /workdir and /program are tmpfs mounts of each run (an image folder there would lend its owner and mode)
echo "nobody:x:65534:65534:nobody:/workdir:/nonexistent" > "$ROOT/etc/passwd"
tar -C "$ROOT" -cf - . | docker import --change 'ENV LANG=C.UTF-8' - "$TAG" >/dev/null
echo "built $TAG ($(docker image inspect "$TAG" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')) from $PY"
