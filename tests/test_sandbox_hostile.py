"""Attacks that treat the child's interpreter as the program's to control (issue 22, section 1).

Each test runs a real attack through :func:`run_calls` and then checks the host: no new System V
object or POSIX message queue, no file written outside the scratch area, no sandbox process left,
bounded kernel memory, and no false credit (a forged value never passes)."""

import os
import textwrap
import threading
import time

import pytest

from pace_hf.metrics.pace_coding.sandbox import SandboxLimits, run_calls

from host_objects import mqueue_exists, sysv_objects

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
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_WRONLY:
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


def test_early_duplicate_and_unasked_answers_fail_the_calls(host):
    """Forged answers used to be accepted: one for call 0 sent before it was asked, a duplicate,
    and one for call 1 (here 2) sent early. Each request now carries a fresh nonce the program
    never sees, and any line that is not the one answer to the outstanding request fails that call
    and every later one."""
    results = run(_FORGER, ["0", "duplicate_and_early()", "2", "3"])
    assert not any(passes(r, 42) for r in results), results
    assert passes(results[0], 0)
    assert [r.status for r in results[1:]] == ["error"] * 3, results
    assert all("broke the protocol" in r.detail for r in results[1:])


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
        """, ["forged_consts()", "new_function()", "unmarshal()", "asyncio.run(later())"])
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
