"""Attacks that treat the child's interpreter as the program's to control (issue 22, section 1).

Each test runs a real attack through :func:`run_calls` and then checks the host: no new System V
object or POSIX message queue, no file written outside the scratch area, no sandbox process left,
bounded kernel memory, and no false credit (a forged value never passes)."""

import glob
import importlib.machinery
import os
import textwrap
import threading
import time

import pytest

from pace_bench.metrics.pace_coding.sandbox import SandboxLimits, run_calls

from host_objects import mqueue_exists, sysv_objects
from test_sandbox import _gone

QUICK = SandboxLimits(timeout_s=8.0, memory_mb=256, cpu_s=5)
QUEUE = b"/pace-sandbox-covert"
pytestmark = pytest.mark.usefixtures("code_eval_allowed")


def run(program, calls, limits=QUICK):
    return run_calls(textwrap.dedent(program), calls, limits)


def passes(result, expected):
    return result.status == "ok" and type(result.value) is type(expected) and result.value == expected


@pytest.fixture
def host(tmp_path):
    """A world-writable directory the program aims at, and the host's kernel objects: afterwards
    the directory is unchanged, no System V object or message queue is new, and no process of the
    sandbox is left."""
    target = tmp_path / "open"
    target.mkdir()
    os.chmod(target, 0o777)
    (target / "sentinel").write_text("keep me")
    before = sysv_objects()
    yield target
    assert sorted(os.listdir(target)) == ["sentinel"] and (target / "sentinel").read_text() == "keep me"
    assert sysv_objects() == before
    assert not mqueue_exists(QUEUE)


# --------------------------------------------------------------------------------------------
# A covert channel between runs


_PID_WRITER = """
import os, threading
def encode(k):
    # start threads until the next pid is k modulo 64: the next run reads it from its own pid
    for _ in range(256):
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        if (t.native_id + 1) % 64 == k:
            break
    return 0
"""

_PID_READER = """
import os, threading
def decode():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return [os.getpid(), t.native_id, (os.getpid() - 1) % 64]
"""


def test_pid_numbers_carry_nothing_from_one_run_to_the_next(host):
    """The three probes' children used to share the host's pid allocator: one run encoded a fact
    in the next free pid, by starting threads, and the next run read its own pid. Each run now has
    its own pid namespace: what it sees is the same whatever the run before it did."""
    seen = []
    for secret in (5, 40):
        assert passes(run(_PID_WRITER, [f"encode({secret})"])[0], 0)
        seen.append(run(_PID_READER, ["decode()"])[0])
    assert all(r.status == "ok" for r in seen), seen
    assert seen[0].value == seen[1].value, seen  # nothing of the writer's threads shows
    assert not (seen[0].value[2] == 5 and seen[1].value[2] == 40)  # no false credit


# --------------------------------------------------------------------------------------------
# Program code answering the harness's questions


def test_builtins_with_missing_do_not_answer_a_checks_undefined_name(host):
    """A module-level ``__builtins__`` dict subclass with ``__missing__`` used to answer the
    check's lookup of a class the program never defined. Each call now gets a fresh copy of the
    builtins: the name is undefined, the check raises NameError."""
    results = run("""
        import builtins, dataclasses
        class Anything(dict):
            def __missing__(self, name):
                return dataclasses.make_dataclass(name, ["id", "amount", "state"])
        __builtins__ = Anything(builtins.__dict__)
        """, ['(lambda c: __import__("dataclasses").is_dataclass(c))(Ledger)',
              '(lambda c: [f.name for f in __import__("dataclasses").fields(c)])(Ledger)'])
    assert not passes(results[0], True), results
    assert not passes(results[1], ["id", "amount", "state"])
    assert [(r.status, r.exc_type) for r in results] == [("raised", "NameError")] * 2


_JSON_HIJACK = """
import json, threading
worker = threading.get_ident()
ran = []
_iterencode, _loads, _dumps = json.JSONEncoder.iterencode, json.loads, json.dumps

def iterencode(self, o, _one_shot=False):
    ran.append("iterencode")
    if type(o) is dict and "status" in o:
        o["status"], o["value"] = "ok", 42   # rewrite the harness's answer
    return _iterencode(self, o, _one_shot)

def loads(s, *args, **kwargs):
    ran.append("loads")
    return _loads(s, *args, **kwargs)

def dumps(o, *args, **kwargs):
    ran.append("dumps")
    return _dumps(o, *args, **kwargs)

json.JSONEncoder.iterencode, json.loads, json.dumps = iterencode, loads, dumps
"""


def test_replaced_json_functions_never_run_in_the_harness(host):
    """Replacing ``json.JSONEncoder.iterencode`` or ``json.loads`` used to run program code in
    the harness thread, which rewrote the answer (and saw the nonce). The harness now reads and
    writes the pipes with bytes functions and a JSON encoder captured before the program loads."""
    results = run(_JSON_HIJACK, ["0", "'zero'", "ran"])
    assert passes(results[0], 0) and passes(results[1], "zero"), results
    assert passes(results[2], []), results  # none of the program's replacements ever ran


_FORGER = _JSON_HIJACK.replace('ran.append("iterencode")', '''ran.append("iterencode")
    if type(o) is dict and type(o.get("n")) is str and not forging:
        nonce[0] = o["n"]
        if o.get("ready"):   # answer call 0 before it is asked
            forge({"n": nonce[0], "ready": True}, {"n": nonce[0], "i": 0, "status": "ok", "value": 42})''') + """
import fcntl, os, stat
nonce, forging = ["0" * 32], []

def _write_pipes():
    found = []
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
                found.append(fd)
        except OSError:
            pass
    return found

def forge(*messages):
    forging.append(1)
    data = "".join(_dumps(m) + "\\n" for m in messages).encode()
    for fd in _write_pipes():
        os.write(fd, data)

def duplicate_and_early():
    forge({"n": nonce[0], "c": nonce[0], "i": 0, "status": "ok", "value": 42},
          {"n": nonce[0], "c": nonce[0], "i": 2, "status": "ok", "value": 42})
    return 1
"""


def test_early_duplicate_and_unasked_answers_never_reach_the_parent(host):
    """Forged answers used to be accepted: one for call 0 sent before it was asked, a duplicate,
    and one for call 1 (here 2) sent early. Each request then carried a fresh nonce the program never
    sees, and any line that was not the one answer to the outstanding request failed that call and
    every later one. Now (issue 66) the program's threads hold no descriptor of the report FIFO, so
    what they forge never reaches the parent, and every call is answered as asked (the parent's
    handling of such lines: ``test_sandbox.py``)."""
    results = run(_FORGER, ["0", "duplicate_and_early()", "2", "3", "_write_pipes()"])
    assert not any(passes(r, 42) for r in results), results
    assert [r.value for r in results] == [0, 1, 2, 3, []], results  # no writable FIFO from fd 3 up


# --------------------------------------------------------------------------------------------
# The audit hook switched off from pure Python, then ctypes


_UNHOOK_THEN_NATIVE = """
import os, sqlite3, sys

def switch_off():
    # a suspended generator's frame, resumed from inside the hook by an __eq__ it runs
    frames = []
    def gen():
        me = frames[0]
        while True:
            chain, frame = [], me.f_back
            while frame is not None:
                chain.append(frame)
                frame = frame.f_back
            frames.append(chain)
            yield
    g = gen()
    frames.append(g.gi_frame)
    class Sly:
        def __eq__(self, other):
            next(g)
            return False
        __hash__ = object.__hash__
    try:
        sqlite3.connect(Sly())
    except Exception:
        pass
    for frame in frames[1] if len(frames) > 1 else []:
        names = frame.f_locals
        if "check_open" in names and "deny" in names:
            for cell in names["check_open"].__closure__ or ():
                if cell.cell_contents is names["deny"]:
                    cell.cell_contents = lambda event: None
            return "off"
    return "on"

def native(target):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    out = [libc.shmget(0, 32 << 20, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600),
           libc.mq_open(QUEUE, os.O_CREAT | os.O_RDWR, 0o600, None)]
    with open(target + "/escaped", "w") as f:
        f.write("x")
    return out
"""


def test_frames_and_eq_inside_the_hook_cannot_switch_it_off(host):
    """An ``__eq__`` run inside the hook (via ``sqlite3.connect``) resumed a generator whose frame
    led to the hook's closure, whose ``deny`` cell was replaced; then ctypes made System V objects
    and a message queue that outlived the run. Now generator frames are refused outright, the hook
    type-checks before comparing, and the kernel refuses the objects in any case (seccomp
    allowlist, IPC namespace: see test_sandbox_walls)."""
    program = _UNHOOK_THEN_NATIVE.replace("QUEUE", repr(QUEUE))
    results = run(program, ["switch_off()", f"native({str(host)!r})", "'alive'"])
    assert not passes(results[0], "off"), results
    assert results[0].status == "error" and "gi_frame" in results[0].detail
    assert results[1].status != "ok", results
    assert passes(results[2], "alive")


def test_hand_made_code_objects_are_refused(host):
    """``code.replace`` and ``FunctionType`` (both allowed before) build a ``LOAD_CONST`` past
    ``co_consts``: arbitrary memory access, and the interpreter's hook list emptied. Code objects
    and functions made by hand, and code unmarshalled by the program, are refused; the stdlib's own
    use (``types.coroutine``, the import system) still works."""
    results = run("""
        import asyncio, marshal, types
        def one():
            return 1
        def forged_consts():
            return types.FunctionType(one.__code__.replace(co_consts=(None, 42)), {})()
        def new_function():
            return types.FunctionType(one.__code__, {})()
        def unmarshal():
            return types.FunctionType(marshal.loads(marshal.dumps(one.__code__)), {})()
        async def later():
            return "async"
        def step(coroutine):  # no event loop: a run can make no socket for its self-pipe
            try:
                coroutine.send(None)
            except StopIteration as e:
                return e.value
        """, ["forged_consts()", "new_function()", "unmarshal()", "step(later())"])
    assert not any(passes(r, 42) or passes(r, 1) for r in results[:3]), results
    assert [r.status for r in results[:3]] == ["error"] * 3
    assert "code.__new__" in results[0].detail and "function.__new__" in results[1].detail
    assert "marshal.loads" in results[2].detail
    assert passes(results[3], "async")


# --------------------------------------------------------------------------------------------
# Host memory


def _slab_kb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1])
    raise AssertionError("no Slab line in /proc/meminfo")


def test_a_directory_flood_meets_the_inode_cap(host):
    """``os.mkdir`` costs no tmpfs block: 700,000 directories in 8 s grew the host's kernel slab by
    1 GiB. The scratch tmpfs now has ``nr_inodes=``: the flood stops at ENOSPC, and the host's slab
    stays within a bound while the run lasts."""
    limits = SandboxLimits(timeout_s=15.0, memory_mb=256, cpu_s=10)
    base, peak, stop = _slab_kb(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _slab_kb())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = run("""
            import os
            def flood(n):
                for made in range(n):
                    try:
                        os.mkdir("d%d" % made)
                    except OSError as e:
                        return [made, e.errno]
                return [n, None]
            """, ["flood(150000)"], limits)
    finally:
        stop.set()
        sampler.join()
    assert results[0].status == "ok", results
    made, errno = results[0].value
    assert made <= 8192 and errno == 28, results  # ENOSPC: the inode cap, far below 150,000
    assert peak[0] - base < 64 * 1024, (base, peak)  # KB: the dentries and inodes of a few thousand


def test_queued_signals_and_timers_are_capped(host):
    """Queued signals and POSIX timers (each holds a preallocated signal) are kernel memory that
    RLIMIT_AS does not count: under the host's RLIMIT_SIGPENDING (about 100,000 here) 96,363 timers
    pinned 37 MB of unreclaimable slab per run. The child now caps RLIMIT_SIGPENDING; a program
    queueing signals to itself meets EAGAIN at the cap."""
    results = run("""
        import resource, signal
        def queue():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
            for n in range(200_000):
                try:
                    signal.raise_signal(signal.SIGRTMIN)
                except OSError as e:
                    return [n, e.errno]
            return [n, None]
        """, ["queue()", "list(resource.getrlimit(resource.RLIMIT_SIGPENDING))"])
    assert results[0].status == "ok" and results[0].value[0] <= 64 and results[0].value[1] == 11, results
    assert passes(results[1], [64, 64])


def test_the_base_interpreters_site_packages_stay_out_of_reach(host):
    """``-S`` only left site-packages off ``sys.path``: a program appended the standard library's
    own ``site-packages`` (pyenv, python.org and conda builds keep it there) and imported the base
    interpreter's third-party C extensions, e.g. ``_cffi_backend``, which calls C as ctypes does, past
    the audit hook and its counter. An empty tmpfs now covers it in the run's mount namespace."""
    results = run("""
        import os, sys
        def packages():
            return {os.path.join(root, name): os.listdir(os.path.join(root, name)) for root in sys.path
                    for name in ("site-packages", "dist-packages") if os.path.isdir(os.path.join(root, name))}
        def foreign():
            sys.path.append(os.path.join(sys.path[0], "site-packages"))
            import _cffi_backend
            return repr(_cffi_backend.load_library(None))
        """, ["packages()", "foreign()"])
    assert results[0].status == "ok" and not any(results[0].value.values()), results
    assert results[1].status == "raised" and results[1].exc_type == "ModuleNotFoundError", results


def test_a_refusal_in_a_forked_child_fails_the_call(host):
    """Where processes are allowed, a refusal in a forked child lowered only that child's own
    counter, which the parent never reads: the call scored as passing. A refusal now lowers the
    sandbox process's counter, from whichever process of the run it comes."""
    results = run("""
        import os
        def sneaky():
            pid = os.fork()
            if pid == 0:
                try:
                    open("/etc/passwd").read()
                except Exception:
                    pass
                os._exit(0)
            os.waitpid(pid, 0)
            return 42
        """, ["sneaky()", "1"], SandboxLimits(timeout_s=8.0, memory_mb=256, cpu_s=5, max_processes=1))
    assert not passes(results[0], 42), results
    assert results[0].status == "error" and "blocked operation" in results[0].detail
    assert passes(results[1], 1)


def test_processes_that_leave_the_group_do_not_outlive_the_run(host):
    """Where processes are allowed: a grandchild in its own session (out of the process group the
    parent kills), ignoring SIGTERM and SIGHUP, dies with the run's pid namespace."""
    results = run("""
        import os, signal, time
        def escape():
            pid = os.fork()
            if pid == 0:
                os.setsid()
                if os.fork() == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    time.sleep(60)
                os._exit(0)
            os.waitpid(pid, 0)
            return os.getuid()
        """, ["escape()"], SandboxLimits(timeout_s=8.0, memory_mb=256, cpu_s=5, max_processes=3))
    assert results[0].status == "ok", results
    time.sleep(0.1)
    assert _gone(results[0].value)


def test_a_thread_finds_no_report_pipe_to_write_garbage_to(host):
    """A program thread wrote invalid UTF-8, or a line longer than the parent buffers, on the report
    pipe, which failed the call during which it came and every later one. Now (issue 66) no
    descriptor of the program's reaches the report FIFO: the garbage goes nowhere, and the calls are
    answered."""
    program = """
        import fcntl, os, stat
        def garbage(data):
            written = 0
            for fd in range(3, 64):
                try:
                    if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
                        os.write(fd, data)
                        written += 1
                except OSError:
                    pass
            return written
        """
    for data in ("b'\\xff\\xfe{}\\n'", "b'x' * (5 << 20)"):
        results = run(program, [f"garbage({data})", "42"])
        assert passes(results[0], 0) and passes(results[1], 42), results


_LOAD_EXTENSION = """
import glob, importlib.machinery, shutil, sys, _imp
def load(name, path):
    return repr(_imp.create_dynamic(importlib.machinery.ModuleSpec(name, None, origin=path)))
def stdlib():
    return load("_bisect", glob.glob(sys.path[0] + "/lib-dynload/_bisect.*")[0])
def copied():
    shutil.copy(glob.glob(sys.path[0] + "/lib-dynload/_bisect.*")[0], "mine.so")
    return load("_bisect", "./mine.so")
"""


def test_bytes_written_to_the_scratch_never_run_as_machine_code(host):
    """A shared object written to the scratch directory (here a copy of a stdlib one; a program
    could carry its own bytes) loaded with ``_imp.create_dynamic``: native code past every layer in
    the interpreter. The scratch tmpfs is now ``noexec``: the kernel refuses to map it."""
    results = run(_LOAD_EXTENSION, ["copied()", "stdlib()"])
    assert results[0].status == "raised" and "failed to map segment" in results[0].exc_args[0], results
    assert results[1].status == "ok" and "_bisect" in results[1].value, results  # the stdlib's own still loads


def test_c_extensions_outside_the_standard_library_are_refused(host):
    """The system's own Python packages (``/usr/lib/python3/dist-packages`` here) are readable
    under Landlock's system roots: ``_imp.create_dynamic`` loaded ``_cffi_backend`` from there and
    made foreign calls without a refusal. The audit hook now refuses an extension whose file is
    outside the standard library and the scratch directory."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    found = sorted(glob.glob(f"/usr/lib/python3*/*-packages/*{suffix}")
                   + glob.glob(f"/usr/local/lib/python3*/*-packages/*{suffix}"))
    if not found:
        pytest.skip(f"no C extension module ({suffix}) in the system's Python packages here")
    path = next((p for p in found if "_cffi_backend" in p), found[0])
    name = os.path.basename(path)[: -len(suffix)]
    results = run(_LOAD_EXTENSION, [f"load({name!r}, {path!r})", "stdlib()"])
    assert results[0].status == "error" and "from outside the standard library" in results[0].detail, results
    assert results[1].status == "ok", results


# --------------------------------------------------------------------------------------------
# The parent's work is bounded by the answer, not by the timeout (issue 66)


_FLOOD = """
import fcntl, os, stat, threading, time
LINE = ("[" + ",".join(["[" * 49 + "]" * 49] * 42_000) + "]\\n").encode()  # 4 MB, lists nested 50 deep
written = [0]

def _writable_fifos():
    found = []
    for fd in range(64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
                found.append(fd)
        except OSError:
            pass
    return found

def _flood(fd):
    try:
        os.write(fd, b"not an answer\\n")
        while True:
            for at in range(0, len(LINE), 1 << 16):
                written[0] += os.write(fd, LINE[at:at + (1 << 16)])
    except OSError:
        pass

def f():
    fifos = _writable_fifos()
    for fd in fifos:
        threading.Thread(target=_flood, args=(fd,), daemon=True).start()
    if fifos != [2]:  # the report FIFO is in reach: flood it to the deadline
        time.sleep(3600)
    while True:  # stderr alone: until the parent stops taking it
        before = written[0]
        time.sleep(1.0)
        if written[0] == before:
            return 1
"""


def test_the_parents_cpu_on_a_flood_does_not_grow_with_the_timeout(host):
    """Issue 66: an answer broke the protocol, then wrote a 4 MB JSON line of lists nested 50 deep to the
    report FIFO again and again; the parent read and parsed every line until the deadline, even once the
    run was over: 13-17 s of its CPU at the default 10 s timeout, 31.6 s at 20 s. Now the answer's threads
    cannot reach the report FIFO, the parent stops reading once the run has ended, and what it reads of a
    run (reports and stderr) is capped: at a 20 s timeout the flood (stderr alone, now) costs the parent
    well under a second, and the call is answered once the parent stops taking stderr."""
    limits = SandboxLimits(timeout_s=20.0, memory_mb=256, cpu_s=20)
    cpu = time.process_time()
    results = run(_FLOOD, ["f()"], limits)
    cpu = time.process_time() - cpu
    assert cpu < 1.0 and passes(results[0], 1), (cpu, results)
