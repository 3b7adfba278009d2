"""A real training run on a filesystem of fixed size, stopped by the disk guard and resumed (run by
tests/test_disk_guard_run.py inside a private mount namespace whose tmpfs is ``root``; not a test itself).

1. probe: the same config for one iteration (another run id), to measure what an iteration writes on this machine
   (dtype and snapshot size vary); then deleted;
2. a ballast file leaves free space such that iteration 0 fits and iteration 1's update does not: what update 0
   and its snapshot wrote, plus the margin, minus half of it;
3. ``pettingflow train`` (2 iterations): stops at iteration 1's update with the guard's message, exit code 3;
4. the command the message names (``pettingflow runs prune ... --yes``) runs, and the ballast goes (space freed);
5. ``pettingflow train ... --run-id`` resumes: the run finishes, and retention (keep_last_updates 1) removed
   update 0's weights after iteration 1.

Writes what it saw as JSON to ``out``; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pettingflow.runs.disk_guard import written
from pettingflow.storage import RunLayout

MARGIN_MB = 2


def train(cli: str, overrides: list[str], run_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [cli, "train", "code-env", *overrides, "--run-id", run_id], capture_output=True, text=True, timeout=900
    )


def free(root: Path) -> int:
    return shutil.disk_usage(root).free


def steps_of(layout: RunLayout, k: int) -> dict[str, bool]:
    """Every folder of iteration k: committed or not."""
    path = Path(layout.iteration_path(k))
    if not path.exists():
        return {}
    return {p.name: layout.step(k, p.name).is_committed() for p in sorted(path.iterdir()) if p.is_dir()}


def main(root: Path, out: Path, base_overrides: list[str]) -> None:
    cli = str(Path(sys.executable).parent / "pettingflow")
    overrides = [f"run.storage_root={root}", f"disk.margin_mb={MARGIN_MB}", *base_overrides]
    seen: dict[str, object] = {"size": shutil.disk_usage(root).total}

    # 1. probe: what one iteration writes here
    before = free(root)
    probe = train(cli, [*overrides, "run.iterations=1"], "probe")
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    layout = RunLayout(str(root), "probe")
    update = written(layout.step(0, "update-shared")) or 0
    snapshot = written(layout.step(0, "optimizer-shared")) or 0
    small = sum(written(layout.step(0, name)) or 0 for name in ("rollouts", "filtered", "advantages"))
    seen["probe"] = {"consumed": before - free(root), "update": update, "snapshot": snapshot, "small": small}
    shutil.rmtree(layout.run_path)

    # 2. ballast: at iteration 1's update, what iteration 0 consumed and iteration 1's first steps are gone, and
    # half of what update 0 wrote (with its snapshot) is missing from what the guard asks for
    target = seen["probe"]["consumed"] + 2 * small + MARGIN_MB * 2**20 + (update + snapshot) // 2  # type: ignore[operator]
    ballast = root / "ballast.bin"
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free(root) - target)
    seen["free_at_start"] = free(root)

    # 3. the run stops at the guard
    stopped = train(cli, [*overrides, "run.iterations=2"], "guarded")
    layout = RunLayout(str(root), "guarded")
    seen["stopped"] = {
        "returncode": stopped.returncode,
        "stderr": stopped.stderr[-4000:],
        "steps": {k: steps_of(layout, k) for k in (0, 1)},
        "free": free(root),
    }

    # 4. free space: the command the message names, then the ballast
    command = re.search(r"`(pettingflow runs prune [^`]+)`", stopped.stderr)
    if command:
        words = command.group(1).split()
        prune = subprocess.run([cli, *words[1:]], capture_output=True, text=True, timeout=300)
        seen["prune"] = {"command": command.group(1), "returncode": prune.returncode, "stdout": prune.stdout[-2000:]}
    ballast.unlink()

    # 5. resume
    resumed = train(cli, [*overrides, "run.iterations=2"], "guarded")
    seen["resumed"] = {
        "returncode": resumed.returncode,
        "tail": (resumed.stdout + resumed.stderr)[-3000:],
        "steps": {k: steps_of(layout, k) for k in (0, 1)},
        "update0_files": layout.step(0, "update-shared").files()
        if layout.step(0, "update-shared").is_committed()
        else None,
        "update0_pruned": layout.step(0, "update-shared").pruned()
        if layout.step(0, "update-shared").is_committed()
        else None,
        "update1_files": layout.step(1, "update-shared").files()
        if layout.step(1, "update-shared").is_committed()
        else None,
        "rollouts_committed_at": [
            layout.step(k, "rollouts").manifest().committed_at
            for k in (0, 1)
            if layout.step(k, "rollouts").is_committed()
        ],
    }
    out.write_text(json.dumps(seen, indent=2, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
