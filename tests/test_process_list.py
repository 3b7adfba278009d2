"""The process-list scanner the tests of running stacks use (``tests/process_list.py``) finds what it must: a secret
in a child's arguments, while the child lives, and nothing once it is gone or in its environment alone. And the
Prefect database's start script, whose ``psql`` lives too briefly for a scan to see it, never passes the password
to a command (checked on the script's own trace)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import process_list
import pytest
from e2e_stack import REPO, free_port

SLEEP = "import time; time.sleep(30)"
BUILTINS = ("PASSWORD=", "printf ", "echo ")  # the traced lines that may hold the password: no command runs


def test_a_secret_in_a_childs_arguments_is_found_and_named_without_the_secret() -> None:
    planted = "-" + secrets.token_urlsafe(32)
    absent = "-" + secrets.token_urlsafe(32)
    child = subprocess.Popen([sys.executable, "-c", SLEEP, "--api-key", planted])
    try:
        found = process_list.showing([absent, planted])
        assert found == [f"{child.pid} {os.path.basename(sys.executable)}: secret #1"]
        assert planted not in " ".join(found)  # an assertion message never prints the secret
    finally:
        child.kill()
        child.wait()
    assert process_list.showing([planted]) == []
    with pytest.raises(ValueError, match="no secret"):
        process_list.showing(["", None])


def test_a_secret_in_the_environment_alone_is_not_in_the_process_list() -> None:
    """What PettingFlow relies on: a child's environment is not its command line (``ps`` shows only the latter)."""
    token = "-" + secrets.token_urlsafe(32)
    child = subprocess.Popen([sys.executable, "-c", SLEEP], env={**os.environ, "VLLM_API_KEY": token})
    try:
        assert process_list.showing([token]) == []
    finally:
        child.kill()
        child.wait()


def test_the_watch_sees_a_short_lived_process_and_secrets_known_later() -> None:
    """``ProcessListWatch`` samples while its block runs: a process that lives a second is seen, and a secret
    made after the watch began (as a run makes its key) is looked for from then on."""
    known: list[str] = []
    with process_list.ProcessListWatch(lambda: known, interval_s=0.05) as watch:
        known.append("-" + secrets.token_urlsafe(32))
        subprocess.run([sys.executable, "-c", "import time; time.sleep(1)", known[0]], check=True)
    assert watch.samples > 3 and len(watch.found) == 1 and next(iter(watch.found)).endswith(": secret #0")
    with process_list.ProcessListWatch(known, interval_s=0.05) as clean:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert clean.samples >= 1 and not clean.found


def test_the_prefect_database_password_is_never_an_argument_of_a_command() -> None:
    """``scripts/prefect_postgres.sh start`` (``PF_PREFECT_DB=postgres make run``, the deployment tests) under
    ``bash -x``: every traced line holding the password is the assignment or a builtin (``printf`` into psql's
    stdin, ``echo`` of the URL the caller puts in the Prefect server's environment), never a command it runs
    (as ``psql -c "CREATE ROLE ... PASSWORD '...'"`` it was, for a moment, in the process list); and the role
    logs in with that password over TCP (the password in psql's environment)."""
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed: scripts/test_deps.sh installs it, so CI must have it")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    script = str(REPO / "scripts" / "prefect_postgres.sh")
    data = Path(tempfile.mkdtemp(prefix="pf-pw-postgres-", dir="/tmp"))  # the cluster's owner must reach it
    data.chmod(0o755)
    port = free_port()
    try:
        done = subprocess.run(["bash", "-x", script, "start", str(data), str(port)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        password = re.fullmatch(r"postgresql\+asyncpg://prefect:(.+)@127\.0\.0\.1:\d+/prefect", done.stdout.strip())[1]
        assert password == (data / "password").read_text().strip()
        holding = [re.sub(r"^\++ ", "", line) for line in done.stderr.splitlines() if password in line]
        passed_on = [line.replace(password, "<password>") for line in holding if not line.startswith(BUILTINS)]
        assert holding, "the trace never shows the password: nothing checked"
        assert not passed_on, passed_on  # (the messages show the lines without the password)
        psql = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
        login = subprocess.run(
            [str(psql), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "-d", "prefect", "-qtAc", "SELECT 1"],
            env={**os.environ, "PGPASSWORD": password},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert login.stdout.strip() == "1", login.stderr
    finally:
        subprocess.run([script, "stop", str(data)], capture_output=True, timeout=120)
        shutil.rmtree(data, ignore_errors=True)
