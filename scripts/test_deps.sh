#!/usr/bin/env bash
# System packages only the tests need: headless Chromium, which opens the trajectory viewer's pages
# (tests/browser.py). Called by `make test` and `make test-fast`; a no-op once it is installed.
set -euo pipefail
say() { printf '\033[1;34m[test-deps]\033[0m %s\n' "$*"; }
for b in chromium chromium-browser google-chrome; do command -v "$b" >/dev/null 2>&1 && exit 0; done
say "installing chromium (headless browser for the viewer's tests) with apt-get"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  say "chromium is missing and this user cannot install it: the browser checks will skip (CI fails them)."
  say "install it with: apt-get install -y chromium"; exit 0; fi
$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
  || { echo "[test-deps] apt-get install chromium failed" >&2; exit 1; }
