#!/usr/bin/env bash
# A local MLflow tracking server on loopback with a SQLite store, for `run.mlflow_tracking_uri`.
#   scripts/mlflow_server.sh [PORT] [DATA_DIR]      (defaults: 5000, .pettingflow/mlflow)
#   scripts/mlflow_server.sh --build                 only build its environment (`make test` does it in the background)
# then train with run.mlflow_tracking_uri=http://127.0.0.1:PORT and open that address in a browser.
# The server runs from its own environment, .venv-mlflow (built on first use, ~1 minute, ~0.9 GB): the full
# `mlflow` package pins pyarrow below the version PettingFlow's environment needs, and only its client
# (mlflow-skinny) has to live beside PettingFlow. Loopback only: the server has no login.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_ONLY=no
if [ "${1:-}" = "--build" ]; then BUILD_ONLY=yes; shift; fi
PORT=${1:-5000}
DATA=${2:-.pettingflow/mlflow}
MLFLOW_VERSION=3.17.2
TOOL=${MLFLOW_VENV:-.venv-mlflow}
say() { printf '\033[1;34m[mlflow]\033[0m %s\n' "$*" >&2; }
built() { [ -x "$TOOL/bin/mlflow" ] && "$TOOL/bin/python" -c "import mlflow, sys; sys.exit(mlflow.__version__ != '$MLFLOW_VERSION')" 2>/dev/null; }
if ! built; then
  exec 9>"$TOOL.lock"
  flock 9  # one build at a time: a server asked for while `make test` builds in the background waits for it
  if ! built; then
    say "building $TOOL with mlflow==$MLFLOW_VERSION (once)"
    rm -rf "$TOOL"
    python3 -m venv "$TOOL"
    "$TOOL/bin/python" -m pip install -q --disable-pip-version-check "mlflow==$MLFLOW_VERSION" 2>&1 \
      | grep -v "^WARNING: Location" >&2 || true
    "$TOOL/bin/python" -c "import mlflow" || { echo "[mlflow] could not install mlflow into $TOOL" >&2; exit 1; }
  fi
  exec 9>&-
fi
[ "$BUILD_ONLY" = yes ] && exit 0
mkdir -p "$DATA"
DATA=$(cd "$DATA" && pwd)
say "serving http://127.0.0.1:$PORT (store sqlite:///$DATA/mlflow.db, artifacts $DATA/artifacts)"
exec "$TOOL/bin/mlflow" server --backend-store-uri "sqlite:///$DATA/mlflow.db" --artifacts-destination "$DATA/artifacts" \
  --host 127.0.0.1 --port "$PORT" --workers 1
