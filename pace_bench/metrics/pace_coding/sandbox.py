"""Run untrusted, model-generated Python code in a child process and get plain data back.

A benchmark metric executes generated code against hidden unit tests. The code is untrusted, and
from the moment it loads, so is the child's whole interpreter: the program may rewrite it (replace
``json`` or ``__builtins__``, reach frames, build bytecode, call C). No guarantee rests on it:

* **The parent scores.** It holds the calls and the expected values (which never leave it), sends
  one request at a time (the load, then call ``i`` only after call ``i - 1`` was answered), each
  with a fresh random nonce, and accepts exactly one answer carrying that nonce. Any other line on
  the report pipe (unasked, a duplicate, an answer before its request, malformed, or beyond the caps
  of the harness's own replies) fails that call and every later one; only the harness's thread holds
  the channel (the program's threads and processes have no descriptor of it and no path to open).
  The parent stops reading once a run has ended, and reads at most 16 MiB of reports (no line deeper
  or larger than a reply can be is parsed) and 64 MiB of stderr per run, whatever its timeout. A
  value is plain data decoded from bytes here (JSON, with
  ``decimal.Decimal`` as ``{"__decimal__": str(x)}``); its types, depth and size are checked here;
  nothing is unpickled or evaluated. Exception types come back as names, compared here.
* **The kernel confines.** The child (``pace_bench/metrics/pace_coding/_sandbox_child.py``) runs the
  program as pid 2 of new pid, IPC, UTS, network and mount namespaces (no pid counter, System V
  object, POSIX queue, abstract socket or host name shared with the host or another run; whatever
  is left dies with the namespace), in a memory cgroup of its own where the host has one, under a
  minimal read-only root of private copies (no page cache or dentry shared with the host or another
  run) without ``/proc``, with a scratch tmpfs capped by ``size=`` and ``nr_inodes=`` that also holds
  the FIFOs to the parent, Landlock, resource limits, a fresh uid and a seccomp allowlist (deny by
  default: no System V IPC, ``mq_*``, ``memfd_create``, ``userfaultfd``, ``io_uring``, ``ptrace``,
  pidfds, pipes, sockets or new processes unless processes are allowed). No inode in the program's
  reach takes its number from a host-wide counter. Where the namespaces, the private root or Landlock
  (the wall against reading the host's files, and writing) cannot be set up, :func:`run_calls`
  refuses with :class:`SandboxUnavailable`; it never runs the code half-confined. The threat model
  (``docs/benchmarks/threat-model.md``) says what is left.
  A wall-clock deadline kills the child's process group.
* **Layers inside the child** make honest failures clear and attacks harder, but are not relied
  on: the harness reads and writes the pipes with ``os.read``/``os.write`` and encodes with
  functions captured before the program loads, gives each call fresh builtins, and an audit hook
  refuses network, processes, signals, ctypes, hand-made code objects, suspended frames and file
  changes outside the scratch directory. A call during which the program attempted a refused
  operation is an error even if the program caught the refusal; the parent counts refusals
  through a kernel counter the program cannot raise (see ``_Run``).

Executing generated code needs an explicit opt-in: ``PACE_ALLOW_CODE_EVAL=1`` (or
``HF_ALLOW_CODE_EVAL=1``, as for HF's ``code_eval``).

Example::

    results = run_calls(program, ["fee_for(1250, 'gold')", "settle([])"])
    results[0].status, results[0].value          # "ok", {"__decimal__": "31.25"}
    results[1].exc_type, results[1].exc_args     # "LedgerError", ["E-417"]
"""

from __future__ import annotations

import itertools
import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from pace_bench.metrics.pace_coding._sandbox_child import (
    MAX_DETAIL_CHARS,
    MAX_EXC_CHARS,
    MAX_EXC_ITEMS,
    MAX_TYPE_CHARS,
    MAX_USE_CHARS,
    MAX_USES,
    MAX_VALUE_CHARS,
    MAX_VIOLATION_CHARS,
    MAX_VIOLATION_NAMES,
)

__all__ = [
    "CallResult",
    "CodeExecutionNotAllowed",
    "SandboxLeak",
    "SandboxLimits",
    "SandboxUnavailable",
    "AnswerRun",
    "check_host",
    "decode_value",
    "isolation_layers",
    "plain_data_error",
    "require_opt_in",
    "run_answer",
    "run_calls",
]

OPT_IN_ENV = "PACE_ALLOW_CODE_EVAL"
OPT_IN_ENVS = (OPT_IN_ENV, "HF_ALLOW_CODE_EVAL")  # ours, and the one HF's code_eval users already set
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_MAX_LINE = 4 * 1024 * 1024  # a report line: a 1 MB value plus exception data, or an answer's uses, with slack
_MAX_DETAIL = 500
MAX_DEPTH = 100  # nesting of a returned value (the child refuses deeper ones too)
MAX_NODES = 200_000  # elements of a returned value
# What the parent reads and parses of one run, whatever its timeout: every line either answers the one
# outstanding request or ends the run, so at most len(calls) + 4 lines are parsed; of them, at most
# _MAX_RUN_BYTES in all, and none with more than _MAX_LINE_NODES values or nested deeper than
# _MAX_LINE_DEPTH (counted on the raw bytes, before json.loads). Of stderr, _MAX_STDERR_BYTES are read.
_MAX_RUN_BYTES = 16 * 1024 * 1024
_MAX_LINE_NODES = 2 * MAX_NODES + 2 * MAX_EXC_CHARS  # a value's elements and its empty containers; args, attrs
_MAX_LINE_DEPTH = MAX_DEPTH + 1  # a value, inside the reply's object
_MAX_STDERR_BYTES = 64 * 1024 * 1024  # a flood: about 0.1 s of the parent's CPU
_RLIMIT_LOCKS = 10  # the child's violation counter (see _sandbox_child._install_audit_hook)
# The layer that keeps reads (of the host's files, the benchmark's own sources among them) and writes
# inside what the program may touch. The read-only root walls writes too, but not reads: without Landlock,
# native code can read any file of the host, so the code does not run.
_WALL = "landlock"


class CodeExecutionNotAllowed(RuntimeError):
    """Raised when generated code would run without the explicit opt-in."""


class SandboxUnavailable(RuntimeError):
    """Raised when the child could not confine itself on this machine (no new pid, IPC, UTS,
    network and mount namespaces, neither as root nor in a user namespace; or no Landlock, without
    which native code could read any file of the host), or its setup failed: no code is run then.
    Decided before the child reads any answer (:func:`check_host`): no answer can raise it."""


def opted_in() -> bool:
    """Whether ``PACE_ALLOW_CODE_EVAL=1`` or ``HF_ALLOW_CODE_EVAL=1`` is set."""
    return any(os.environ.get(name) == "1" for name in OPT_IN_ENVS)


def require_opt_in() -> None:
    """Refuse to run generated code unless ``PACE_ALLOW_CODE_EVAL=1`` (or HF ``code_eval``'s
    ``HF_ALLOW_CODE_EVAL=1``) is set."""
    if not opted_in():
        raise CodeExecutionNotAllowed(
            "Executing model-generated code is disabled by default: the code is untrusted and, "
            "although pace_bench.metrics.pace_coding.sandbox confines it, no sandbox is perfect. Run it only on a "
            f"machine you can afford to lose. To opt in, set the environment variable "
            f"{OPT_IN_ENV}=1 (e.g. `export {OPT_IN_ENV}=1`, or os.environ['{OPT_IN_ENV}'] = '1'); "
            "HF_ALLOW_CODE_EVAL=1, as for HF's code_eval, is accepted too."
        )


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one :func:`run_calls` run (one child process, all its calls together).

    ``timeout_s`` is wall-clock for the whole run; calls not reported by then are "timeout".
    ``max_processes=0`` means no new processes. ``max_disk_mb`` and ``max_inodes`` are the scratch
    tmpfs's ``size=`` and ``nr_inodes=``; ``max_threads`` is only enforced where the child could drop
    to its own uid (as root)."""

    timeout_s: float = 10.0
    memory_mb: int = 512  # RLIMIT_AS, address space
    cpu_s: int = 10  # RLIMIT_CPU
    max_processes: int = 0  # processes the program may start (audit hook + RLIMIT_NPROC)
    max_file_mb: int = 1  # RLIMIT_FSIZE: largest file the program may write
    max_threads: int = 8  # counted with processes by RLIMIT_NPROC
    max_disk_mb: int = 16  # size of the tmpfs working directory
    max_inodes: int = 4096  # files, directories and links the working directory can hold

    def __post_init__(self) -> None:
        if not (type(self.timeout_s) in (int, float) and 0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s must be in (0, 3600], got {self.timeout_s!r}")
        for name, low in (("memory_mb", 32), ("cpu_s", 1), ("max_processes", 0),
                          ("max_file_mb", 0), ("max_threads", 0), ("max_disk_mb", 1), ("max_inodes", 16)):
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

    def to_dict(self) -> dict:
        return asdict(self)


def decode_value(value: Any) -> Any:
    """Turn ``{"__decimal__": "1.50"}`` markers in a returned value back into ``Decimal``.
    For plain data as :func:`plain_data_error` accepts it."""
    if type(value) is dict:
        if len(value) == 1 and type(value.get("__decimal__")) is str:
            return Decimal(value["__decimal__"])
        return {k: decode_value(v) for k, v in value.items()}
    if type(value) is list:
        return [decode_value(v) for v in value]
    return value


def plain_data_error(value: Any) -> str | None:
    """None if ``value`` is plain data that :func:`decode_value` and a comparison can take
    (None, bool, int, float, str, lists, dicts with str keys, at most ``MAX_DEPTH`` deep and
    ``MAX_NODES`` elements, a ``{"__decimal__": s}`` marker only with a valid, non-signalling
    decimal ``s``); otherwise why not. Iterative: any nesting is safe to check."""
    stack, nodes = [(value, 0)], 0
    while stack:
        x, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"more than {MAX_NODES} elements"
        t = type(x)
        if x is None or t in (bool, int, float, str):
            continue
        if t is dict and len(x) == 1 and "__decimal__" in x:
            if not _valid_decimal(x["__decimal__"]):
                return "a '__decimal__' marker that is not a decimal number"
            continue
        if t not in (list, dict):
            return f"a value of type {t.__name__}"
        if depth >= MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH}"
        if t is dict:
            if not all(type(k) is str for k in x):
                return "a dict key that is not a str"
            x = x.values()
        stack.extend((v, depth + 1) for v in x)
    return None


def _valid_decimal(text: Any) -> bool:
    if type(text) is not str:
        return False
    try:
        return not Decimal(text).is_snan()  # a signalling NaN raises in every comparison
    except (InvalidOperation, ValueError):
        return False


def run_calls(program: str, calls: list[str], limits: SandboxLimits = SandboxLimits()) -> list[CallResult]:
    """Exec ``program`` as module ``solution`` in a confined child, evaluate each call expression
    in its namespace, and return one :class:`CallResult` per call, in order.

    Raises TypeError for a ``program`` that is not a str or ``calls`` that are not a list (or
    tuple) of str (a single str is refused, not split into characters), and
    :class:`SandboxUnavailable` where the host's files cannot be walled off."""
    _check_arguments(program, calls, limits)
    if not calls:
        return []
    results, _layers, refusal, _parsed = _run(program, list(calls), limits)
    if refusal:
        raise SandboxUnavailable(refusal)
    return results


@dataclass(frozen=True)
class AnswerRun:
    """What :func:`run_answer` found: ``chosen``, the index of the first code that parses (None if none
    does: the first was run, and its load failed); ``uses``, how that code uses names and values, by kind
    (``classes``, ``raised``, ``fields``, ``names``, ``strings``, ``numbers``: see
    ``_sandbox_child._answer_uses``); the calls' ``results``; and ``failed``, why the run stopped without
    the answer's fault being a call's: its code could not be read or described in the child, its run could
    not be set up, or its reports could not be read (every call not answered is then an error that says so).
    """

    chosen: int | None
    uses: dict
    results: list
    failed: str | None = None


_HOST_READY: list[bool] = []  # [True] once check_host found that this host builds a sandbox


def check_host(limits: SandboxLimits = SandboxLimits()) -> None:
    """Raise :class:`SandboxUnavailable` where this host cannot build a sandbox, found by one run that holds
    no answer and no program; once it has been built, not again in this process. An answer's run never
    decides it: a run of an answer that fails to set up fails that answer alone (:func:`run_answer`)."""
    if _HOST_READY:
        return
    refusal = _run("", [], limits)[2]
    if refusal:
        raise SandboxUnavailable(refusal)
    _HOST_READY.append(True)


def run_answer(codes: list[str], calls: list[str], limits: SandboxLimits = SandboxLimits(),
               preamble: str = "") -> AnswerRun:
    """Like :func:`run_calls` for the readings of one answer (``codes``, tried in order): the child parses
    each, confined, runs ``preamble`` and the first that parses (or the first, whose load then fails), and
    reports how that code uses names and values before any of it runs. The parent parses nothing: a hostile
    answer costs it no parse. Runs even without calls, for the parse alone.

    The host is checked first (:func:`check_host`, which alone raises :class:`SandboxUnavailable`); whatever
    the answer does, it fails alone: its calls are errors, and ``failed`` says why where it was not a call's
    doing."""
    _check_arguments(preamble, calls, limits)
    if type(codes) not in (list, tuple) or not codes or not all(type(c) is str for c in codes):
        raise TypeError("codes must be a non-empty list of str (the readings of one answer)")
    check_host(limits)
    results, _layers, refusal, (chosen, uses, failed) = _run(preamble, list(calls), limits, answers=list(codes))
    if refusal:
        return AnswerRun(None, {}, [CallResult("error", detail=refusal[:_MAX_DETAIL])] * len(calls), refusal)
    return AnswerRun(chosen if type(chosen) is int and 0 <= chosen < len(codes) else None, uses, results, failed)


def _check_arguments(program: Any, calls: Any, limits: Any) -> None:
    require_opt_in()
    if type(program) is not str:
        raise TypeError(f"program must be a str, got {type(program).__name__}")
    if type(calls) not in (list, tuple):
        raise TypeError(f"calls must be a list of str (one expression each), got {type(calls).__name__}")
    if not all(type(c) is str for c in calls):
        raise TypeError("calls must be a list of str (one expression each)")
    if not isinstance(limits, SandboxLimits):
        raise TypeError("limits must be a SandboxLimits")


def isolation_layers(limits: SandboxLimits = SandboxLimits()) -> list[str]:
    """Which OS-level layers the child sets up on this machine (for logs and tests; runs no
    generated code): e.g. ``["netns", "mountns", "pidns", "ipcns", "utsns", "minimal root",
    "private image 41 MB", "fresh /proc", "read-only root", "tmpfs 16 MB, 4096 inodes", "utsns hostname",
    "rlimits", "uid 1234", "landlock v7", "seccomp allowlist", "memory cgroup 752 MB",
    "channel held by the harness alone", "violation counter"]`` (``"userns"`` first where they were made without root).
    :func:`run_calls` refuses unless the namespaces are there and a "landlock" layer is present. The audit hook is not listed: it is always installed."""
    return _run("", [], limits)[1]


# --------------------------------------------------------------------------------------------
# Parent runner


def _run(program: str, calls: list[str], limits: SandboxLimits, answers: list[str] | None = None
         ) -> tuple[list[CallResult], list[str], str | None, tuple[int | None, dict, str | None]]:
    """Run the child: ``(results, layers, refusal, (chosen, uses, failed))``; ``refusal`` says why no code
    ran, if so (decided before the child reads ``answers``); the last is what the child's parse of
    ``answers`` found, and why the run stopped, if not by a call's doing (see :func:`run_answer`)."""
    uid = _pick_uid()
    base = tempfile.mkdtemp(prefix="pace-sandbox-")
    work = os.path.join(base, "work")
    proc = run = None
    fds: list[int] = []
    cgroup = _memory_cgroup(limits)
    try:
        os.chmod(base, 0o711)  # the child's unprivileged uid must reach work/
        os.mkdir(work, 0o700)
        job = {
            "program": program, "answers": answers, "work": work, "uid": uid, "parent_pid": os.getpid(),
            "cgroup": cgroup, "fifos": True,
            "limits": {k: v for k, v in asdict(limits).items() if k != "timeout_s"},
        }
        call_r, call_w = os.pipe()
        report_r, report_w = os.pipe()
        fds += [call_r, call_w, report_r, report_w]
        with tempfile.TemporaryFile() as job_file:
            job_file.write(json.dumps(job).encode())
            job_file.flush()
            job_file.seek(0)
            deadline = time.monotonic() + limits.timeout_s
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _CHILD, str(job_file.fileno()), str(call_r), str(report_w)],
                cwd=work, env=_child_env(work), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(job_file.fileno(), call_r, report_w), start_new_session=True,
            )
        for fd in (call_r, report_w, call_w):  # the child's ends; call_w is the run's to close
            if fd != call_w:
                os.close(fd)
            fds.remove(fd)
        os.set_blocking(call_w, False)
        run, stderr = _Run(calls, proc.pid, call_w, parse=answers is not None), _Tail(proc.stderr)
        try:
            eof = _read_reports(report_r, stderr, run, deadline)
        finally:
            run.close_calls()
        ended = _child_end(proc, stderr, deadline) if eof and not run.finished() else None
        _kill(proc, uid)
        stderr.drain()
        results = [_scratch_unnamed(r, base) for r in run.results(ended, limits.timeout_s, stderr.last_line())]
        return results, run.layers, run.refusal, (run.chosen, run.uses, run.failed)
    finally:
        if proc is not None:
            if proc.returncode is None:
                _kill(proc, uid)
            proc.stderr.close()
        for fd in fds + (run.fifo_fds if run is not None else []):
            os.close(fd)
        shutil.rmtree(base, ignore_errors=True)
        _remove_cgroup(cgroup)


def _scratch_unnamed(result: CallResult, base: str) -> CallResult:
    """``result`` with the run's scratch folder written ``<sandbox>`` in its diagnostics (``detail``, the
    exception's args): a random temporary path of this machine would otherwise land in every stored
    record, and two runs of the same program would differ by it. Returned values are left as they are."""
    def unnamed(x):
        return x.replace(base, "<sandbox>") if isinstance(x, str) else x
    args = None if result.exc_args is None else [unnamed(a) for a in result.exc_args]
    return replace(result, detail=unnamed(result.detail), exc_args=args)


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


_BROKEN = "the child broke the protocol: an unasked, duplicate, early or malformed answer"
# The keys of a reply the child's harness sends: to the load request, and to a call.
_LOAD_KEYS = frozenset({"c", "violations", "load_error", "ready"})
_CALL_KEYS = frozenset({"c", "violations", "status", "value", "exc_type", "exc_args", "exc_attrs", "detail"})


class _Run:
    """The parent's side of one run. It trusts nothing the child says after the program has
    loaded beyond plain data that answers the question asked:

    * the first line (written before the child reads the answer or runs any code) names the isolation
      layers: the only line that can make the run a refusal (:class:`SandboxUnavailable`);
    * with an answer, the next is the child's parse of it: the reading it runs and how it uses names and
      values, or why the answer could not be read (then the answer fails alone, with that reason);
    * then each request (the load, then call ``i``, sent only after call ``i - 1`` was answered)
      carries a fresh random nonce, and exactly one answer carrying that nonce is accepted for it.
      Any other line (unasked, a second answer, an answer before its request, a malformed one, or one
      beyond the caps of the harness's own replies: ``_sandbox_child.MAX_*``) fails the current call and
      every later one; one that repeats an earlier call's nonce fails that earlier call too. The run
      then stops;
    * a refusal fails the call during which it happened: named in the answer, or only counted by
      the drop of the sandbox process's hard RLIMIT_LOCKS (which only goes down) between sending
      the request and reading its answer."""

    def __init__(self, calls: list[str], child_pid: int, call_fd: int, parse: bool = False) -> None:
        self.calls, self.child_pid, self.call_fd, self.parse = calls, child_pid, call_fd, parse
        self.phase: str | int = "setup"  # then "parse" (with an answer), "load", the outstanding call, "done"
        self.done: list[CallResult] = []
        self.layers: list[str] = []
        self.refusal: str | None = None
        self.failed: str | None = None  # why the run stopped, where no call's answer says it (see stop)
        self.sandbox_pid: int | None = None  # the process that runs the program, as the host sees it
        self.counter: int | None = None
        self.nonces: list[str] = []  # of the load request, then of call 0, 1, ...
        self.broken_from: int | None = None  # the first call failed by a protocol break
        self.broken_why = ""
        self.out = bytearray()  # request bytes not yet taken by the pipe
        self.fifo_fds: list[int] = []  # the report and stderr FIFOs, once taken (see _take_fifos)
        self.chosen: int | None = None  # the child's parse of the answer's readings (see run_answer)
        self.uses: dict[str, list[str]] = {}
        self.taken = 0  # report bytes read

    def finished(self) -> bool:
        return self.phase == "done"

    def close_calls(self) -> None:
        """No more requests: closing the call pipe tells the child to exit."""
        if self.call_fd >= 0:
            os.close(self.call_fd)
            self.call_fd = -1
        self.out.clear()

    def stop(self, why: str) -> None:
        """End the run: before the setup line, a refusal (no answer was read yet); after, every call not yet
        answered is an error that says ``why``."""
        if self.phase == "setup":
            self.refusal = f"sandbox setup failed: {why}"[:_MAX_DETAIL]
        else:
            self.failed = why[:_MAX_DETAIL]
        self.phase = "done"

    def feed(self, line: bytes) -> None:
        why = _shape_error(line)
        msg = None
        if why is None:
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                why = "not JSON"
        if self.phase == "setup":
            if type(msg) is dict and "setup" in msg:
                self._setup(msg)
            else:
                self.refusal, self.phase = "sandbox setup failed: an unexpected first report line", "done"
            return
        if self.phase == "parse":
            self._parsed(msg)
            return
        asked = self.nonces[-1] if self.nonces and self.phase != "done" else None
        if asked is None or type(msg) is not dict or type(msg.get("c")) is not str or msg["c"] != asked:
            self._broken(msg, why)
            return
        why = _over_caps(msg, _LOAD_KEYS if self.phase == "load" else _CALL_KEYS)
        if why is not None:
            self._broken(msg, why)
        elif self.phase == "load":
            self._loaded(msg)
        else:
            self._answered(msg)

    def _setup(self, msg: dict) -> None:
        layers = msg["setup"]
        self.layers = [str(x)[:100] for x in layers[:20]] if type(layers) is list else []
        if msg.get("failed"):
            self.refusal = f"sandbox setup failed: {str(msg['failed'])[:300]}"
        elif not any(layer.startswith(_WALL) for layer in self.layers):
            self.refusal = ("no OS-level wall keeps the generated code from reading the host's files or writing "
                            "outside its scratch directory here: it needs Landlock (Linux >= 5.13, enabled in the "
                            f"kernel's lsm= list); layers set up: {self.layers}")
        self.sandbox_pid = _sandbox_process(self.child_pid)
        self.counter = _violation_counter(self.sandbox_pid) if self.sandbox_pid else None
        if self.counter is not None:
            self.layers.append("violation counter")
        if self.refusal:
            self.phase = "done"
        elif self.parse:
            self.phase = "parse"
        else:
            self._start()

    def _parsed(self, msg: Any) -> None:
        """The child's parse of the answer: the reading it runs and its uses, or why it could not be read."""
        if type(msg) is dict and type(msg.get("rejected")) is str:
            self.stop(f"the answer could not be read: {msg['rejected'][:300]}")
            return
        if type(msg) is not dict or type(msg.get("uses")) is not dict:
            self.stop("the child's parse of the answer was malformed")
            return
        self.chosen = msg.get("chosen") if type(msg.get("chosen")) is int else None
        self.uses = {str(k)[:20]: [x for x in v[:MAX_USES] if type(x) is str and len(x) <= MAX_USE_CHARS]
                     for k, v in list(msg["uses"].items())[:8] if type(v) is list}
        self._start()

    def _start(self) -> None:
        if self.calls:
            self.phase = "load"
            self._ask("")
        else:
            self.phase = "done"

    def _loaded(self, msg: dict) -> None:
        blocked = self._blocked(msg)
        if msg.get("load_error") is not None:
            self._fail_all(str(msg["load_error"])[:_MAX_DETAIL])
        elif blocked:
            self._fail_all(f"program attempted a blocked operation: {blocked}")
        elif msg.get("ready") is True:
            self._next(0)
        else:
            self._broken(msg)

    def _answered(self, msg: dict) -> None:
        blocked = self._blocked(msg)
        result = CallResult("error", detail=f"call attempted a blocked operation: {blocked}") if blocked \
            else self._result(msg)
        self.done.append(result)
        self._next(self.phase + 1)

    def _broken(self, msg: Any, why: str | None = None) -> None:
        """A line that answers no outstanding request, or not as the harness would (``why``): fail from the
        current call on (from the load: every call), or from the call whose nonce it repeats, and stop."""
        failed_from = len(self.done)
        nonce = msg.get("c") if type(msg) is dict else None
        if type(nonce) is str and nonce in self.nonces:
            failed_from = min(failed_from, max(self.nonces.index(nonce) - 1, 0))
        self.broken_from = failed_from if self.broken_from is None else min(self.broken_from, failed_from)
        self.broken_why = f" ({why})" if why else ""
        self.phase = "done"

    def _blocked(self, msg: dict) -> str | None:
        """The refusal seen while the request was outstanding (named, or only counted)."""
        named = msg.get("violations")
        blocked = str(named[0])[:100] if type(named) is list and named else None
        if self.counter is not None:
            now = _violation_counter(self.sandbox_pid)
            if now != self.counter:
                blocked = blocked or "an operation refused by the audit hook"
            self.counter = now if now is not None else -1  # an unreadable counter stays suspect
        return blocked

    def _ask(self, text: str) -> None:
        """Send a request with a fresh nonce: ``NONCE HEX`` (the text as hex-encoded UTF-8)."""
        nonce = secrets.token_hex(16)
        self.nonces.append(nonce)
        self.out += f"{nonce} {text.encode('utf-8').hex()}\n".encode("ascii")
        self.flush()

    def _next(self, i: int) -> None:
        if i >= len(self.calls):
            self.phase = "done"
            return
        self.phase = i
        self._ask(self.calls[i])

    def flush(self) -> None:
        """Write what the call pipe takes now; the rest waits for select to say it is writable."""
        if self.call_fd < 0:
            return
        try:
            del self.out[: os.write(self.call_fd, self.out)]
        except BlockingIOError:
            pass
        except OSError:  # the child is gone: its end is reported through the report pipe
            self.out.clear()

    def _fail_all(self, detail: str) -> None:
        self.done = [CallResult("error", detail=detail)] * len(self.calls)
        self.phase = "done"

    @staticmethod
    def _result(msg: dict) -> CallResult:
        status = msg.get("status")
        if status == "ok" and "value" in msg:
            why = plain_data_error(msg["value"])
            if why is None:
                return CallResult("ok", value=msg["value"])
            return CallResult("error", detail=f"result is not plain data: {why}")
        if status == "raised" and type(msg.get("exc_type")) is str:
            args, attrs = msg.get("exc_args"), msg.get("exc_attrs")
            args = args if type(args) is list and plain_data_error(args) is None else None
            attrs = attrs if type(attrs) is dict and plain_data_error(attrs) is None else {}
            return CallResult("raised", exc_type=msg["exc_type"], exc_args=args, exc_attrs=attrs)
        if status == "error":
            return CallResult("error", detail=str(msg.get("detail", ""))[:_MAX_DETAIL])
        return CallResult("error", detail="malformed report from the child")

    def results(self, ended: str | None, timeout_s: float, stderr_tail: str) -> list[CallResult]:
        """The results so far, then one per missing call: error if the run stopped (``failed``) or the child
        ended (``ended`` says how), timeout otherwise. A protocol break fails every call from the one it hit."""
        out = list(self.done[: len(self.calls)])
        if self.broken_from is not None:
            out = out[: self.broken_from]
            return out + [CallResult("error", detail=_BROKEN + self.broken_why)] * (len(self.calls) - len(out))
        if self.failed is not None:
            missing = CallResult("error", detail=self.failed)
        elif ended is not None:
            detail = ended + (f"; stderr: {stderr_tail}" if stderr_tail else "")
            missing = CallResult("error", detail=detail[:_MAX_DETAIL])
        else:
            missing = CallResult("timeout", detail=f"no result within the {timeout_s:g} s wall-clock limit")
        return out + [missing] * (len(self.calls) - len(out))


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))
_STRING = re.compile(rb'"[^"]*"')


def _shape_error(line: bytes) -> str | None:
    """Why ``line`` is not handed to ``json.loads`` (more than ``_MAX_LINE_NODES`` values, nested deeper than
    ``_MAX_LINE_DEPTH``, unbalanced brackets), or None. Counted on the bytes outside strings (escaped
    backslashes and quotes blanked first, then every string dropped) by C-level bytes and regex methods: linear
    in the line, and no object per value is built."""
    bare = _STRING.sub(b"", line.replace(b"\\\\", b"__").replace(b'\\"', b"__"))
    opened = bare.count(b"[") + bare.count(b"{")
    if opened != bare.count(b"]") + bare.count(b"}"):
        return "unbalanced brackets"
    if bare.count(b",") + opened + 1 > _MAX_LINE_NODES:
        return f"more than {_MAX_LINE_NODES} values in a line"
    if opened > _MAX_LINE_DEPTH:
        depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, bare.translate(None, _NOT_BRACKETS))))
        if depth > _MAX_LINE_DEPTH:
            return f"a line nested deeper than {_MAX_LINE_DEPTH}"
    return None


def _json_chars(value: Any) -> int:
    """The length of ``value`` as the child's harness writes it (ASCII JSON, no spaces)."""
    return len(json.dumps(value, separators=(",", ":")))


def _over_caps(msg: dict, keys: frozenset) -> str | None:
    """Why ``msg`` is no reply the child's harness sends (its keys, and the caps it keeps:
    ``_sandbox_child.MAX_*``), or None. Such a reply was written by other code: it breaks the protocol."""
    if not msg.keys() <= keys:
        return f"a reply with keys the harness never sends: {sorted(msg.keys() - keys)[:3]}"
    named = msg.get("violations", [])
    if not (type(named) is list and len(named) <= MAX_VIOLATION_NAMES
            and all(type(x) is str and len(x) <= MAX_VIOLATION_CHARS for x in named)):
        return f"refusals named beyond the harness's caps ({MAX_VIOLATION_NAMES} of {MAX_VIOLATION_CHARS} characters)"
    for key, cap in (("detail", MAX_DETAIL_CHARS), ("load_error", MAX_DETAIL_CHARS), ("exc_type", MAX_TYPE_CHARS)):
        if key in msg and not (type(msg[key]) is str and len(msg[key]) <= cap):
            return f"a {key} that is not a str of at most {cap} characters"
    if "value" in msg and _json_chars(msg["value"]) > MAX_VALUE_CHARS:
        return f"a value over {MAX_VALUE_CHARS} characters"
    args, attrs = msg.get("exc_args"), msg.get("exc_attrs", {})
    if args is not None and not (type(args) is list and len(args) <= MAX_EXC_ITEMS
                                 and _json_chars(args) <= MAX_EXC_CHARS):
        return f"exception args beyond the harness's caps ({MAX_EXC_ITEMS}, {MAX_EXC_CHARS} characters)"
    if not (type(attrs) is dict and len(attrs) <= MAX_EXC_ITEMS and _json_chars(attrs) <= MAX_EXC_CHARS
            and not any(k.startswith("__") for k in attrs)):
        return f"exception attributes beyond the harness's caps ({MAX_EXC_ITEMS}, {MAX_EXC_CHARS} characters)"
    return None


def _sandbox_process(child_pid: int) -> int | None:
    """The host pid of the process that runs the program: the child's only child (init, pid 1 of
    the run's pid namespace), then init's only child. None if that chain is not there."""
    pid = child_pid
    for _level in range(2):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        if len(kids) != 1:
            return None
        pid = int(kids[0])
    return pid


def _violation_counter(pid: int) -> int | None:
    """The child's hard RLIMIT_LOCKS, or None if it cannot be read."""
    try:
        return resource.prlimit(pid, _RLIMIT_LOCKS)[1]
    except (OSError, AttributeError):
        pass
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max file locks"):
                    hard = line.split()[4]
                    return -2 if hard == "unlimited" else int(hard)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_reports(fd: int, stderr: "_Tail", run: _Run, deadline: float) -> bool:
    """Feed complete lines to the run until it has ended or the pipe closes (returns True) or the deadline
    passes (returns False), sending pending requests when the call pipe takes them. Once the run has ended
    nothing more is read: whatever the child sends then costs the parent nothing. An overlong line is not
    buffered: it breaks the protocol; past ``_MAX_RUN_BYTES`` in all, or where the pipe cannot be read, the
    run stops (every call not yet answered fails, with the reason). The child's stderr is read alongside so
    that a flood cannot block it; only its tail is kept."""
    buf = bytearray()
    skipping = False
    while not run.finished():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        ready, writable, _ = select.select([fd] + stderr.fds(), [run.call_fd] if run.out else [], [], remaining)
        if writable:
            run.flush()
        if stderr.fd in ready:
            stderr.read()
        if fd not in ready:
            continue
        try:
            chunk = os.read(fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            continue  # read by someone else between select and read: nothing to read after all
        except OSError as e:
            run.stop(f"the parent could not read the run's reports ({e})")
            return True
        if not chunk:
            return True
        run.taken += len(chunk)
        if run.taken > _MAX_RUN_BYTES:
            run.stop(f"the run sent more than {_MAX_RUN_BYTES >> 20} MiB of reports")
            return True
        buf += chunk
        while not run.finished():
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _MAX_LINE:
                    buf.clear()
                    skipping = True
                    run.feed(b"")  # not an answer: the protocol is broken
                break
            line = bytes(buf[:end])
            del buf[: end + 1]
            if skipping:
                skipping = False  # the tail of an overlong line
            elif run.phase == "setup" and not run.fifo_fds and line.startswith(b'{"fifos":'):
                fd = _take_fifos(run, stderr, line, fd)
            else:
                run.feed(line)
    return True


def _take_fifos(run: _Run, stderr: "_Tail", line: bytes, report_fd: int) -> int:
    """The parent's half of the child's ``_swap_pipes`` (sent before the program loads): open the run's
    FIFOs through ``/proc/PID/root`` of the sandbox process, make the call FIFO the run's call fd (closing
    the call pipe tells the child to switch), read stderr from its FIFO; returns the fd to read reports
    from next. Where they cannot be opened, the run is refused and the report pipe stays."""
    try:
        pid = _sandbox_process(run.child_pid)
        base = f"/proc/{pid}/root{json.loads(line)['fifos']}/.pace-"
        for name in ("report", "stderr"):
            run.fifo_fds.append(os.open(base + name, os.O_RDONLY | os.O_NONBLOCK))
        call = os.open(base + "call", os.O_WRONLY | os.O_NONBLOCK)
    except (OSError, ValueError, KeyError, TypeError) as e:
        run.refusal, run.phase = f"sandbox setup failed: the run's FIFOs cannot be opened ({e})", "done"
        return report_fd
    run.close_calls()
    run.call_fd = call
    stderr.fd = run.fifo_fds[1]
    os.set_blocking(stderr.fd, False)
    return run.fifo_fds[0]


class _Tail:
    """The last few KB of a pipe, read without ever blocking; at most ``_MAX_STDERR_BYTES`` in all (then
    it is no longer read, and a child that writes more waits)."""

    def __init__(self, file, keep: int = 2000) -> None:
        self.fd, self.keep, self.data, self.open, self.taken = file.fileno(), keep, b"", True, 0
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
        self.taken += len(chunk)
        if not chunk or self.taken >= _MAX_STDERR_BYTES:
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


def _memory_cgroup(limits: SandboxLimits) -> dict | None:
    """A memory cgroup for one run, beneath this process's own (cgroup v1's memory hierarchy, or v2
    where this process may make one), limited to the run's memory, its image and its scratch disk plus
    64 MB: the kernel charges a run's negative dentries, page cache, page tables and most slab there, so
    no run grows the host's kernel memory past that, and :func:`_remove_cgroup` frees what it made. Its
    name carries this process's pid (``pace-run-PID-HEX``), so that the first run of a process can sweep
    the folders that a dead process left (:func:`_sweep_cgroups`). None where the host has no memory
    controller we may use (not root, no delegation): the layer is then missing from the run's layers, and
    the private image still frees the run's dentries and pages when it ends."""
    from pace_bench.metrics.pace_coding._sandbox_child import _IMAGE_MB

    limit_mb = limits.memory_mb + _IMAGE_MB + limits.max_disk_mb + 64
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            base, limit_file = "/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes"
        elif controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            base, limit_file = "/sys/fs/cgroup" + path, "memory.max"
        else:
            continue
        v1 = limit_file == "memory.limit_in_bytes"
        if base not in _SWEPT:
            _sweep_cgroups(base, v1)
            _SWEPT.add(base)
        folder = os.path.join(base, f"{_CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            os.mkdir(folder)
        except OSError:
            continue
        try:
            with open(os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit_mb << 20))
            return {"path": folder, "limit_mb": limit_mb, "v1": v1}
        except OSError:
            _remove_cgroup({"path": folder, "v1": v1})
    return None


_CGROUP_PREFIX = "pace-run-"
_SWEPT: set[str] = set()  # cgroup folders this process has swept of leftovers
_REMOVE_S = 10.0  # how long the parent may take to empty and remove a run's cgroup before it says so


class SandboxLeak(RuntimeError):
    """A run's memory cgroup could not be emptied and removed: each left behind holds one of the host's
    65,535 memory-cgroup ids, and once they run out later runs go without one. Raised, never ignored."""


def _sweep_cgroups(base: str, v1: bool) -> None:
    """Remove the run cgroups beneath ``base`` whose owner (the pid in the name) is gone: a parent killed
    before its cleanup. Folders without an owner pid (the old ``pace-run-HEX`` names) only if empty."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(_CGROUP_PREFIX)]
    except OSError:
        return
    for name in names:
        owner, sep, _ = name[len(_CGROUP_PREFIX):].partition("-")
        path = os.path.join(base, name)
        if sep and owner.isdigit():
            if owner != str(os.getpid()) and os.path.exists(f"/proc/{owner}"):
                continue  # a live process's run
        elif _cgroup_pids(path):
            continue
        _remove_cgroup({"path": path, "v1": v1})


def _cgroup_pids(path: str) -> list[int] | None:
    """The processes in a cgroup (``cgroup.procs``), or None if it is gone."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []


def _remove_cgroup(cgroup: dict | None) -> None:
    """Kill every process left in the run's cgroup, wait until ``cgroup.procs`` is empty, reclaim what it
    still holds (negative dentries, pages), so that it is freed rather than handed to the parent cgroup,
    then remove it. Raises :class:`SandboxLeak` if that has not happened within ``_REMOVE_S`` seconds
    (a process that dies slowly, say while the kernel frees millions of its objects, is waited for)."""
    if cgroup is None:
        return
    path = cgroup["path"]
    control, value = ("memory.force_empty", "0") if cgroup["v1"] else ("memory.reclaim", str(1 << 40))
    deadline, why = time.monotonic() + _REMOVE_S, ""
    while True:
        pids = _cgroup_pids(path)
        if pids is None:
            return
        if pids:
            why = f"{len(pids)} processes still in it"
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        else:
            try:
                with open(os.path.join(path, control), "w") as f:
                    f.write(value)
            except OSError:
                pass
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                why = f"rmdir: {e}"
        if time.monotonic() > deadline:
            raise SandboxLeak(f"the run's memory cgroup {path} could not be removed within {_REMOVE_S:g} s ({why})")
        time.sleep(0.01)
