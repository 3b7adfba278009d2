"""The program that runs in the sandbox: a trusted judge, and the runner that holds the model's code.

``program.build_program`` sends this file's text as the sandbox's main program and the jobs' spec (tests,
expected values, the result marker) on its stdin. One file plays two roles:

* **the judge** (``python3 -I main.py``): reads the spec from stdin, drains it, makes itself non-dumpable (so
  no other process of the sandbox uid can read its memory, its descriptors or its environment through /proc or
  ptrace), then, per job, starts a **runner** and evaluates every case itself. It prints one line per job behind
  the marker as the job ends; nothing else reaches stdout.
* **the runner**: a process forked per job by the **zygote**, a clean child the judge forks before it reads
  its spec (so neither holds a test, an expected value or the marker); as a fallback, a fresh interpreter
  (``python3 -I main.py --runner FD``). It has /dev/null on fds 0-2 and one socket, its only channel. It loads
  the problem's prompt and the model's solution, then answers calls of the entry point: arguments in, the return
  value out as plain data (``encode``/``decode``), or the exception's class name and message.

What it costs, and how that is kept small (``bench/reward_boundary.py`` measures it against the single-process
harness it replaced): the file imports only what every run needs (``_socket``, not ``socket``; no ``typing``,
``contextlib``, ``ast`` or ``ctypes``: each is milliseconds at every sandbox start); the zygote pre-imports
the modules the prompts import, so each runner starts with them loaded; and a job's runner is forked and loads
its solution while the judge sets up the job's checks (``Runner.begin``/``finish``).

Why two processes: when model code shares a process with the tests, it can return an object equal to
everything, write "passed" records to the result channel, or read the expected values out of memory. Here
the judge compares plain values it decoded itself, with tests that never left its process; what the runner
sends can at worst be a wrong answer. Model-written tests are not executed at all: ``suites.py`` parses them
into call cases (the grammar of docs/code-env.md) that the judge evaluates. Ground-truth suites (HumanEval's
``check`` bodies) run in the judge, with ``candidate`` a proxy whose calls cross to the runner.

It must stay stdlib-only and importable by the sandbox's system ``python3``, which may be older than the
project's: no ``match``, no ``zip(strict=)``, and annotations stay strings (``from __future__ import
annotations``). Never run ``main`` or ``clean_slate`` outside a sandbox: ``clean_slate`` kills every process
it may signal and empties the working folder, /tmp and /dev/shm.
"""

from __future__ import annotations

import _socket  # not ``socket``: its wrapper module (enums, selectors) costs 2-3 ms at every sandbox start
import builtins
import json
import os
import signal
import sys
import time

TYPE_CHECKING = False  # ``typing`` itself is not imported: annotations stay strings
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

#: Bytes of one encoded value (a call's arguments or its return value) at most; a bigger one fails the case.
MAX_VALUE_BYTES = 1 << 20
#: Nesting depth of a plain value at most (lists in lists ...).
MAX_DEPTH = 64
#: Integers at most this large travel as JSON numbers; larger ones as hex text (no 4300-digit str limit).
_SMALL_INT = 1 << 63
_HEADER_BYTES = 4  # a message is its length (4 bytes, big-endian), then that many bytes of JSON
#: Seconds the judge waits for the zygote to fork a runner before it starts one as a fresh interpreter.
FORK_TIMEOUT_S = 2.0
#: A runner's load message at most this big is queued on its socket before it exists (a Unix socket's buffer
#: holds far more), so that sending it never waits for the runner.
PIPELINE_BYTES = 64 * 1024


# --------------------------------------------------------------------------------------------------
# plain data: the only values that cross between the runner and the judge
# --------------------------------------------------------------------------------------------------
class NotPlain(ValueError):
    """A value that is not plain data (or too big, or too deep) to cross the process boundary."""


def encode(value: Any) -> Any:
    """A JSON-ready form of a plain value: None, bool, int, float, str and lists are JSON's own; tuple, set,
    frozenset, dict, bytes and big ints are one-key objects ``{"t"|"s"|"f"|"d"|"b"|"i": ...}``.

    Types are checked exactly (``type(v) is int``): a subclass of int or str may override ``__eq__``, so it is
    refused, not converted. Raises ``NotPlain`` naming the first value that is not plain."""
    budget = [MAX_VALUE_BYTES]

    def spend(n: int) -> None:
        budget[0] -= n
        if budget[0] < 0:
            raise NotPlain(f"a value larger than {MAX_VALUE_BYTES} bytes")

    def enc(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise NotPlain(f"a value nested deeper than {MAX_DEPTH} levels")
        t = type(v)
        if v is None or t is bool or t is float:
            spend(8)
            return v
        if t is int:
            if -_SMALL_INT < v < _SMALL_INT:
                spend(8)
                return v
            text = hex(v)
            spend(len(text))
            return {"i": text}
        if t is str:
            spend(len(v) + 2)
            return v
        if t is bytes:
            import base64  # here, not at the top: every import is paid at each sandbox start

            spend(len(v) * 4 // 3 + 4)
            return {"b": base64.b64encode(v).decode("ascii")}
        if t is list:
            spend(2)
            return [enc(x, depth + 1) for x in v]
        if t is tuple:
            spend(8)
            return {"t": [enc(x, depth + 1) for x in v]}
        if t is set or t is frozenset:
            spend(8)
            return {"s" if t is set else "f": [enc(x, depth + 1) for x in v]}
        if t is dict:
            spend(8)
            return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        raise NotPlain("a value of type " + _type_name(v) + ", not plain data")

    return enc(value, 0)


def decode(data: Any) -> Any:
    """The plain value of an ``encode`` form, built from builtin types only; ``NotPlain`` for anything else.

    This is the trust boundary: whatever the runner sent, the judge gets back None, bool, int, float, str,
    bytes, list, tuple, set, frozenset or dict, nested."""

    def dec(d: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise NotPlain(f"a value nested deeper than {MAX_DEPTH} levels")
        t = type(d)
        if d is None or t is bool or t is int or t is float or t is str:
            return d
        if t is list:
            return [dec(x, depth + 1) for x in d]
        if t is dict and len(d) == 1:
            ((tag, body),) = d.items()
            if tag == "i" and type(body) is str:
                return int(body, 16)
            if tag == "b" and type(body) is str:
                import base64

                return base64.b64decode(body.encode("ascii"), validate=True)
            if type(body) is list:
                if tag == "t":
                    return tuple(dec(x, depth + 1) for x in body)
                if tag == "s":
                    return {dec(x, depth + 1) for x in body}
                if tag == "f":
                    return frozenset(dec(x, depth + 1) for x in body)
                if tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
                    return {dec(k, depth + 1): dec(x, depth + 1) for k, x in body}
        raise NotPlain("not an encoded plain value")

    try:
        return dec(data, 0)
    except NotPlain:
        raise
    except (TypeError, ValueError, RecursionError) as exc:  # an unhashable set member, bad base64 ...
        raise NotPlain("not an encoded plain value (" + type(exc).__name__ + ")") from None


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else t.__module__ + "." + t.__qualname__


def frame(obj: Any) -> bytes:
    """``obj`` as one message: its JSON's length (4 bytes, big-endian), then the JSON."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return len(data).to_bytes(_HEADER_BYTES, "big") + data


def send_message(sock: _socket.socket, obj: Any) -> None:
    sock.sendall(frame(obj))


def _recv_exact(sock: _socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 16))
        except ConnectionResetError:  # the peer exited with our messages unread (calls sent ahead): closed too
            chunk = b""
        if not chunk:
            raise EOFError("the channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: _socket.socket, limit: int) -> Any:
    """One length-prefixed JSON message; ``NotPlain`` when it announces more than ``limit`` bytes."""
    n = int.from_bytes(_recv_exact(sock, _HEADER_BYTES), "big")
    if n > limit:
        raise NotPlain(f"a message of {n} bytes (the limit is {limit})")
    return json.loads(_recv_exact(sock, n))


_FD_BYTES = 4  # one file descriptor in an SCM_RIGHTS message: a C int


def _fd_bytes(fd: int) -> bytes:
    return fd.to_bytes(_FD_BYTES, sys.byteorder, signed=True)


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried (``socket.recv_fds`` without importing ``socket``)."""
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_BYTES
            fds += [
                int.from_bytes(data[i : i + _FD_BYTES], sys.byteorder, signed=True) for i in range(0, usable, _FD_BYTES)
            ]
    return fds


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------
# the runner: the model's side of the boundary
# --------------------------------------------------------------------------------------------------
def describe(exc: BaseException) -> str:
    """A short error text for a case: the exception's type and message, cut at 300 characters."""
    if isinstance(exc, _Timeout):
        return "timed out"
    if isinstance(exc, CandidateError):
        return str(exc)[:300]
    text = type(exc).__name__
    try:
        msg = str(exc)
    except BaseException:
        msg = "(its message could not be shown)"
    if msg:
        text += ": " + msg
    return text[:300]


def runner_main(fd: int) -> None:
    """Load the solution, then answer calls until the channel closes. Everything the model's code can reach
    here is its own: the prompt, its solution, the arguments of the calls, and this socket."""
    sock = _socket.socket(fileno=fd)
    ns: dict[str, Any] = {"__name__": "__pettingflow_solution__"}
    load = recv_message(sock, 1 << 30)
    entry = load["entry_point"]
    error = None
    try:
        if load["context"]:
            try:
                exec(compile(load["context"], "<prompt>", "exec"), ns)
            except Exception:  # a prompt that fails to run still defines what it can
                pass
            ns.pop(entry, None)
        exec(compile(load["solution"], "<solution>", "exec"), ns)
        if not callable(ns.get(entry)):
            error = "the solution does not define a function named " + entry
    except BaseException as exc:
        error = "the solution failed to load: " + describe(exc)
    send_message(sock, {"setup_error": error})
    fn = ns.get(entry)
    while True:
        try:
            msg = recv_message(sock, 1 << 30)
        except EOFError:
            return
        try:
            args = decode(msg["args"])
            kwargs = decode(msg["kwargs"])
            value = fn(*args, **kwargs)
        except BaseException as exc:
            reply: dict[str, Any] = {"raised": [type(exc).__name__, describe(exc)]}
        else:
            try:
                reply = {"value": encode(value)}
            except NotPlain as exc:
                reply = {"not_plain": "returned " + str(exc)}
            except BaseException as exc:  # a value whose iteration or hashing raised while encoding
                reply = {"not_plain": "returned a value that could not be read: " + describe(exc)}
        send_message(sock, reply)


# --------------------------------------------------------------------------------------------------
# the judge
# --------------------------------------------------------------------------------------------------
class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` in a check body catches it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


class CandidateError(Exception):
    """The solution raised an exception that is not a builtin one (or failed to answer): ``describe`` text."""


def _spawn(program: str, role: str, fd: int) -> Any:
    """``program`` as a fresh interpreter in ``role`` (``--zygote``/``--runner``) with ``fd`` its only channel,
    /dev/null on 0-2, in a session of its own (``subprocess.Popen``; raises OSError)."""
    import subprocess  # only here, off the usual path: every import is paid at each sandbox start

    return subprocess.Popen(
        [sys.executable, "-I", program, role, str(fd)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(fd,),
        start_new_session=True,
    )


class Zygote:
    """A clean process that forks the runners: a fork costs a millisecond, a fresh ``python3`` 60-100 here.

    The judge forks it first thing, before it reads its spec, so the zygote's memory never holds a test or the
    marker; it loads no solution either (each runner gets its solution over its own socket after the fork). It
    inherits the judge's non-dumpable flag, so a runner cannot read or ptrace it. A runner can only kill or stop
    it: then ``fork_runner`` fails and the judge starts runners as fresh interpreters instead (slower, same
    result), and the next episode of a merged run gets a new zygote: started with ``program`` as a fresh
    interpreter (``--zygote FD``), never forked again from a judge that has read its spec.
    """

    def __init__(self, program: str | None = None) -> None:
        self.ctl: _socket.socket | None = None
        self._pid: int | None = None
        ours, theirs = _socket.socketpair()
        ours.settimeout(FORK_TIMEOUT_S)  # a zygote that a runner stopped (SIGSTOP) is given up on
        try:
            pid = _spawn(program, "--zygote", theirs.fileno()).pid if program is not None else os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return
        if pid == 0:  # the zygote: nothing of the judge's but this code, and the descriptors closed below
            try:
                ours.close()
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                zygote_main(theirs.detach())
            finally:
                os._exit(0)
        theirs.close()
        self.ctl, self._pid = ours, pid

    @property
    def pid(self) -> int | None:
        return self._pid

    def preimport(self, names: Sequence[str]) -> None:
        """Have the zygote import ``names`` (it does while the judge goes on); nothing when it is gone."""
        data = ",".join(names).encode()
        if self.ctl is None or not data:
            return
        try:
            self.ctl.sendall(b"w" + len(data).to_bytes(_HEADER_BYTES, "big") + data)
        except OSError:
            self.close()

    def request(self, first: bytes = b"") -> _socket.socket | None:
        """Ask for a new runner; the judge's end of its socket, or None when the zygote is gone. ``first`` (a
        small message) is queued on that socket at once: the runner reads it as soon as it exists. The runner's
        pid comes with ``forked_pid``, so the judge can work while the zygote forks."""
        if self.ctl is None:
            return None
        ours, theirs = _socket.socketpair()
        try:
            self.ctl.sendmsg([b"f"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _fd_bytes(theirs.fileno()))])
            if first:
                ours.sendall(first)  # fits the socket's buffer (PIPELINE_BYTES): never blocks
            return ours
        except Exception:
            ours.close()
            self.close()
            return None
        finally:
            theirs.close()

    def forked_pid(self) -> int | None:
        """The pid of the runner ``request`` asked for, or None when the zygote is gone or stuck (then closed)."""
        if self.ctl is None:
            return None
        try:
            return int.from_bytes(_recv_exact(self.ctl, _HEADER_BYTES), "big")
        except _Timeout:
            self.close()
            raise
        except Exception:
            self.close()
            return None

    @property
    def alive(self) -> bool:
        return self.ctl is not None

    def resume(self) -> None:
        """Undo a SIGSTOP a runner may have sent it (after every job)."""
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGCONT)
            except OSError:
                pass

    def close(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            except OSError:  # gone already (ChildProcessError is an OSError)
                pass
            self._pid = None


def zygote_main(fd: int) -> None:
    """Fork a runner for every descriptor the judge sends (``f`` + the descriptor); reply with its pid. Import the
    modules the judge names (``w`` + length + names): the task prompts' imports, so each runner starts with them
    loaded (``typing`` alone is 3 ms a job). Runs no model code itself."""
    ctl = _socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the runners are reaped by the kernel
    while True:
        try:
            msg, ancillary, _, _ = ctl.recvmsg(1, _socket.CMSG_SPACE(_FD_BYTES))
            fds = _received_fds(ancillary)
            if msg == b"w" and not fds:
                n = int.from_bytes(_recv_exact(ctl, _HEADER_BYTES), "big")
                _preimport(_recv_exact(ctl, n).decode().split(","))
                continue
        except (OSError, EOFError, UnicodeDecodeError):
            return
        if msg != b"f" or len(fds) != 1:
            for extra in fds:
                os.close(extra)
            return
        runner_fd = fds[0]
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                os.closerange(3, runner_fd)  # the zygote's channel included: the runner keeps fds 0-2 (/dev/null)
                os.closerange(runner_fd + 1, 1 << 16)  # and its own socket, nothing else
                runner_main(runner_fd)
            finally:
                os._exit(0)
        os.close(runner_fd)
        try:
            ctl.sendall(pid.to_bytes(_HEADER_BYTES, "big"))
        except OSError:
            return


def _preimport(names: Sequence[str]) -> None:
    for name in names:
        if name and all(part.isidentifier() for part in name.split(".")):
            try:
                __import__(name)
            except BaseException:  # a module this python lacks (or that refuses to load): the runner's problem
                pass


def prompt_imports(jobs: Sequence[dict[str, Any]]) -> list[str]:
    """The modules the jobs' prompts import (``import a.b``, ``from a import b``), by a line scan: the prompts are
    trusted task text, and ``ast`` would cost an import. The model's solution is never read here."""
    names: dict[str, None] = {}
    for job in jobs:
        for line in (job.get("context") or "").splitlines():
            text = line.strip()
            if text.startswith("import "):
                for part in text[7:].split(","):
                    names[part.split(" as ")[0].strip()] = None
            elif text.startswith("from ") and " import " in text:
                names[text[5:].split(" import ")[0].strip()] = None
    return [n for n in names if n and not n.startswith(".")][:64]


class Runner:
    """The judge's handle on one runner process: start it with the solution, call the entry point, kill it.

    A runner that timed out, died, or broke the protocol is killed; the next call starts a fresh one (the
    solution loaded again), so one bad case loses only itself."""

    def __init__(self, job: dict[str, Any], program: str, zygote: Zygote | None = None):
        self.job = job
        self.program = program
        self.zygote = zygote
        self.proc: Any = None  # a runner started as a fresh interpreter (subprocess.Popen)
        self.pid: int | None = None  # a runner forked by the zygote (not our child: the zygote reaps it)
        self.sock: _socket.socket | None = None
        self.load_message = b""  # the solution's load message (begin)
        self._queued = False  # it is queued on sock already
        self.pending = False  # begun, not finished
        self.ahead: list[Any] = []  # keys of the calls sent ahead (``send_ahead``), in order; replies not read yet

    def start(self) -> str | None:
        """Start a runner and load the solution; the setup error (``None`` when the entry point is defined)."""
        self.begin()
        return self.finish()

    def begin(self) -> None:
        """Ask the zygote for a runner with the solution queued on its socket, without waiting: the judge can
        do its own setup while the runner starts and loads (``finish`` collects it)."""
        self.kill()
        job = self.job
        load = {"entry_point": job["entry_point"], "context": job["context"], "solution": job["solution"]}
        self.load_message = frame(load)
        early = self.load_message if len(self.load_message) <= PIPELINE_BYTES else b""
        self.sock = self.zygote.request(early) if self.zygote is not None else None
        self._queued = bool(early) and self.sock is not None
        self.pending = True

    def finish(self) -> str | None:
        """The setup error of the runner ``begin`` asked for (None: loaded); a fresh interpreter when the zygote
        failed to fork it."""
        self.pending = False
        load = self.load_message
        if self.sock is not None:
            pid = self.zygote.forked_pid()  # type: ignore[union-attr]
            if pid is not None:
                self.pid = pid
                return self._load(b"" if self._queued else load)
            self.sock.close()
            self.sock = None
            self.ahead = []  # they went to a socket no runner will read
        ours, theirs = _socket.socketpair()
        try:
            self.proc = _spawn(self.program, "--runner", theirs.fileno())
        except OSError as exc:
            ours.close()
            return "could not start the solution's process: " + describe(exc)
        finally:
            theirs.close()
        self.sock = ours
        return self._load(load)

    def _load(self, load: bytes) -> str | None:
        """Send the solution (``load``; empty when it was queued already) and read whether it loaded."""
        sock = self.sock
        try:
            if load:
                sock.sendall(load)
            reply = recv_message(sock, MAX_VALUE_BYTES)
            error = reply["setup_error"]
        except _Timeout:
            self.kill()
            raise
        except BaseException as exc:
            self.kill()
            return "the solution's process failed while loading it (" + describe(exc) + ")"
        return None if error is None else str(error)[:300]

    def send_ahead(self, calls: list[tuple[Any, bytes]]) -> None:
        """Send the framed calls ``(key, message)`` of the coming cases at once, right behind the solution (with
        ``begin``, before the runner exists): the runner answers them one after the other, and ``call(key=)``
        reads each answer in turn under its own case's time limit. One round trip per job instead of per case."""
        if self.sock is None or not self._queued or not calls:
            return
        try:
            self.sock.sendall(b"".join(message for _, message in calls))  # with the load: <= PIPELINE_BYTES
        except OSError:
            return
        self.ahead = [key for key, _ in calls]

    def call(self, args: tuple, kwargs: dict[str, Any], key: Any = None) -> Any:
        """The entry point's return value for ``args``, as plain data; raises the solution's exception (a
        builtin class of the same name when there is one, else ``CandidateError``). ``key``: the case's, when
        its call may have been sent ahead (``send_ahead``)."""
        try:
            payload = call_message(args, kwargs)
        except NotPlain as exc:
            raise CandidateError("an argument cannot cross to the solution's process: " + str(exc)) from None
        if self.sock is None or self.pending:
            error = self.finish() if self.pending else self.start()
            if error is not None:
                raise CandidateError(error)
        sent = bool(self.ahead) and self.ahead[0] == key
        if self.ahead and not sent:  # never, as cases run in order; should it happen, start clean
            self.kill()
            error = self.start()
            if error is not None:
                raise CandidateError(error)
        sock = self.sock
        try:
            if sent:
                self.ahead.pop(0)
            else:
                sock.sendall(payload)
            reply = recv_message(sock, MAX_VALUE_BYTES + 64)
        except _Timeout:
            self.kill()
            raise
        except NotPlain as exc:
            self.kill()
            raise CandidateError("the solution returned " + str(exc)) from None
        except BaseException as exc:
            self.kill()
            raise CandidateError("the solution's process failed during the call (" + describe(exc) + ")") from None
        if type(reply) is not dict:
            self.kill()
            raise CandidateError("the solution's process broke the protocol")
        if "value" in reply:
            try:
                return decode(reply["value"])
            except NotPlain as exc:
                self.kill()
                raise CandidateError("the solution returned " + str(exc)) from None
        if "raised" in reply and type(reply["raised"]) is list and len(reply["raised"]) == 2:
            raise _rebuild(str(reply["raised"][0]), str(reply["raised"][1]))
        if "not_plain" in reply:
            raise CandidateError(str(reply["not_plain"])[:300])
        self.kill()
        raise CandidateError("the solution's process broke the protocol")

    def kill(self) -> None:
        self.ahead = []
        if self.pending:  # a fork asked for and not collected: read its pid (the zygote's replies stay in step)
            self.pending = False
            if self.sock is not None and self.zygote is not None:
                try:
                    self.pid = self.zygote.forked_pid()
                except _Timeout:
                    pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.pid is not None:
            _killpg(self.pid)  # its own session (setsid after the fork)
            self.pid = None
        if self.proc is not None:
            _killpg(self.proc.pid)  # its own session too (start_new_session)
            self.proc.wait()
            self.proc = None


def _rebuild(name: str, text: str) -> Exception:
    """The judge's copy of an exception the solution raised: a builtin ``Exception`` class of that name (so a
    check body's ``except ValueError`` works), else ``CandidateError``; never a BaseException like SystemExit."""
    cls = getattr(builtins, name, None)
    message = text[len(name) + 2 :] if text.startswith(name + ": ") else ""
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__name__ == name:
        try:
            return cls(message)
        except Exception:
            pass
    return CandidateError(text)


class _alarm:  # a class, not @contextlib.contextmanager: contextlib costs an import at every sandbox start
    """Raise ``_Timeout`` in the block after ``seconds`` (at once when none are left); the timer off after it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        if self.seconds <= 0:
            raise _Timeout()
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def left_value(source: str, ns: dict[str, Any], deadline: float) -> str:
    """For a failed ``assert lhs <op> rhs``: `` (left side was <repr>)``, else "" (the code agent sees it)."""
    try:
        import ast  # only for a failed assert: every import is paid at each sandbox start

        node = ast.parse(source).body[0]
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)):
            return ""
        expr = ast.fix_missing_locations(ast.Expression(node.test.left))
        with _alarm(min(0.5, deadline - time.monotonic())):
            value = eval(compile(expr, "<detail>", "eval"), ns)
        return " (left side was " + repr(value)[:150] + ")"
    except BaseException:
        return ""


def call_message(args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """One call of the entry point, framed for the runner's socket (``NotPlain`` for an argument that is not)."""
    return frame({"args": encode(list(args)), "kwargs": encode(dict(kwargs))})


def calls_ahead(job: dict[str, Any], room: int) -> list[tuple[int, bytes]]:
    """``(step index, message)`` of the job's call cases to send ahead, in order, at most ``room`` bytes, up to the
    first step that runs source (its calls come from the judge's own code, in an order only running it tells;
    should the preamble call the solution, ``Runner.call`` sees calls still ahead and starts a clean runner)."""
    out = []
    for i, step in enumerate(job["steps"]):
        kind = step.get("kind", "source")
        if kind == "invalid":
            continue
        if kind != "call":
            break
        try:
            message = call_message(decode(step["call"]["args"]), decode(step["call"]["kwargs"]))
        except NotPlain:
            break
        room -= len(message)
        if room < 0:
            break
        out.append((i, message))
    return out


def check_call(case: dict[str, Any], runner: Runner, key: Any = None) -> str | None:
    """One case of a model-written test (``suites.parse_call_case``): call, compare; the error or ``None``."""
    value = runner.call(tuple(decode(case["args"])), decode(case["kwargs"]), key)
    how, expected = case["check"], decode(case["expected"])
    shown = " (left side was " + repr(value)[:150] + ")"
    if how == "==":
        ok = value == expected
    elif how == "!=":
        ok = value != expected
    elif how == "is":
        ok = value is expected
    elif how == "is not":
        ok = value is not expected
    elif how == "truthy":
        ok = bool(value)
    elif how == "falsy":
        ok = not value
    elif how == "close":
        rel, abs_ = case.get("rel_tol", 1e-9), case.get("abs_tol", 0.0)
        real = (int, float)
        ok = (
            type(value) in real
            and type(expected) in real
            and abs(value - expected) <= max(rel * max(abs(value), abs(expected)), abs_)
        )
    else:
        return "not a check this harness knows: " + str(how)
    return None if ok else "AssertionError" + shown


def run_job(
    job: dict[str, Any], deadline: float, case_timeout_s: float, program: str, zygote: Zygote | None = None
) -> dict[str, Any]:
    """Evaluate one job: its summary entry ``{"setup_error", "cases": [[ok, error], ...]}``.

    The solution runs in a ``Runner``; the test steps run here. Each step has its own time limit (SIGALRM):
    a step that hangs (in the judge or waiting for the runner) fails alone, its runner killed and replaced."""
    signal.signal(signal.SIGALRM, _on_alarm)
    runner = Runner(job, program, zygote)
    cases: list[list[Any]] = []

    def left() -> float:
        return min(case_timeout_s, deadline - time.monotonic())

    try:
        setup_error = None
        ns: dict[str, Any] = {"__name__": "__pettingflow_check__"}
        # the judge's namespace first (only source steps use it: ground truth, not parsed tests): its imports of
        # the prompt run while the zygote pre-imports the same modules for the runner
        try:
            with _alarm(left()):
                runner.begin()  # the zygote forks the runner and it loads the solution while the judge sets up
                runner.send_ahead(calls_ahead(job, PIPELINE_BYTES - len(runner.load_message)))
        except _Timeout:
            setup_error = "the solution failed to load: timed out"
        if setup_error is None and (job["preamble"] or any(s.get("kind", "source") == "source" for s in job["steps"])):
            setup_error = _setup_checks(job, ns, runner, left)
        if setup_error is None and runner.pending:  # (unless the preamble called the solution already)
            try:
                with _alarm(left()):
                    setup_error = runner.finish()
            except _Timeout:
                setup_error = "the solution failed to load: timed out"
        for index, step in enumerate(job["steps"]):
            kind = step.get("kind", "source")
            if setup_error is not None:
                if step["case"]:
                    cases.append([False, setup_error])
                continue
            error = None
            try:
                with _alarm(left()):
                    if kind == "call":
                        error = check_call(step["call"], runner, index)
                    elif kind == "invalid":
                        error = step["reason"]
                    else:
                        try:
                            exec(compile(step["source"], "<test>", "exec"), ns)
                        except AssertionError as exc:
                            error = describe(exc) + left_value(step["source"], ns, deadline)
            except _Timeout:
                runner.kill()
                error = "timed out" if time.monotonic() < deadline else "timed out (time budget of this run used up)"
            except BaseException as exc:
                error = describe(exc)
            if step["case"]:
                cases.append([error is None, error])
        return {"setup_error": setup_error, "cases": cases}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        runner.kill()


def _setup_checks(job: dict[str, Any], ns: dict[str, Any], runner: Runner, left: Any) -> str | None:
    """The judge's namespace for source steps: the prompt's helpers (trusted task text), the entry point and
    ``candidate`` as proxies to the runner, then the suite's preamble. The setup error or ``None``."""
    entry = job["entry_point"]
    proxy = _proxy(runner, entry)
    try:
        with _alarm(left()):
            if job["context"]:
                try:
                    exec(compile(job["context"], "<prompt>", "exec"), ns)
                except Exception:
                    pass
            ns[entry] = proxy  # the prompt's stub replaced, before the preamble may use it
            if job["preamble"]:
                exec(compile(job["preamble"], "<test setup>", "exec"), ns)
            ns[entry] = proxy  # and again, should the preamble have rebound the name
            if job["candidate_name"]:
                ns[job["candidate_name"]] = proxy
    except BaseException as exc:
        return "the test setup failed: " + describe(exc)
    return None


def _proxy(runner: Runner, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return runner.call(args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def run_group(
    jobs: list[dict[str, Any]],
    budget_s: float,
    emit: Callable[[dict[str, Any]], Any],
    case_timeout_s: float,
    program: str,
    after_job: Callable[[], Any] | None = None,
    zygote: Zygote | None = None,
) -> None:
    """Run ``jobs`` one after the other within ``budget_s``, calling ``emit`` with each job's summary entry.

    Each job's deadline is its share of the time left, in proportion to its case count. ``after_job`` (in the
    sandbox: kill every stray process) runs after each job, so nothing one job's code left reaches the next.
    """
    end = time.monotonic() + budget_s
    counts = [sum(1 for s in j["steps"] if s["case"]) for j in jobs]
    remaining = sum(counts)
    for job, n in zip(jobs, counts):  # noqa: B905 (strict= needs Python 3.10; equal lengths by construction)
        now = time.monotonic()
        share = (end - now) * n / remaining if remaining else 0.0
        remaining -= n
        emit(run_job(job, now + max(share, 0.0), case_timeout_s, program, zygote))
        if after_job is not None:
            after_job()


def in_own_pid_namespace() -> bool:
    """True when we are the first process of a pid namespace (pid 1: Docker) or right after its init (pid 2:
    bubblewrap's). A process on a host never has pid 1 or 2 (init, kthreadd), so ``kill(-1)`` below can never
    reach a host's processes, whoever runs this file where."""
    return os.getpid() <= 2


def kill_strays(spare: Sequence[int | None] = ()) -> None:
    """Kill every process of the sandbox but ourselves, the namespace's init and ``spare`` (the zygote), and
    reap what was ours. Repeats until a scan finds no process it has not killed already: a killed process may
    take a moment to leave /proc, but it can no longer fork (the kernel fails a fork with a fatal signal
    pending), and a child it forked before the kill shows up in the next scan. Does nothing outside a pid
    namespace of our own (``in_own_pid_namespace``)."""
    if not in_own_pid_namespace():
        return
    keep = {1, os.getpid(), *(p for p in spare if p)}
    killed: set[int] = set()
    for attempt in range(1000):
        fresh = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep or int(name) in killed:
                continue
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                fresh.append(int(name))
        for pid in fresh:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        killed.update(fresh)
        _reap()
        if not fresh:
            return
        if attempt >= 2:  # a process that keeps forking: give the kills a moment to land
            time.sleep(0.0002)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def clean_slate(spare: Sequence[int | None] = ()) -> None:
    """Between the episodes of a merged run: what one left behind must not reach the next, as if each had
    its own sandbox. Kill every other process but ``spare``, then empty the scratch folders. Does nothing
    outside a pid namespace of our own."""
    import shutil

    if not in_own_pid_namespace():
        return
    kill_strays(spare)
    for root in (os.getcwd(), "/tmp", "/dev/shm"):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def read_spec() -> dict[str, Any]:
    """The spec from stdin, read to its end, so a process that reopens our stdin later finds it drained."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    return json.loads(b"".join(chunks))


def make_undumpable() -> bool:
    """PR_SET_DUMPABLE 0: /proc/<us>/{mem,fd,environ,maps} and ptrace are closed to every process of our uid
    (the runners included). True when it took; without ctypes the runners' other limits still hold."""
    try:  # _ctypes, not ctypes: the wrapper module costs 2 ms at every sandbox start
        import _ctypes

        prctl = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        return _ctypes.call_function(prctl, (4, 0, 0, 0, 0)) == 0  # 4 = PR_SET_DUMPABLE
    except Exception:
        pass
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except Exception:
        return False


def main() -> None:
    """Evaluate every job of the spec (group by group), writing ``marker + json([index, result])`` to the real
    stdout as each job ends: a judge killed later (by a runner that signals it) loses only the jobs not done."""
    make_undumpable()
    program = os.path.abspath(sys.argv[0])
    zygote = Zygote()  # forked now, before the spec exists in this process
    spec = read_spec()
    out = os.dup(1)
    null_fd = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null_fd, fd)
    os.set_inheritable(out, False)
    marker = spec["marker"]
    jobs = spec["jobs"]
    zygote.preimport(prompt_imports(jobs))
    groups = spec.get("groups") or [[len(jobs), spec["budget_s"]]]
    done = [0]

    def emit(result: dict[str, Any]) -> None:
        line = (marker + json.dumps([done[0], result]) + "\n").encode()
        done[0] += 1
        view = memoryview(line)
        while view:
            view = view[os.write(out, view) :]

    def after_job() -> None:
        kill_strays(spare=[zygote.pid])
        zygote.resume()

    start = 0
    for g, (n, budget_s) in enumerate(groups):
        if g:
            clean_slate(spare=[zygote.pid])
            if not zygote.alive:  # a runner of the last episode killed it: a new one, as a fresh interpreter
                zygote.close()
                zygote = Zygote(program)
                zygote.preimport(prompt_imports(jobs[start:]))
        group = jobs[start : start + n]
        run_group(group, budget_s, emit, spec["case_timeout_s"], program, after_job, zygote)
        start += n
    zygote.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--runner"]:
        runner_main(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--zygote"]:
        zygote_main(int(sys.argv[2]))
    else:
        main()
