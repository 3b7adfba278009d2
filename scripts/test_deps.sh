#!/usr/bin/env bash
# System packages only the tests need, installed with apt-get when missing (a no-op once they are there):
#   chromium   headless browser that opens the trajectory viewer's pages (tests/browser.py)
#   postgresql the Prefect server's database in the deployment tests (tests/e2e_stack.py: scripts/prefect_postgres.sh)
#   docker.io  a Docker engine for the Docker sandbox's tests (tests/test_sandbox_docker.py starts a private
#              dockerd on its own socket, without bridge or iptables; the package's own service is not needed)
# Called by `make test` and `make test-fast`. Without root or sudo the checks that need them skip (CI fails them).
set -euo pipefail
say() { printf '\033[1;34m[test-deps]\033[0m %s\n' "$*"; }
missing=()
have_browser=no
for b in chromium chromium-browser google-chrome; do command -v "$b" >/dev/null 2>&1 && have_browser=yes; done
[ "$have_browser" = yes ] || missing+=(chromium)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
[ ${#missing[@]} -eq 0 ] && exit 0
say "installing ${missing[*]} (browser, Docker and PostgreSQL tests) with apt-get"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  say "this user cannot install them: the tests that need them will skip (CI fails them)."
  say "install them with: apt-get install -y ${missing[*]}"; exit 0; fi
$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null || { echo "[test-deps] apt-get install ${missing[*]} failed" >&2; exit 1; }
