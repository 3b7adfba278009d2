#!/usr/bin/env bash
# A private PostgreSQL cluster for the Prefect server: Debian's postgresql, on loopback, password-authenticated.
#   scripts/prefect_postgres.sh start DATA_DIR PORT   # prints the Prefect connection URL on stdout
#   scripts/prefect_postgres.sh stop DATA_DIR
# `PF_PREFECT_DB=postgres make run` uses it (data in .pettingflow/postgres, or /var/lib/pettingflow/postgres when
# run as root: PostgreSQL refuses to run as root, so the cluster then belongs to the `postgres` user, whose home
# must be able to reach the data folder). The database `prefect`, its owner `prefect` and a random password
# (DATA_DIR/password, mode 600) are created on the first start; a later start reuses them. The password is never
# an argument of a command (the process list shows those to every local user): the connection URL this prints
# goes to the Prefect server in its environment (PREFECT_API_DATABASE_CONNECTION_URL).
set -euo pipefail
say() { printf '\033[1;34m[postgres]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[postgres] error:\033[0m %s\n' "$*" >&2; exit 1; }
CMD=${1:?usage: prefect_postgres.sh start|stop DATA_DIR [PORT]}
DATA=${2:?usage: prefect_postgres.sh start|stop DATA_DIR [PORT]}
PORT=${3:-5432}
BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$BIN" ] && [ -x "$BIN/initdb" ] || die "PostgreSQL is not installed: apt-get install -y postgresql"
if [ "$(id -u)" -eq 0 ]; then AS=(runuser -u postgres --); else AS=(); fi
CLUSTER=$DATA/cluster

case "$CMD" in
stop)
  [ -f "$CLUSTER/postmaster.pid" ] && "${AS[@]}" "$BIN/pg_ctl" -D "$CLUSTER" -m fast -w stop >/dev/null || true
  exit 0 ;;
start) ;;
*) die "unknown command $CMD (start or stop)" ;;
esac

mkdir -p "$DATA"
if [ ! -f "$DATA/password" ]; then
  (umask 077; head -c 24 /dev/urandom | base64 | tr -d '/+=' > "$DATA/password")
fi
PASSWORD=$(cat "$DATA/password")
[ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$DATA"
if [ ! -f "$CLUSTER/PG_VERSION" ]; then
  say "creating a cluster in $CLUSTER"
  "${AS[@]}" "$BIN/initdb" -D "$CLUSTER" -U postgres --auth-local=peer --auth-host=scram-sha-256 -E UTF8 \
    --no-instructions >"$DATA/initdb.log" 2>&1 || { cat "$DATA/initdb.log" >&2; die "initdb failed"; }
fi
if ! "${AS[@]}" "$BIN/pg_ctl" -D "$CLUSTER" status >/dev/null 2>&1; then
  # loopback only, and the socket in the data folder (no system-wide socket directory needed)
  "${AS[@]}" "$BIN/pg_ctl" -D "$CLUSTER" -l "$DATA/postgres.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $CLUSTER -c max_connections=100" start >/dev/null \
    || { tail -20 "$DATA/postgres.log" >&2; die "PostgreSQL did not start (log: $DATA/postgres.log)"; }
fi
psql_() { "${AS[@]}" "$BIN/psql" -h "$CLUSTER" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA "$@"; }
if [ "$(psql_ -c "SELECT 1 FROM pg_roles WHERE rolname = 'prefect'")" != 1 ]; then
  # the statement on psql's stdin (printf is a builtin): as `psql -c` the password was in the process list
  printf "CREATE ROLE prefect LOGIN PASSWORD '%s';\n" "$PASSWORD" | psql_ >/dev/null
  psql_ -c "CREATE DATABASE prefect OWNER prefect" >/dev/null
  say "created database prefect (owner prefect, password in $DATA/password)"
fi
echo "postgresql+asyncpg://prefect:$PASSWORD@127.0.0.1:$PORT/prefect"
