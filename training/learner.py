"""The learner of one policy: its training ranks as Ray actors, for a whole run or for one update.

Why: a cold update process per iteration spends most of its time starting Python, importing torch and
DeepSpeed, loading the model, building the engine and saving an optimizer state it then throws away (most
of a small model's update: docs/benchmarks.md), and Adam restarts every iteration. verl and OpenRLHF keep the
policy resident in Ray actors that host the training ranks; so does this module. It is also the one-shot
update's launcher: ``learner.run_update`` starts a ``Learner`` for one update and stops it after.

Process picture (one policy, ``training.num_processes = N``)::

    flow process (driver)  --ray-->  LearnerRank actor 0  (UpdateWorker: model, engine, Adam moments, reference)
                                      LearnerRank actor 1  ...  one torch.distributed group (gloo on CPU, NCCL on GPU)

- Placement uses Ray resources: each rank asks for ``num_cpus`` CPUs (and one GPU when the cluster has GPUs),
  in one placement group (PACK: on one node when it fits, spread over nodes when not). Rank 0's node address
  and a free port there become the group's ``MASTER_ADDR``/``MASTER_PORT``, so ranks on several nodes of an
  attached cluster (``rollout.ray_address``) form one group without new code.
- Each rank runs ``UpdateWorker.update(spec)`` (``training/worker.py``), the recipe of every update.
  The worker keeps the engine while the next spec starts from the weights it holds (``start_weights``).
- Every rank logs to its own file (``learner-<policy>-rank<r>.log``); when a rank dies (kill -9, out of memory)
  the update fails with ``UpdateError`` carrying the tails of those logs, the learner is marked dead, and the
  next ``update`` (the Prefect task's retry) starts fresh ranks that load the newest committed checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pettingflow.allocator import MallocChoice, loaded_malloc, onednn_cache_env, preload_env
from pettingflow.training.launch import LOG_FILE, StagedOutput, UpdateError, UpdateSpec, rebase_outputs

#: Keys of a rank's result that are for the driver, not metrics: the files it uploaded and its log lines.
UPLOADED_KEY = "uploaded"
LOG_KEY = "_log"

log = logging.getLogger(__name__)

ACTOR_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}

#: oneDNN's primitive caches in a rank, bounded (``pettingflow.allocator.onednn_cache_env``: 128 primitives, 8 of
#: torch's ideep computations): at their defaults (1024 each) a bf16 CPU training step on rows of new lengths grew a
#: process ≈ 13 MB per step, and a resident rank keeps them for its life; with these it was flat after 6 steps, at
#: 0.990 of the time per step (side by side, docs/training.md "oneDNN's caches, bounded"). Off (0) cost 1.36x: the
#: layers of one shape share a primitive.
RANK_ONEDNN_CACHE, RANK_IDEEP_CACHE = 128, 8
RANK_CACHE_ENV = onednn_cache_env(RANK_ONEDNN_CACHE, RANK_IDEEP_CACHE, env={})  # the bounds, before any override


def rank_cache_env() -> dict[str, str]:
    """``RANK_CACHE_ENV``, each value the driver's own where it sets one."""
    return onednn_cache_env(RANK_ONEDNN_CACHE, RANK_IDEEP_CACHE)


class LearnerRank:
    """One training rank inside a Ray actor: an ``UpdateWorker`` kept alive between updates."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        log_path: str,
        omp_threads: int,
        driver_pid: int | None = None,
        driver_node: str | None = None,
        localize: Callable[[UpdateSpec], UpdateSpec] | None = None,
    ) -> None:
        """``driver_node``: the Ray node id of the flow's process. A rank on another node cannot use the folders the
        flow names (start weights, output); it makes its own copies with ``localize`` and uploads what it writes
        (``UpdateSpec.out_uri``)."""
        import ray

        from pettingflow.deathsig import die_with_parent

        die_with_parent()  # the raylet died (the flow process was killed): stop training at once, mid-step too
        if driver_pid is not None:
            _watch_driver(driver_pid)
        os.environ.update(ACTOR_ENV)
        os.environ["OMP_NUM_THREADS"] = str(omp_threads)  # before torch is imported in this process
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        self.rank = rank
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.worker: Any = None
        self.broadcaster: Any = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.away = driver_node is not None and self.node_id != driver_node
        self.localize = localize

    def where(self) -> dict[str, Any]:
        """This rank's node (id and address), pid and log file: the driver names them when the rank is lost."""
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": os.getpid(),
            "log_path": self.log_path,
            "away": self.away,
        }

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` of this rank's log (the driver cannot read a file on another node)."""
        return _tail(Path(self.log_path), lines)

    def address(self, host: str | None = None) -> tuple[str, int]:
        """This rank's node address (or ``host``) and a free port on it (rank 0's become the group's master)."""
        import socket

        import ray

        host = host or ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def join(self, master_addr: str, master_port: int) -> int:
        """Join the torch.distributed group (all ranks call this together); returns this process's pid."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        import deepspeed

        from pettingflow.training.worker import UpdateWorker, disable_shm_comm, dist_backend

        disable_shm_comm()
        deepspeed.init_distributed(dist_backend=dist_backend())
        self.worker = UpdateWorker()
        logging.getLogger(__name__).info(
            "rank %d joined %s:%d (pid %d)", self.rank, master_addr, master_port, os.getpid()
        )
        return os.getpid()

    def update(self, spec_json: str) -> dict[str, Any]:
        """Run the update on this rank; the result carries this update's log lines and, for a rank on another
        node, the entries of the files it uploaded into the update step."""
        spec = UpdateSpec.model_validate_json(spec_json)
        offset = _size(Path(self.log_path))
        staging = self._staging(spec.out_dir, spec.out_uri)
        try:
            mine = self._localized(spec, staging)
            result = self.worker.update(mine)
            if staging is not None:
                result = rebase_outputs(result, staging, spec.out_uri)
                result[UPLOADED_KEY] = self._upload(staging, spec.out_uri, spec.storage_options)
        except BaseException:
            logging.getLogger(__name__).exception("update of %s failed", spec.policy)
            self.worker.release()  # half-trained state must never pass for committed weights
            raise
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        result[LOG_KEY] = _read_from(Path(self.log_path), offset)
        return result

    def save_optimizer(
        self, out_dir: str, weights_uri: str, out_uri: str | None = None, storage_options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """This rank's part of the optimizer snapshot of ``weights_uri`` (``UpdateWorker.save_optimizer_snapshot``),
        into ``out_dir`` on the flow's node or, from another node, uploaded to ``out_uri``."""
        staging = self._staging(out_dir, out_uri)
        try:
            result = self.worker.save_optimizer_snapshot(staging or out_dir, weights_uri)
            if staging is not None:
                result = {**result, UPLOADED_KEY: self._upload(staging, out_uri, storage_options or {})}
            return result
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _staging(self, out_dir: str, out_uri: str | None) -> str | None:
        """A folder of this node for what this rank writes (``writes_elsewhere``), or None: into ``out_dir``."""
        if not writes_elsewhere(self.away, out_dir, out_uri, self.rank, self.node_ip):
            return None
        return tempfile.mkdtemp(prefix=f"pettingflow-rank{self.rank}-")

    def _localized(self, spec: UpdateSpec, staging: str | None) -> UpdateSpec:
        """The spec as this node sees it: its own copies of the start weights, its own output folder."""
        if not self.away:
            return spec
        if self.localize is not None:
            spec = self.localize(spec)
        return spec.model_copy(update={"out_dir": staging}) if staging is not None else spec

    def _upload(self, staging: str, out_uri: str | None, storage_options: dict[str, Any]) -> list[dict[str, Any]]:
        """Upload what this rank wrote into the step at ``out_uri``; the driver commits the entries."""
        from pettingflow.storage.commits import Step

        assert out_uri is not None
        entries = Step.from_uri(out_uri, storage_options).add_tree(staging)
        logging.getLogger(__name__).info(
            "rank %d (node %s): uploaded %d file(s) to %s", self.rank, self.node_ip, len(entries), out_uri
        )
        return [dataclasses.asdict(e) for e in entries]

    def push_weights(self, url: str, backend: str, host: str) -> dict[str, Any]:
        """Broadcast the weights this rank holds into the vLLM server's workers (rank 0 only, full weights).

        The group with the server is formed once and reused; a failed push closes it (the next push reconnects).
        """
        from pettingflow.inference.weight_broadcast import WeightBroadcaster

        engine = self.worker.engine
        if self.broadcaster is None:
            device = engine.device if backend == "nccl" else "cpu"
            self.broadcaster = WeightBroadcaster(url, backend=backend, host=host, device=device).connect()
        try:
            # named_parameters lists a tied weight once, under its checkpoint name (embed_tokens for SmolLM2)
            report = self.broadcaster.push([(n, p.detach()) for n, p in engine.module.named_parameters()])
        except BaseException:
            self.broadcaster.close()
            self.broadcaster = None
            raise
        return {"tensors": report.tensors, "bytes": report.bytes, "seconds": round(report.seconds, 3)}

    def state_summary(self) -> dict[str, Any]:
        """What the rank holds (tests and ``runs show``): which weights, updates done, optimizer step count."""
        w = self.worker
        engine = w.engine if w is not None else None
        return {
            "holds": w.holds if w is not None else None,
            "updates_done": w.updates_done if w is not None else 0,
            "global_steps": int(engine.global_steps) if engine is not None else None,
            "pid": os.getpid(),
            "malloc": loaded_malloc(),
            "cache_env": {name: os.environ.get(name) for name in RANK_CACHE_ENV},  # as the rank's process started
        }

    def full_parameters(self) -> dict[str, Any]:
        """Every parameter of the model this rank trains, whole (ZeRO-3 shards gathered), as float32 on CPU:
        tests compare them with the checkpoint the update wrote. Under ZeRO-3 every rank must call it."""
        import deepspeed

        module = self.worker.engine.module
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}

    def optimizer_lrs(self) -> list[float]:
        """The learning rate of each param group of the optimizer that steps (DeepSpeed's, wrapping the client's):
        tests check it is the update's ``training.lr``."""
        opt = self.worker.engine.optimizer
        return [float(g["lr"]) for g in getattr(opt, "optimizer", opt).param_groups]

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state tensors on CPU (tests compare them across restarts)."""
        opt = self.worker.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        return {
            "state": {
                i: {k: v.detach().float().cpu().clone() for k, v in s.items() if hasattr(v, "detach")}
                for i, s in enumerate(inner.state.values())
            }
        }


def writes_elsewhere(away: bool, out_dir: str, out_uri: str | None, rank: int, node_ip: str) -> bool:
    """Whether a rank writes its files into a folder of its own node and uploads them to ``out_uri`` (True), or
    straight into ``out_dir`` (False): only a rank on another node than the flow (``away``) with remote storage.
    With local storage (no ``out_uri``) an away rank can write only where ``out_dir`` is on a filesystem its
    node shares with the flow's; otherwise the error says what to change."""
    if not away:
        return False
    if out_uri is not None:
        return True
    if Path(out_dir).is_dir():  # a filesystem shared with the flow's node, mounted at the same path
        return False
    raise RuntimeError(
        f"learner rank {rank} runs on node {node_ip}, not the flow's, and the output folder {out_dir} does not "
        "exist there: with learner ranks on other nodes, run.storage_root must be storage every node reaches "
        "(s3://... or gs://..., or a filesystem mounted at the same path on every node)"
    )


def rank_bundle(
    cluster: dict[str, float], num_processes: int, cpus_per_rank: float, resources: dict[str, float] | None = None
) -> dict[str, float]:
    """The Ray resources of one rank's placement bundle: its CPUs, one GPU when the cluster has a GPU for every
    rank (NCCL then; a rank never shares a GPU), and the custom ``resources`` that place it
    (``training.rank_resources``). A custom resource the cluster does not offer at all is an error now, not a
    placement group that waits forever."""
    bundle: dict[str, float] = {"CPU": cpus_per_rank}
    if cluster.get("GPU", 0) >= num_processes:
        bundle["GPU"] = 1
    for name, amount in (resources or {}).items():
        if name in ("CPU", "GPU", "memory"):
            raise ValueError(f"training.rank_resources names {name!r}: give custom resources only (CPU/GPU are set)")
        have = cluster.get(name, 0)
        if have < amount * num_processes:
            raise ValueError(
                f"training.rank_resources asks for {amount} {name!r} per rank x {num_processes} rank(s); the Ray "
                f"cluster offers {have}. Start the node meant for the learner with "
                f"`ray start ... --resources '{{\"{name}\": {amount * num_processes:g}}}'`"
            )
        bundle[name] = amount
    return bundle


def _watch_driver(pid: int, interval_s: float = 1.0) -> None:
    """Exit this rank when the driver process on this machine is gone (a local Ray only).

    A killed flow process does not always take Ray's raylet with it at once, and a rank busy in a torch step
    would keep training (and holding memory) for minutes. A daemon thread polls the driver's pid.
    """
    import threading

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, another user's: keep watching
                pass

    threading.Thread(target=watch, name="pettingflow-driver-watch", daemon=True).start()


class Learner:
    """The driver side of one policy's resident learner: start the ranks, hand them updates, restart them.

    ``update(spec)`` is what the ``update_policy`` task calls: it stages the output folder, runs the update
    on every rank, waits (optionally with a timeout) and returns rank 0's metrics plus ``wall_s``,
    ``log_path`` and ``learner`` (start count, pids). A dead or timed-out rank raises ``UpdateError`` with
    the log tails and marks the learner dead; the next call starts new ranks.
    """

    def __init__(
        self,
        policy: str,
        num_processes: int,
        log_dir: str | Path,
        *,
        num_cpus_per_rank: float = 1.0,
        omp_threads: int | None = None,
        name: str | None = None,
        master_host: str | None = None,
        malloc: MallocChoice = "auto",
        resources: dict[str, float] | None = None,
        localize: Callable[[UpdateSpec], UpdateSpec] | None = None,
        placement_wait_s: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """``master_host``: the address of the ranks' process group; None: rank 0's node address (a cluster).
        A local Ray passes 127.0.0.1 so that training traffic stays on loopback. ``resources``: custom Ray
        resources every rank asks for (``training.rank_resources``), which place the ranks on the nodes that
        offer them. ``localize``: how a rank on another node than this one makes its own copies of an update's start
        weights (``runs.lineage.localize_start``). ``placement_wait_s``: how long a restart (after a rank or its
        node was lost) waits for the cluster to offer the ranks' resources again. ``env``: more environment for the
        ranks' processes (Ray's ``runtime_env``; tests plant code with it)."""
        self.env = dict(env or {})
        self.resources = dict(resources or {})
        self.localize = localize
        self.placement_wait_s = placement_wait_s
        self.places: list[dict[str, Any]] = []  # per rank: node id and address, pid, log file (LearnerRank.where)
        self.policy = policy
        self.master_host = master_host
        self.num_processes = num_processes
        self.log_dir = Path(log_dir)
        self.num_cpus_per_rank = num_cpus_per_rank
        self.omp_threads = omp_threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        self.name = name or f"learner-{policy}"
        self.malloc = malloc
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.placement_group: Any = None
        self.starts = 0
        self.holds: str | None = None  # the weights the ranks hold, once an update of them succeeded
        self._joined = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return bool(self.actors)

    def log_paths(self) -> list[Path]:
        return [self.log_dir / f"{self.name}-rank{r}.log" for r in range(self.num_processes)]

    def start(self) -> Learner:
        """Create the rank actors (they start importing in the background; ``join`` happens on first use)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.actors:
            return self
        bundle = self._bundle()
        gpus = bundle.get("GPU", 0)
        self.placement_group = placement_group([bundle] * self.num_processes, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=max(120.0, self.placement_wait_s))
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
            raise UpdateError(
                f"learner {self.policy}: the Ray cluster could not place {self.num_processes} rank(s) of {bundle} "
                f"(free: {ray.available_resources()}); free resources, or lower training.num_processes"
            ) from None
        driver_node = ray.get_runtime_context().get_node_id()
        remote_cls = ray.remote(LearnerRank)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank, path in enumerate(self.log_paths()):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            actor = remote_cls.options(
                num_cpus=self.num_cpus_per_rank,
                num_gpus=gpus,
                resources=dict(self.resources) or None,
                scheduling_strategy=strategy,
                max_restarts=0,
                name=f"{self.name}-rank{rank}-{os.getpid()}-{self.starts}",
                # the allocator is chosen at process start: Ray launches the actor's worker with this env
                runtime_env={"env_vars": {**preload_env(self.malloc), **rank_cache_env(), **self.env}},
            ).remote(
                rank,
                self.num_processes,
                str(path),
                self.omp_threads,
                self._local_driver_pid(),
                driver_node,
                self.localize,
            )
            self.actors.append(actor)
        self.starts += 1
        self._joined = False
        if self.master_host == "127.0.0.1":  # a local Ray started by this process: its agents die with it too
            from pettingflow import deathsig

            deathsig.kill_with_this_process(deathsig.local_ray_processes())
        log.info("learner %s: started %d rank actor(s) (start #%d)", self.policy, self.num_processes, self.starts)
        return self

    def _bundle(self) -> dict[str, float]:
        """One rank's placement bundle (``rank_bundle``). A restart after a lost rank waits up to
        ``placement_wait_s`` for the cluster to offer the bundle's custom resources again (the lost node rejoining,
        or another node offering them); a first start says at once what the cluster lacks."""
        import ray

        deadline = time.monotonic() + (self.placement_wait_s if self.starts else 0.0)
        while True:
            try:
                return rank_bundle(ray.cluster_resources(), self.num_processes, self.num_cpus_per_rank, self.resources)
            except ValueError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning(
                    "learner %s: waiting for the cluster to offer the ranks' resources again: %s", self.policy, exc
                )
                time.sleep(5.0)

    def _local_driver_pid(self) -> int | None:
        """This process's pid when the ranks run on this machine (local Ray: master_host 127.0.0.1)."""
        return os.getpid() if self.master_host == "127.0.0.1" else None

    def _join(self) -> None:
        import ray

        self.places = ray.get([a.where.remote() for a in self.actors], timeout=600)
        host, port = ray.get(self.actors[0].address.remote(self.master_host))
        self.pids = ray.get([a.join.remote(host, port) for a in self.actors], timeout=600)
        self._joined = True
        for place in self.places:
            if place["away"]:
                log.info(
                    "learner %s: rank %d runs on node %s (not the flow's): it downloads its start weights and uploads "
                    "what it writes",
                    self.policy,
                    place["rank"],
                    place["node_ip"],
                )
        log.info(
            "learner %s: %d rank(s) joined at %s:%d, pids %s", self.policy, len(self.actors), host, port, self.pids
        )

    def stop(self) -> None:
        """Kill the rank actors and free their placement (their memory goes with them)."""
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor, no_restart=True)
        self.actors = []
        self.pids = []
        self.places = []
        self.holds = None
        self._joined = False
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    # ------------------------------------------------------------------ work
    def update(self, spec: UpdateSpec, timeout_s: float | None = None) -> dict[str, Any]:
        """Run ``spec`` on the resident ranks; returns rank 0's metrics (see the class docstring)."""
        if spec.training.num_processes != self.num_processes:
            raise ValueError(
                f"learner {self.policy} has {self.num_processes} rank(s), the spec asks for "
                f"{spec.training.num_processes}; start a new learner for a new training.num_processes"
            )
        started_now = not self.actors
        if started_now:
            self.start()
        stage = StagedOutput(spec)
        spec_json = stage.spec.model_dump_json()
        started = time.perf_counter()
        try:
            if not self._joined:
                self._join()
            refs = [a.update.remote(spec_json) for a in self.actors]
            results = self._wait(refs, timeout_s)
        except UpdateError:
            self.stop()
            raise
        except Exception as exc:  # a rank died (RayActorError) or raised inside the update (RayTaskError)
            raised = not _actor_lost(exc)
            lost = "" if raised else self._lost_nodes()
            tails = self.log_tails()
            self.stop()
            raise UpdateError(
                f"update of policy {spec.policy!r} failed in the resident learner: {_short(exc)}{lost}\n{tails}",
                1 if raised else None,
                str(self.log_paths()[0]),
            ) from exc
        wall = time.perf_counter() - started
        if not results[0].get("skipped"):
            self.holds = spec.weights_uri
        uploaded = [e for r in results for e in r.pop(UPLOADED_KEY, [])]
        self._write_update_log([r.pop(LOG_KEY, "") for r in results], stage.local_out / LOG_FILE)
        metrics = stage.finish(results[0], log_name=LOG_FILE)
        if uploaded:
            metrics[UPLOADED_KEY] = uploaded
        metrics["wall_s"] = round(wall, 3)
        metrics["learner"] = {"starts": self.starts, "started_for_this_update": started_now, "pids": self.pids}
        log.info(
            "learner %s: update done in %.1f s (%s, optimizer %s)",
            self.policy,
            wall,
            "skipped: no trainable rows" if metrics.get("skipped") else f"loss={metrics.get('loss')}",
            metrics.get("optimizer_state"),
        )
        return metrics

    def _wait(self, refs: list[Any], timeout_s: float | None) -> list[dict[str, Any]]:
        """All ranks' results; the first failure (or the timeout) stops waiting at once, so a dead rank never
        leaves the others blocked in a collective with nobody noticing."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            wait_s = 5.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
            done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            for ref in done:
                ray.get(ref)  # raises the rank's error
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise UpdateError(
                    f"update of policy {self.policy!r} timed out after {timeout_s} s in the resident learner\n"
                    f"{self.log_tails()}",
                    None,
                    str(self.log_paths()[0]),
                )
        return ray.get(refs)

    def save_optimizer(
        self,
        out_dir: str,
        weights_uri: str,
        timeout_s: float | None = None,
        out_uri: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Every rank writes its part of the optimizer snapshot of the weights named ``weights_uri`` into ``out_dir``
        (a folder on this machine; rank 0's metrics are returned). Ray runs an actor's calls one at a time, so an
        update asked for meanwhile starts after the snapshot: the state saved is always the one of ``weights_uri``.
        Called from a background thread (``steps.updates.snapshot_in_background``). Ranks on other nodes upload
        their parts to ``out_uri`` (remote storage); the entries come back under ``uploaded``."""
        refs = [a.save_optimizer.remote(out_dir, weights_uri, out_uri, storage_options) for a in self.actors]
        try:
            results = self._wait(refs, timeout_s)
            uploaded = [e for r in results for e in r.get(UPLOADED_KEY, [])]
            return {**{k: v for k, v in results[0].items() if k != UPLOADED_KEY}, UPLOADED_KEY: uploaded}
        except UpdateError:
            raise
        except Exception as exc:
            raise UpdateError(
                f"optimizer snapshot of policy {self.policy!r} failed in the resident learner: {_short(exc)}",
                None,
                str(self.log_paths()[0]),
            ) from exc

    def push_weights(self, url: str, backend: str, host: str = "127.0.0.1") -> dict[str, Any]:
        """Broadcast rank 0's weights into the server at ``url`` (see ``LearnerRank.push_weights``)."""
        import ray

        if self.num_processes != 1:
            raise ValueError("weight broadcast is wired for one training rank; use inference.weight_sync=disk")
        return ray.get(self.actors[0].push_weights.remote(url, backend, host), timeout=600)

    @staticmethod
    def _write_update_log(texts: list[str], target: Path) -> None:
        """This update's lines of every rank's log (each rank returns its own: a rank on another node writes its
        log file there) into the step's ``worker.log``."""
        with open(target, "w") as out:
            out.writelines(texts)

    def call(self, method: str, rank: int = 0) -> Any:
        """Call a ``LearnerRank`` method on one rank (inspection and tests)."""
        import ray

        return ray.get(getattr(self.actors[rank], method).remote())

    def call_all(self, method: str) -> list[Any]:
        """Call a ``LearnerRank`` method on every rank at once (methods with a collective inside)."""
        import ray

        return ray.get([getattr(a, method).remote() for a in self.actors])

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of every rank's log: read here, or asked of the rank when its log is on another node."""
        import ray

        out = []
        for rank, path in enumerate(self.log_paths()):
            place = self.places[rank] if rank < len(self.places) else {}
            if place.get("away"):
                try:
                    text = ray.get(self.actors[rank].log_tail.remote(lines), timeout=10)
                except Exception:  # the rank or its node is gone
                    text = "(unreachable: the rank's log stays on its node)"
                out.append(f"--- {place['log_path']} on node {place['node_ip']}\n{text}")
            else:
                out.append(f"--- {path}\n" + _tail(path, lines))
        return "\n".join(out)

    def _lost_nodes(self, wait_s: float = 45.0) -> str:
        """A sentence naming the ranks that were lost and how ("" when every rank still answers).

        Each rank is pinged: one that answers is fine; one whose actor is dead (``ActorDiedError``) died, on a
        node that may be alive (killed, out of memory) or gone; one that does not answer within seconds is
        unreachable, and since the cluster marks a node dead only after its health checks fail (tens of seconds),
        this then waits up to ``wait_s`` for that verdict, to say "left the cluster" rather than guess."""
        import ray

        if not self.places:
            return ""
        pings = [a.where.remote() for a in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=5.0)
        died, unreachable = [], []
        for place, ref in zip(self.places, pings, strict=True):
            if ref in ready:
                try:
                    ray.get(ref)
                    continue  # answered: not lost
                except ray.exceptions.ActorDiedError:
                    died.append(place)
                    continue
                except Exception:  # unavailable: maybe its node is going
                    pass
            unreachable.append(place)
        if not died and not unreachable:
            return ""
        suspects = died + unreachable
        # a dead actor is also what a node loss looks like before the cluster has marked the node dead (its health
        # checks take ~15 s to fail): wait for that verdict too, less long
        deadline = time.monotonic() + (wait_s if unreachable else min(wait_s, 20.0))
        while True:
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception:
                alive = {p["node_id"] for p in suspects}
            gone = [p for p in suspects if p["node_id"] not in alive]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(1.0)

        def name(p: dict[str, Any]) -> str:
            return f"rank {p['rank']} on node {p['node_ip']} (id {p['node_id'][:12]})"

        if gone:
            what = (
                f"lost node: {', '.join(map(name, gone))} left the Ray cluster (its raylet died or stopped answering)"
            )
        elif died:
            ranks = ", ".join(map(name, died))
            what = f"lost rank: {ranks}: its process died (the node is alive: killed, or out of memory?)"
        else:
            ranks = ", ".join(map(name, unreachable))
            what = f"lost rank: {ranks} stopped answering (its node still alive after {wait_s:.0f} s)"
        wanted = self.resources or {"CPU": self.num_cpus_per_rank}
        return (
            f"; {what}. The retry places the learner again once the cluster offers its resources ({wanted}), "
            f"waiting up to {self.placement_wait_s:.0f} s"
        )


def _actor_lost(exc: BaseException) -> bool:
    """Whether a rank's actor died or became unreachable (its process or node is gone), as opposed to raising."""
    import ray

    return isinstance(exc, ray.exceptions.RayActorError)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _read_from(path: Path, offset: int) -> str:
    """The text of ``path`` from byte ``offset`` on ("" when there is no file)."""
    if not path.is_file():
        return ""
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def _tail(path: Path, lines: int) -> str:
    tail: collections.deque[str] = collections.deque(maxlen=lines)
    if path.is_file():
        with open(path, errors="replace") as f:
            tail.extend(line.rstrip("\n") for line in f)
    return f"(last {len(tail)} lines)\n" + "\n".join(tail)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


#: Ray CPUs a one-shot update's rank books: next to none. It ran as a plain process before it ran in Ray actors,
#: beside whatever holds the Ray's CPUs (a run's rollout actors), and it must still start then.
ONE_SHOT_CPUS_PER_RANK = 0.01


def run_update(
    spec: UpdateSpec, *, timeout_s: float | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the update ``spec`` describes in a learner of its own and return rank 0's metrics.

    The learner (``training.learner.Learner``: ``training.num_processes`` Ray actors, one torch.distributed group)
    is started for this update and stopped after it, so every update, one-shot or resident, runs the same rank
    code. Its ranks run on this machine (pinned to this Ray node, ``127.0.0.1`` for their process group) and book
    next to no Ray CPUs (``ONE_SHOT_CPUS_PER_RANK``). It uses the Ray this process is connected to, or starts a
    local one (as many logical CPUs as cores, at least ranks + 1, without Ray's memory monitor) and shuts it down
    after. ``env``: more environment for the ranks' processes (their ``OMP_NUM_THREADS`` from there, else from this
    process, else 1).

    The returned dict is ``metrics.json`` plus ``out_dir``, ``log_path`` and ``wall_s`` (from the ranks joining
    their group to the end of the update). ``metrics["skipped"]`` is true when the batch had no trainable rows (no
    weights are written then; keep using the previous ones). Raises ``UpdateError`` with the ranks' log tails on
    failure or timeout; their log files are then kept (``log_path``), and removed after a success (``worker.log``
    holds their lines).
    """
    import ray

    from pettingflow.ray_cluster import init_ray

    n = spec.training.num_processes
    owns_ray = not ray.is_initialized()
    if owns_ray:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # no Ray memory monitor: it kills a worker once the node's memory use passes 95 %, whoever uses it, where
        # the plain process this replaced met only the kernel's OOM killer (seen on a shared machine)
        init_ray(
            num_cpus=max(os.cpu_count() or 1, n + 1),
            include_dashboard=False,
            log_to_driver=False,
            _system_config={"memory_monitor_refresh_ms": 0},
        )
    env = dict(env or {})
    log_dir = tempfile.mkdtemp(prefix="pettingflow-update-logs-")
    learner = Learner(
        spec.policy,
        n,
        log_dir,
        name=f"update-{spec.policy}",
        num_cpus_per_rank=ONE_SHOT_CPUS_PER_RANK,
        omp_threads=int(env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 1),
        master_host="127.0.0.1",
        malloc=spec.training.malloc,
        resources={f"node:{ray.util.get_node_ip_address()}": ONE_SHOT_CPUS_PER_RANK},
        env=env,
    )
    try:
        metrics = learner.update(spec, timeout_s=timeout_s)
        metrics.pop("learner", None)  # a learner of one update: its start count and pids say nothing
    finally:
        learner.stop()
        if owns_ray:
            ray.shutdown()
    shutil.rmtree(log_dir, ignore_errors=True)
    return metrics
