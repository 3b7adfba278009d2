#!/usr/bin/env bash
# `make stop`: stop what `make run` started (worker, server, any vLLM server a flow left), by PID.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect_env.sh
say() { printf '\033[1;34m[stop]\033[0m %s\n' "$*"; }

stop_pid_file() {  # SIGINT first (the worker only stops promptly on it), then TERM, then KILL
  local file=$1 name=$2 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping $name (pid $pid)"
    for sig in INT TERM KILL; do
      kill -"$sig" -- -"$pid" 2>/dev/null || kill -"$sig" "$pid" 2>/dev/null
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break 2; sleep 0.5; done
    done
  fi
  rm -f "$file"
}

stop_pid_file "$PID_DIR/worker.pid" "Prefect worker"
for f in "$PID_DIR"/vllm-*.pid; do [ -e "$f" ] && stop_pid_file "$f" "vLLM server $(basename "$f" .pid)"; done
stop_pid_file "$PID_DIR/server.pid" "Prefect server"
if [ -f "$POSTGRES_DIR/cluster/postmaster.pid" ]; then
  say "stopping PostgreSQL ($POSTGRES_DIR)"; scripts/prefect_postgres.sh stop "$POSTGRES_DIR"
fi
say "stopped"
