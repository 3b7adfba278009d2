"""Ray with token authentication: the one way PettingFlow starts, joins or attaches to a Ray cluster.

Why: a Ray cluster runs whatever code any process that reaches its ports sends it, and those ports are open on
every interface (a local ``ray.init`` binds its GCS and raylet to ``::``, whatever the node IP). Ray 2.60's token
authentication closes them: with ``RAY_AUTH_MODE=token`` every gRPC call (driver, raylet, worker, GCS) and
the dashboard's HTTP API must carry the cluster's token, and a driver or node without it is refused
(``Unauthenticated: ... Authentication token is missing or incorrect``). Token auth is not encryption: the token
and all traffic cross the network in clear (docs/scaling.md, "A cluster closed to strangers").

How Ray 2.60 finds the token (each process, once; it caches it): ``RAY_AUTH_TOKEN`` (the token itself), else
``RAY_AUTH_TOKEN_PATH`` (a file, first line), else ``~/.ray/auth_token``. The mode comes from ``RAY_AUTH_MODE``,
read into Ray's per-process config when ``ray`` is imported; a later change of the variable is seen only after
that config is re-read (``use_token_auth`` does it). Children inherit both variables: a local Ray's raylet and
workers get the driver's environment, the workers of a ``ray start`` node get that command's.

What PettingFlow does:

- the token is generated once (``secrets``, 256 bits) into ``$PETTINGFLOW_HOME/ray/auth_token`` (mode 0600, in a
  0700 folder), or the file ``RAY_AUTH_TOKEN_PATH`` names when set; it is never logged or printed;
- every process it starts or attaches gets ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (the path, not the
  token: a token in the environment would be visible to every child and in ``/proc/<pid>/environ``); a
  ``RAY_AUTH_TOKEN`` the user exported is left alone and wins, as in Ray;
- ``init_ray`` is the only ``ray.init`` of the package (the run's runtime, the Ray rollout workers, the sandbox
  pool); starting a local Ray creates the token if needed, attaching never does (a fresh token cannot open a
  cluster that has another one), it says where the token must be instead;
- ``start_head`` / ``join_cluster`` (and ``python -m pettingflow.ray_cluster head|join``) run ``ray start`` with
  the same environment, so a cluster started for PettingFlow is closed too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pettingflow.paths import home

log = logging.getLogger(__name__)

AUTH_MODE_VAR = "RAY_AUTH_MODE"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_BYTES = 32


class RayAuthError(RuntimeError):
    """The cluster's token is missing or unusable (what to do is in the message; the token never is)."""


def token_path() -> Path:
    """Where this process's Ray token lives: ``$RAY_AUTH_TOKEN_PATH`` when set, else
    ``$PETTINGFLOW_HOME/ray/auth_token``."""
    explicit = os.environ.get(TOKEN_PATH_VAR)
    return Path(explicit).expanduser() if explicit else home() / "ray" / "auth_token"


def ensure_token(path: Path | None = None) -> Path:
    """The token file at ``path`` (default ``token_path()``), generated now if there is none.

    A new token is written to a private temp file beside it and linked into place, so a concurrent reader never
    sees a half-written file and two processes racing to create it end up sharing the first one's token."""
    path = path or token_path()
    folder = path.parent
    default_folder = home() / "ray"
    if not folder.is_dir():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    elif folder == default_folder and folder.stat().st_mode & 0o077:
        os.chmod(folder, 0o700)  # PettingFlow's own folder: keep it private
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".auth_token.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(TOKEN_BYTES))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
                log.info("generated a Ray auth token in %s", path)
        finally:
            os.unlink(tmp)
    _check_token_file(path)
    return path


def _check_token_file(path: Path) -> None:
    try:
        mode = path.stat().st_mode
        first_line = path.read_text().partition("\n")[0].strip()
    except OSError as exc:
        raise RayAuthError(f"cannot read the Ray auth token file {path}: {exc}") from exc
    if not first_line:
        raise RayAuthError(f"the Ray auth token file {path} is empty")
    if mode & 0o077:
        log.warning("the Ray auth token file %s is readable by other users (mode %o): chmod 600 it", path, mode & 0o777)


def auth_env(*, create: bool) -> dict[str, str]:
    """The variables that make a process (and everything it starts) use the token: ``RAY_AUTH_MODE=token`` and
    ``RAY_AUTH_TOKEN_PATH``. ``create``: generate the token if there is none (for a process that *starts* a
    cluster); otherwise a missing token raises RayAuthError saying where it must be."""
    env = {AUTH_MODE_VAR: "token"}
    if os.environ.get(TOKEN_VAR):
        return env  # the user's own token in the environment: Ray prefers it to any file
    path = token_path()
    if create:
        ensure_token(path)
    elif not path.exists():
        raise RayAuthError(
            f"no Ray auth token at {path}: a cluster PettingFlow starts accepts only drivers and nodes that have "
            f"its token. Copy the head's token file (its $PETTINGFLOW_HOME/ray/auth_token) to {path} with mode "
            f"0600, or point {TOKEN_PATH_VAR} at a copy (docs/scaling.md, 'A cluster closed to strangers')"
        )
    else:
        _check_token_file(path)
    env[TOKEN_PATH_VAR] = str(path)
    return env


def use_token_auth(*, create: bool) -> None:
    """Put ``auth_env(create=create)`` into this process's environment and make Ray read it again.

    Ray reads ``RAY_AUTH_MODE`` into a per-process config when it is imported and caches the token once loaded, so
    setting the variables after ``import ray`` would otherwise have no effect on this process, while the Ray it
    starts (a child) follows them and refuses it (seen: ``ray.init()`` ends in ConnectionError after 20 s of
    ``Unauthenticated``). The refresh is skipped while Ray is connected (the next ``ray.init`` after
    ``ray.shutdown`` gets it)."""
    env = auth_env(create=create)
    previous = os.environ.get(AUTH_MODE_VAR)
    if previous not in (None, "token"):
        log.warning("%s=%s ignored: PettingFlow's Ray clusters use token authentication", AUTH_MODE_VAR, previous)
    os.environ.update(env)
    _reload_ray_auth()


def _reload_ray_auth() -> None:
    ray = sys.modules.get("ray")
    if ray is None:  # not imported yet: it will read the environment when it is
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token auth: nothing to refresh
        return
    if ray.is_initialized():
        return
    Config.initialize("")  # re-reads RAY_AUTH_MODE (and the other RAY_* settings) from the environment
    AuthenticationTokenLoader.instance().reset_cache()


def init_ray(address: str | None = None, **kwargs: Any) -> Any:
    """``ray.init`` with token authentication; the only place PettingFlow calls it.

    ``address`` None starts a local Ray (generating the token if there is none); otherwise attaches to that
    cluster with the token it must already have (RayAuthError when the token file is missing). ``kwargs`` go to
    ``ray.init`` unchanged. A driver without the right token is refused by the cluster: ``ray.init`` raises
    ConnectionError after Ray's retries (about 20 s), and Ray logs ``Unauthenticated: ... Authentication token is
    missing or incorrect``."""
    import ray

    attaching = bool(address or os.environ.get("RAY_ADDRESS"))
    use_token_auth(create=not attaching)
    if address is None:
        return ray.init(**kwargs)
    return ray.init(address=address, **kwargs)


# --- nodes started with `ray start` ---------------------------------------------------------------------------


def ray_start(args: Sequence[str], *, create_token: bool, **run_kwargs: Any) -> subprocess.CompletedProcess:
    """``ray start ARGS`` with this process's environment plus ``auth_env``; ``run_kwargs`` go to
    ``subprocess.run`` (``ray start`` returns once the node is up; its processes keep running)."""
    env = {**os.environ, **auth_env(create=create_token), **run_kwargs.pop("env", {})}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *args]
    return subprocess.run(cmd, env=env, **run_kwargs)


def start_head(
    port: int, node_ip_address: str, *extra: str, temp_dir: str | None = None, **run_kwargs: Any
) -> subprocess.CompletedProcess:
    """``ray start --head`` on ``node_ip_address:port`` with token auth (the token is generated if missing).
    ``temp_dir`` keeps the node's files apart (short: Ray's socket paths are length-limited); ``extra``:
    more ``ray start`` options."""
    args = [f"--port={port}", f"--node-ip-address={node_ip_address}", "--disable-usage-stats", *extra]
    if temp_dir:
        args.append(f"--temp-dir={temp_dir}")
    return ray_start(["--head", *args], create_token=True, **run_kwargs)


def join_cluster(
    address: str, node_ip_address: str, *extra: str, temp_dir: str | None = None, **run_kwargs: Any
) -> subprocess.CompletedProcess:
    """``ray start --address=ADDRESS`` on this machine: a node that joins the head at ``address`` with the
    head's token, which must already be here (``token_path()``); RayAuthError otherwise."""
    args = [f"--address={address}", f"--node-ip-address={node_ip_address}", "--disable-usage-stats", *extra]
    if temp_dir:
        args.append(f"--temp-dir={temp_dir}")
    return ray_start(args, create_token=False, **run_kwargs)


def node_processes(temp_dir: str) -> list[Any]:
    """The processes of the node whose files live in ``temp_dir``: every Ray process names its session folder
    (``TEMP_DIR/session_...``) in its arguments. Never this process or its ancestors (a command that merely
    names the folder)."""
    import psutil

    prefix = os.path.join(os.path.abspath(temp_dir), "")
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid not in spared and any(prefix in arg for arg in proc.info["cmdline"] or []):
                out.append(proc)
    return out


def stop_node(temp_dir: str, timeout_s: float = 30.0) -> None:
    """SIGKILL exactly the node started with ``--temp-dir=temp_dir`` (its workers end with its raylet);
    ``ray stop`` would stop every Ray of this user on the machine."""
    import psutil

    procs = node_processes(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)

    def alive(proc: Any) -> bool:  # a zombie is dead: its parent, not us, reaps it
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    while (procs := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pettingflow.ray_cluster token|head|join ...`` (docs/scaling.md)."""
    parser = argparse.ArgumentParser(prog="python -m pettingflow.ray_cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("token", help="generate the token if there is none; print the file's path (never the token)")
    head = sub.add_parser("head", help="ray start --head with token auth; other options go to ray start")
    head.add_argument("--port", type=int, default=6379)
    head.add_argument("--node-ip-address", required=True)
    join = sub.add_parser("join", help="ray start --address=HEAD with the head's token; other options go to ray start")
    join.add_argument("address", help="the head's HOST:PORT")
    join.add_argument("--node-ip-address", required=True)
    ns, extra = parser.parse_known_args(argv)
    try:
        if ns.command == "token":
            if extra:
                parser.error(f"unknown arguments: {extra}")
            print(ensure_token())
            return 0
        if ns.command == "head":
            return start_head(ns.port, ns.node_ip_address, *extra, check=False).returncode
        return join_cluster(ns.address, ns.node_ip_address, *extra, check=False).returncode
    except RayAuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
