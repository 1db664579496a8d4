"""Run untrusted, model-generated Python code in a child process and get plain data back.

A benchmark metric executes generated code against hidden unit tests. The code is untrusted, so:

* the parent decides pass/fail; expected values are never sent to the child;
* the child (``pace_hf/_sandbox_child.py``) returns only plain data (JSON values, with
  ``decimal.Decimal`` as ``{"__decimal__": str(x)}``), checked by exact type, one JSON line per call
  over a dedicated pipe; the parent never unpickles or evals anything from it;
* the child is confined: isolated interpreter (``-I -S``), empty environment, fresh working
  directory, resource limits, new network/mount namespaces and a fresh unprivileged uid where the
  OS allows, an audit hook refusing network, processes, signals, ctypes and file changes outside
  its directory, and a wall-clock deadline after which its whole process group is killed.

Executing generated code needs an explicit opt-in: ``PACE_ALLOW_CODE_EVAL=1``.

Example::

    results = run_calls(program, ["fee_for(1250, 'gold')", "settle([])"])
    results[0].status, results[0].value          # "ok", 31.25
    results[1].exc_type, results[1].exc_args     # "LedgerError", ["E-417"]
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any

__all__ = [
    "CallResult",
    "CodeExecutionNotAllowed",
    "SandboxLimits",
    "decode_value",
    "isolation_layers",
    "require_opt_in",
    "run_calls",
]

OPT_IN_ENV = "PACE_ALLOW_CODE_EVAL"
STATUSES = ("ok", "raised", "error", "timeout")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_MAX_LINE = 4 * 1024 * 1024  # a report line: a 1 MB value plus exception data, with slack
_MAX_DETAIL = 500


class CodeExecutionNotAllowed(RuntimeError):
    """Raised when generated code would run without the explicit opt-in."""


def require_opt_in() -> None:
    """Refuse to run generated code unless ``PACE_ALLOW_CODE_EVAL=1`` is set (like HF ``code_eval``)."""
    if os.environ.get(OPT_IN_ENV) != "1":
        raise CodeExecutionNotAllowed(
            "Executing model-generated code is disabled by default: the code is untrusted and, "
            "although pace_hf.sandbox confines it, no sandbox is perfect. Run it only on a "
            f"machine you can afford to lose. To opt in, set the environment variable "
            f"{OPT_IN_ENV}=1 (e.g. `export {OPT_IN_ENV}=1`, or os.environ['{OPT_IN_ENV}'] = '1')."
        )


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one :func:`run_calls` run (one child process, all its calls together).

    ``timeout_s`` is wall-clock for the whole run; calls not reported by then are "timeout".
    ``max_processes=0`` means no new processes. ``max_threads`` and ``max_disk_mb`` are only
    enforced where the child could drop to its own uid / mount a tmpfs (as root on Linux)."""

    timeout_s: float = 10.0
    memory_mb: int = 512  # RLIMIT_AS, address space
    cpu_s: int = 10  # RLIMIT_CPU
    max_processes: int = 0  # processes the program may start (audit hook + RLIMIT_NPROC)
    max_file_mb: int = 1  # RLIMIT_FSIZE: largest file the program may write
    max_threads: int = 8  # counted with processes by RLIMIT_NPROC
    max_disk_mb: int = 16  # size of the tmpfs working directory

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s must be in (0, 3600], got {self.timeout_s!r}")
        for name, low in (("memory_mb", 32), ("cpu_s", 1), ("max_processes", 0),
                          ("max_file_mb", 0), ("max_threads", 0), ("max_disk_mb", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class CallResult:
    """What one call did, as plain data.

    status: "ok" (``value`` holds the plain return value), "raised" (``exc_type`` is the exception
    class name, ``exc_args`` its args with non-plain entries as None, ``exc_attrs`` its plain
    instance attributes), "error" (program did not load, value not plain data, child died,
    blocked operation, ...) or "timeout"; ``detail`` says why for the last two."""

    status: str
    value: Any = None
    exc_type: str | None = None
    exc_args: list | None = None
    exc_attrs: dict | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


def decode_value(value: Any) -> Any:
    """Turn ``{"__decimal__": "1.50"}`` markers in a returned value back into ``Decimal``."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get("__decimal__")) is str:
            return Decimal(value["__decimal__"])
        return {k: decode_value(v) for k, v in value.items()}
    if type(value) is list:
        return [decode_value(v) for v in value]
    return value


def run_calls(program: str, calls: list[str], limits: SandboxLimits = SandboxLimits()) -> list[CallResult]:
    """Exec ``program`` as module ``solution`` in a confined child, evaluate each call expression
    in its namespace, and return one :class:`CallResult` per call, in order."""
    require_opt_in()
    if type(program) is not str:
        raise TypeError("program must be a str")
    calls = list(calls)
    if not all(type(c) is str for c in calls):
        raise TypeError("calls must be a list of str")
    if not isinstance(limits, SandboxLimits):
        raise TypeError("limits must be a SandboxLimits")
    if not calls:
        return []
    return _run(program, calls, limits)[0]


def isolation_layers(limits: SandboxLimits = SandboxLimits()) -> list[str]:
    """Which OS-level layers the child could set up on this machine (for logs; runs no generated
    code): e.g. ``["netns", "mountns", "tmpfs", "stdlib bind mounts", "rlimits", "uid 1234"]``.
    The audit hook is not listed: it is always installed."""
    return _run("", [], limits)[1]


# --------------------------------------------------------------------------------------------
# Parent runner


def _run(program: str, calls: list[str], limits: SandboxLimits) -> tuple[list[CallResult], list[str]]:
    nonce = secrets.token_hex(16)
    uid = _pick_uid()
    base = tempfile.mkdtemp(prefix="pace-sandbox-")
    work, lib = os.path.join(base, "work"), os.path.join(base, "lib")
    proc = None
    read_fd = write_fd = -1
    try:
        os.chmod(base, 0o711)  # the child's unprivileged uid must reach work/ and lib/
        os.mkdir(work, 0o700)
        os.mkdir(lib, 0o755)
        job = {
            "program": program, "calls": calls, "nonce": nonce, "work": work, "lib": lib,
            "uid": uid, "parent_pid": os.getpid(),
            "limits": {k: v for k, v in asdict(limits).items() if k != "timeout_s"},
        }
        with tempfile.TemporaryFile() as job_file:
            job_file.write(json.dumps(job).encode())
            job_file.flush()
            job_file.seek(0)
            read_fd, write_fd = os.pipe()
            deadline = time.monotonic() + limits.timeout_s
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _CHILD, str(job_file.fileno()), str(write_fd)],
                cwd=work, env=_child_env(work), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(job_file.fileno(), write_fd), start_new_session=True,
            )
        os.close(write_fd)
        write_fd = -1
        collector, stderr = _Collector(len(calls), nonce), _Tail(proc.stderr)
        eof = _read_reports(read_fd, stderr, collector, deadline)
        ended = _child_end(proc, stderr, deadline) if eof and not collector.finished() else None
        _kill(proc, uid)
        stderr.drain()
        return collector.results(ended, limits.timeout_s, stderr.last_line()), collector.layers
    finally:
        if proc is not None:
            if proc.returncode is None:
                _kill(proc, uid)
            proc.stderr.close()
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        _remove_base(base, work, lib)


def _child_env(work: str) -> dict:
    """Nothing from the parent's environment: no tokens, no proxies, no PATH."""
    return {"HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}


def _pick_uid() -> int | None:
    """A fresh uid for the child when we are root (so RLIMIT_NPROC applies and the kernel protects
    the host's files and processes), or None. Chosen at random from a range mapped in our user
    namespace, far above ordinary accounts; a clash with a parallel run is vanishingly rare."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    best = (0, 0)
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                if count > best[1]:
                    best = (inside, count)
    except (OSError, ValueError):
        return None
    start, count = best
    first, last = start + 100_000, start + min(count, 2**31) - 2  # 65534 (nobody) stays out
    low = (first + last) // 2
    if last - low < 65536:
        return None
    return low + secrets.randbelow(last - low)


class _Collector:
    """Validates report lines and turns them into CallResults. Garbage lines are ignored."""

    def __init__(self, n: int, nonce: str) -> None:
        self.n, self.nonce = n, nonce
        self.done: list[CallResult] = []
        self.layers: list[str] = []
        self.setup_seen = False
        self.program_violation: str | None = None
        self.violations: dict[int, str] = {}

    def finished(self) -> bool:
        return len(self.done) >= self.n and self.setup_seen

    def feed(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            return
        if type(msg) is not dict or msg.get("n") != self.nonce:
            return
        i = msg.get("i")
        if "setup" in msg:
            layers = msg["setup"]
            if type(layers) is list:
                self.layers = [str(x)[:100] for x in layers[:20]]
            self.setup_seen = True
        elif "violation" in msg:
            event = str(msg["violation"])[:100]
            if i == -1 and self.program_violation is None:
                self.program_violation = event
            elif type(i) is int and 0 <= i < self.n:
                self.violations.setdefault(i, event)
        elif type(i) is int and i == len(self.done):
            self.setup_seen = True  # a setup failure reports calls without a setup line
            self.done.append(self._result(i, msg))

    def _result(self, i: int, msg: dict) -> CallResult:
        if self.program_violation is not None:
            return CallResult("error", detail=f"program attempted a blocked operation: {self.program_violation}")
        if i in self.violations:
            return CallResult("error", detail=f"call attempted a blocked operation: {self.violations[i]}")
        status = msg.get("status")
        if status == "ok" and "value" in msg:
            return CallResult("ok", value=msg["value"])
        if status == "raised" and type(msg.get("exc_type")) is str:
            args, attrs = msg.get("exc_args"), msg.get("exc_attrs")
            return CallResult("raised", exc_type=msg["exc_type"][:200],
                              exc_args=args if type(args) is list else None,
                              exc_attrs=attrs if type(attrs) is dict else {})
        if status == "error":
            return CallResult("error", detail=str(msg.get("detail", ""))[:_MAX_DETAIL])
        return CallResult("error", detail="malformed report from the child")

    def results(self, ended: str | None, timeout_s: float, stderr_tail: str) -> list[CallResult]:
        """The reported results, then one result per missing call: error if the child ended
        (``ended`` says how), timeout otherwise."""
        out = list(self.done[: self.n])
        if ended is not None:
            detail = ended + (f"; stderr: {stderr_tail}" if stderr_tail else "")
            missing = CallResult("error", detail=detail[:_MAX_DETAIL])
        else:
            missing = CallResult("timeout", detail=f"no result within the {timeout_s:g} s wall-clock limit")
        out += [missing] * (self.n - len(out))
        return out


def _read_reports(fd: int, stderr: "_Tail", collector: _Collector, deadline: float) -> bool:
    """Feed complete lines to the collector until it is finished, the pipe closes (returns True)
    or the deadline passes (returns False). Overlong lines are dropped, not buffered. The child's
    stderr is read alongside so that a flood cannot block it; only its tail is kept."""
    buf = bytearray()
    skipping = False
    while not collector.finished():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        ready, _, _ = select.select([fd] + stderr.fds(), [], [], remaining)
        if stderr.fd in ready:
            stderr.read()
        if fd not in ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return True
        buf += chunk
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _MAX_LINE:
                    buf.clear()
                    skipping = True
                break
            line = bytes(buf[:end])
            del buf[: end + 1]
            if skipping:
                skipping = False  # the tail of an overlong line
            else:
                collector.feed(line)
            if collector.finished():
                break
    return True


class _Tail:
    """The last few KB of a pipe, read without ever blocking."""

    def __init__(self, file, keep: int = 2000) -> None:
        self.fd, self.keep, self.data, self.open = file.fileno(), keep, b"", True
        os.set_blocking(self.fd, False)

    def fds(self) -> list[int]:
        return [self.fd] if self.open else []

    def read(self) -> int:
        """Read what is available; returns the number of bytes read (0 at EOF or when empty)."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return 0
        except OSError:
            chunk = b""
        if not chunk:
            self.open = False
        self.data = (self.data + chunk)[-self.keep:]
        return len(chunk)

    def drain(self) -> None:
        """After the child is dead: whatever is still buffered (bounded by the pipe size)."""
        for _ in range(64):
            if not self.open or not self.read():
                return

    def last_line(self) -> str:
        lines = self.data.decode("utf-8", "replace").strip().splitlines()
        return lines[-1][:200] if lines else ""


def _child_end(proc: subprocess.Popen, stderr: _Tail, deadline: float) -> str | None:
    """After the report pipe closed: how the child ended, or None if it is still running at the
    deadline (it closed the pipe but kept going: those calls time out). Keeps reading stderr so
    a child blocked on a full stderr pipe can still exit."""
    while (code := proc.poll()) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select(stderr.fds(), [], [], min(remaining, 0.05))
        if ready:
            stderr.read()
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = {"SIGKILL": " (memory or CPU limit?)", "SIGXCPU": " (CPU time limit)",
                "SIGSEGV": " (crashed)"}.get(name, "")
        return f"child killed by {name}{hint}"
    return f"child exited (exit code {code})"


def _kill(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the child's process group, the child, and (as root) every process of its uid,
    which also catches anything that escaped the group with setsid()."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for anything
        pass
    if uid is not None:
        for _ in range(3):
            if not _kill_uid(uid):
                break


def _kill_uid(uid: int) -> bool:
    found = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(entry), signal.SIGKILL)
                            found = True
                        break
        except (OSError, ValueError):
            continue
    return found


def _remove_base(base: str, work: str, lib: str) -> None:
    """Delete the run's directories. Only ``work`` is removed recursively: ``lib`` holds mount
    points (in the child's namespace only), so it is removed with rmdir, never recursively."""
    shutil.rmtree(work, ignore_errors=True)
    for path in ([os.path.join(lib, d) for d in _listdir(lib)] + [lib, base]):
        try:
            os.rmdir(path)
        except OSError:
            try:
                os.remove(path)
            except OSError:
                pass


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
