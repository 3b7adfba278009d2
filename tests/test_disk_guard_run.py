"""A full disk is a clean stop, on a real filesystem of fixed size with a real run.

``pettingflow train`` (the train flow: Prefect, the code env's sandbox, the resident DeepSpeed learner on a tiny
model; the scripted LLM server of tests/test_flows.py) writes into a 256 MiB tmpfs mounted in a private mount
namespace (``unshare``; skipped where the kernel refuses it). tests/disk_guard_scenario.py fills it so that
iteration 1's update does not fit: the run must stop there with the guard's one message, nothing of the update
written, then finish once space is freed, redoing nothing that was committed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_flows import overrides, scripted  # noqa: F401 (scripted: the module's scripted LLM server)

from pettingflow.runs.retention import RETENTION_BY

SIZE = "256m"
SCENARIO = Path(__file__).with_name("disk_guard_scenario.py")


def namespace() -> list[str]:
    """The command prefix that runs a command in a private mount namespace where it may mount a tmpfs."""
    return ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])


def can_mount_tmpfs(where: Path) -> str | None:
    """None when a tmpfs can be mounted at ``where`` in a private mount namespace, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    probe = subprocess.run(
        [*namespace(), "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


@pytest.mark.slow  # three short runs of `pettingflow train` (about 2-3 minutes on 2 cores)
def test_a_run_on_a_full_disk_stops_at_a_step_boundary_and_resumes(tmp_path, prefect_env, tiny_model, scripted) -> None:  # noqa: F811
    from prefect.settings import PREFECT_API_URL

    root = tmp_path / "small"
    root.mkdir()
    why = can_mount_tmpfs(root)
    if why:
        pytest.skip(why)
    run_overrides = [
        o
        for o in overrides(tmp_path, tiny_model, scripted.url)
        if not o.startswith(("run.storage_root=", "run.iterations="))
    ]
    run_overrides += [
        "validation.frequency=0",
        "training.replay_snapshots=0",  # every update writes a snapshot (save_optimizer_every=1), only the newest stays
        "training.save_optimizer_every=1",
        "disk.keep_last_updates=1",
    ]
    out = tmp_path / "seen.json"
    script = f'mount -t tmpfs -o size={SIZE} tmpfs {root} && exec {sys.executable} {SCENARIO} {root} {out} "$0"'
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run(
        [*namespace(), "sh", "-c", script, json.dumps(run_overrides)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    seen = json.loads(out.read_text())
    assert seen["size"] == 256 * 2**20  # the run wrote into the small filesystem

    stopped = seen["stopped"]
    assert stopped["returncode"] == 3, stopped["stderr"]
    message = stopped["stderr"]
    assert "not enough free disk for step update-shared of iteration 1 of run guarded" in message, message
    assert f"{root}/runs/guarded has " in message and " free, the step needs about " in message
    assert "what update-shared and its snapshot wrote at iteration 0" in message
    assert f"`pettingflow runs prune guarded --root {root} --keep-last 1 --yes`" in message
    assert "Traceback" not in message  # one message, not a crash
    # stopped at the step boundary: iteration 0 whole, iteration 1 up to its advantages, nothing of the update
    assert all(stopped["steps"]["0"].values()) and "update-shared" in stopped["steps"]["0"]
    assert stopped["steps"]["1"] == {"rollouts": True, "filtered": True, "advantages": True}

    assert seen["prune"]["returncode"] == 0, seen["prune"]  # the command the message names works

    resumed = seen["resumed"]
    assert resumed["returncode"] == 0, resumed["tail"]
    assert all(resumed["steps"]["1"].values()) and "update-shared" in resumed["steps"]["1"]
    # retention after iteration 1 (keep_last_updates 1): update 0's weights and snapshot went, update 1's stay
    assert not [f for f in resumed["update0_files"] if f.startswith(("model/", "deepspeed/"))]
    assert "metrics.json" in resumed["update0_files"] and resumed["update0_pruned"][-1]["by"] == RETENTION_BY
    assert "model/model.safetensors" in resumed["update1_files"]
