# Sourced by run.sh/stop.sh/tests: where the local Prefect server, worker and their state live.
# Everything stays under .pettingflow/ in this checkout (PREFECT_HOME, logs, pid files).
STATE_DIR=${PETTINGFLOW_STATE:-$PWD/.pettingflow}
PID_DIR=$STATE_DIR/pids
LOG_DIR=$STATE_DIR/logs
mkdir -p "$PID_DIR" "$LOG_DIR"
export PREFECT_HOME=${PREFECT_HOME:-$STATE_DIR/prefect}
export PREFECT_CLI_PROMPT=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_API_DATABASE_CONNECTION_URL=${PREFECT_API_DATABASE_CONNECTION_URL:-sqlite+aiosqlite:///$PREFECT_HOME/prefect.db}
# PF_PREFECT_DB=postgres: the Prefect server's database is a private PostgreSQL cluster (scripts/prefect_postgres.sh)
# here; PostgreSQL will not run as root, so root's cluster lives where the postgres user can reach it
if [ "$(id -u)" -eq 0 ]; then POSTGRES_DIR=${PETTINGFLOW_POSTGRES_DIR:-/var/lib/pettingflow/postgres}
else POSTGRES_DIR=${PETTINGFLOW_POSTGRES_DIR:-$STATE_DIR/postgres}; fi
POSTGRES_PORT=${PETTINGFLOW_POSTGRES_PORT:-5433}
export PETTINGFLOW_POOL=${PETTINGFLOW_POOL:-pettingflow}
export PETTINGFLOW_REPO=$PWD
export PREFECT_LOGGING_EXTRA_LOGGERS=${PREFECT_LOGGING_EXTRA_LOGGERS:-pettingflow}  # library progress in the UI
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0
PREFECT=$PWD/.venv/bin/prefect

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The Prefect server in its own session, its output through pettingflow.logcap: Prefect 3.7 on SQLite logs a
# `database is locked` traceback on about every worker poll (docs/flows.md), ≈ 230 MB a day; logcap keeps the
# newest PF_SERVER_LOG_MB (20) in LOG and two older files (LOG.1, LOG.2), and counts those lines in each file's
# header. PID_FILE gets the session's leader: `kill -INT -- -PID` (make stop) reaches the server; logcap ignores
# the signal and ends after the server's last line.
start_prefect_server() {  # PORT LOG PID_FILE
  setsid bash -c '"$1" server start --host 127.0.0.1 --port "$2" 2>&1 < /dev/null \
    | "$3" -m pettingflow.logcap "$4" --max-mb "$5" --backups 2 --count "database is locked"' \
    _ "$PREFECT" "$1" "$PWD/.venv/bin/python" "$2" "${PF_SERVER_LOG_MB:-20}" >/dev/null 2>&1 < /dev/null &
  echo $! >"$3"
}
