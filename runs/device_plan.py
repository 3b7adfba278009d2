"""Which devices each process of a policy gets: its inference replicas' and its learner ranks' (pure).

Why a plan: on a GPU machine vLLM and DeepSpeed each assume a device is theirs. Disjoint sets (``learning`` and
``inference`` with no device in common) are what async rollouts want: generation goes on while the learner
trains. Overlapping sets work only when the servers give their devices up during each update (vLLM's sleep
mode, or a restart) or when the config says both fit in memory at once; pausing a process keeps its GPU memory.
On a CPU the devices are cores, and the same plan binds each replica to its own block of cores (a paused
server's cores are free, so there overlap is fine).

``plan_devices`` only decides; ``inference.server`` applies a replica's part (``CUDA_VISIBLE_DEVICES`` and
``--tensor-parallel-size`` on a GPU, the core list on a CPU). The learner's ranks take one device each from
``learning``; Ray places them (one GPU per rank bundle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FREEING_MODES = ("sleep", "restart")  # between_updates modes that give a GPU's memory up during the update


class DevicePlanError(ValueError):
    """The devices asked for cannot hold the processes asked for; the message says what to change."""


@dataclass(frozen=True)
class DevicePlan:
    """Device ids per inference replica (``tensor_parallel`` each) and per learner rank; ``shared``: the two
    sets overlap (the servers must free them during updates, or both fit)."""

    replicas: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]
    tensor_parallel: int
    shared: bool


def plan_devices(
    device: str,
    available: Sequence[int],
    *,
    replicas: int,
    ranks: int,
    learning: Sequence[int] | None = None,
    inference: Sequence[int] | None = None,
    between_updates: str = "keep",
    async_rollouts: bool = False,
    both_fit: bool = False,
) -> DevicePlan:
    """The plan for ``replicas`` inference replicas and ``ranks`` learner ranks over ``available`` devices (GPU
    ids for ``device == "cuda"``, core ids for ``"cpu"``). ``learning`` / ``inference``: the devices each side
    may use (None: all of ``available``). Inference devices are split evenly over the replicas, each replica's
    block its tensor-parallel size; each rank takes one learning device."""
    if device not in ("cuda", "cpu"):
        raise DevicePlanError(f"device must be cuda or cpu, got {device!r}")
    if replicas < 1 or ranks < 1:
        raise DevicePlanError(f"replicas and ranks must be >= 1, got {replicas} and {ranks}")
    pool = list(dict.fromkeys(available))
    if not pool:
        raise DevicePlanError(f"no {device} devices available")
    learn = _within(learning, pool, "resources.learning_devices")
    serve = _within(inference, pool, "resources.inference_devices")
    if len(serve) < replicas or len(serve) % replicas:
        raise DevicePlanError(
            f"{len(serve)} inference device(s) {serve} cannot be split evenly over {replicas} replica(s): give "
            f"resources.inference_devices a multiple of inference.replicas"
        )
    if device == "cuda" and ranks > len(learn):
        raise DevicePlanError(
            f"training.num_processes={ranks} ranks need one GPU each, resources.learning_devices has {len(learn)}"
        )
    per = len(serve) // replicas
    blocks = tuple(tuple(serve[r * per : (r + 1) * per]) for r in range(replicas))
    rank_devices = tuple(learn[k % len(learn)] for k in range(ranks))
    shared = bool(set(learn) & set(serve))
    if shared and device == "cuda" and not both_fit:
        if async_rollouts:
            raise DevicePlanError(
                "rollout.async_rollouts generates during each update, but the learning and inference GPUs "
                f"overlap ({sorted(set(learn) & set(serve))}): make resources.learning_devices and "
                "inference_devices disjoint, or set resources.both_fit: true if both fit in memory at once"
            )
        if between_updates not in FREEING_MODES:
            raise DevicePlanError(
                f"the learning and inference GPUs overlap ({sorted(set(learn) & set(serve))}) and "
                f"inference.between_updates={between_updates} keeps the servers' memory during updates: use sleep "
                "or restart, make the device sets disjoint, or set resources.both_fit: true"
            )
    return DevicePlan(blocks, rank_devices, per if device == "cuda" else 1, shared)


def devices_overlap(
    available: Sequence[int], learning: Sequence[int] | None = None, inference: Sequence[int] | None = None
) -> bool:
    """Whether the learner's devices and the servers' share one (each side: ``available`` when not given), as the
    plan will have it: what ``between_updates: auto`` must know before the plan is made (a shared GPU needs the
    servers asleep during updates)."""
    pool = list(dict.fromkeys(available))
    learn = list(learning) if learning is not None else pool
    serve = list(inference) if inference is not None else pool
    return bool(set(learn) & set(serve))


def _within(wanted: Sequence[int] | None, pool: list[int], key: str) -> list[int]:
    if wanted is None:
        return pool
    chosen = list(dict.fromkeys(wanted))
    missing = [d for d in chosen if d not in pool]
    if missing or not chosen:
        raise DevicePlanError(f"{key}={list(wanted)}: devices {missing or chosen} are not among the available {pool}")
    return chosen
