"""A bounded log file for a long-lived process's output: ``cmd 2>&1 | python -m pettingflow.logcap FILE``.

Why: the Prefect server (3.7 on SQLite) logs a ``database is locked`` traceback on about every worker poll, a
Prefect bug (docs/flows.md), so its log grows ≈ 230 MB a day for as long as a run lasts and nothing else in a run
grows like it. Prefect has no setting that rotates the server's own output, so ``make run`` and the soak pipe it
through this: the newest ``--max-mb`` stay in FILE, the ones before in FILE.1 .. FILE.<backups>, and older output
is dropped, so the log never takes more than ``max_mb * (backups + 1)``. Rotation is the standard library's
:class:`logging.handlers.RotatingFileHandler`; this module only feeds it lines.

Every file this writes starts with one header line (``===== logcap {...}``; a restart appends one to the live
file) saying when it was opened, how many bytes and lines this process wrote before it, and how many lines in
all matched each ``--count`` pattern (carried over a restart): a long run's error rate stays measurable after
the lines that carried it are gone (:func:`count_in_log` reads it back).

It exits when its input closes (the process it logs has ended) and ignores SIGINT, SIGHUP and SIGTERM, so a
Ctrl-C meant for the terminal that started the process does not leave that process writing into a closed pipe;
stop the process, and this ends after its last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import signal
import sys
import time
from pathlib import Path

HEADER = "===== logcap "


class CappedLog(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler whose every new file opens with the header line (counts so far)."""

    def __init__(self, path: Path, max_bytes: int, backups: int, patterns: list[str]) -> None:
        self.patterns = patterns
        self.counts = {pattern: count_in_log(path, pattern) for pattern in patterns}  # a restart continues them
        self.bytes_written = 0
        self.lines_written = 0
        self.rotations = 0
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=False)
        self.setFormatter(logging.Formatter("%(message)s"))
        self._write_header()

    def _write_header(self) -> None:
        header = {
            "opened": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rotations": self.rotations,
            "bytes_before": self.bytes_written,
            "lines_before": self.lines_written,
            "counts": [[pattern, n] for pattern, n in self.counts.items()],
        }
        if self.stream is not None:
            self.stream.write(HEADER + json.dumps(header) + "\n")
            self.stream.flush()

    def doRollover(self) -> None:  # the stdlib handler's name
        super().doRollover()
        self.rotations += 1
        self._write_header()

    def write_line(self, line: str) -> None:
        # emit first: a rotation it triggers writes the new file's header, which must not count this line yet
        self.emit(logging.LogRecord("logcap", logging.INFO, "", 0, line, None, None))
        for pattern in self.patterns:
            if pattern in line:
                self.counts[pattern] += 1
        self.bytes_written += len(line.encode("utf-8", "replace")) + 1
        self.lines_written += 1


def count_in_log(path: Path, pattern: str) -> int:
    """Lines matching ``pattern`` since the log began: the last header's count plus the matches after it.

    A plain log (no header) is just counted; a pattern logcap was not told to count is counted in the live
    file only, from its last header on."""
    if not path.exists():
        return 0
    total = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(HEADER):
                counts = dict(json.loads(line[len(HEADER) :]).get("counts", []))
                total = int(counts.get(pattern, 0))
            elif pattern in line:
                total += 1
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pettingflow.logcap", description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, help="the log file (its backups are PATH.1 .. PATH.<backups>)")
    p.add_argument("--max-mb", type=float, default=20.0, help="size of one file before it rotates (default 20)")
    p.add_argument("--backups", type=int, default=2, help="rotated files kept (default 2)")
    p.add_argument(
        "--count", action="append", default=[], metavar="PATTERN", help="count lines holding PATTERN (repeatable)"
    )
    args = p.parse_args(argv)
    if args.max_mb <= 0 or args.backups < 1:
        p.error(f"--max-mb must be > 0 and --backups >= 1 (got {args.max_mb}, {args.backups})")
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    log = CappedLog(args.path, int(args.max_mb * 2**20), args.backups, args.count)
    stdin = open(sys.stdin.fileno(), encoding="utf-8", errors="replace", newline=None, closefd=False)  # noqa: SIM115
    for line in stdin:  # one line at a time, flushed: `tail -f` sees the process's output as it comes
        log.write_line(line.rstrip("\n"))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
