"""Tests for pace_bench.metrics.pace_coding.sandbox: correct code round-trips as plain data, and escape attempts are both
contained (the host is unharmed) and scored as not passing."""

import os
import socket
import textwrap
import time

import pytest
from host_objects import children

from pace_bench.metrics.pace_coding.sandbox import (
    CallResult,
    CodeExecutionNotAllowed,
    SandboxLimits,
    decode_value,
    isolation_layers,
    require_opt_in,
    run_calls,
)

QUICK = SandboxLimits(timeout_s=5.0, memory_mb=256, cpu_s=5)
pytestmark = pytest.mark.usefixtures("code_eval_allowed")


def run(program, calls, limits=QUICK):
    return run_calls(textwrap.dedent(program), calls, limits)


def passes(result, expected):
    """How a metric scores a call: status ok and the same plain value, types included."""
    return result.status == "ok" and _same(result.value, expected)


def _same(a, b):
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _gone(uid):
    """No process of the sandbox's fresh uid is left on the host (the program reports its uid:
    its pid is that of its own pid namespace, which means nothing here). Without root there is no
    fresh uid to look for, and the pid namespace's end is the only guarantee."""
    if os.geteuid() != 0:
        return True
    assert uid >= 100_000, uid  # a fresh uid, not root's or a user's
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.split()[1:2] == [str(uid)] for line in f if line.startswith("Uid:")):
                    return False
        except OSError:
            continue
    return True


@pytest.fixture
def host(tmp_path):
    """A sentinel file outside the sandbox; afterwards it must be unchanged, nothing may have
    been created next to it, and no sandbox process may be left over."""
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    before, running = sorted(os.listdir(tmp_path)), children()
    yield tmp_path
    assert sentinel.read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == before
    assert children() <= running


# --------------------------------------------------------------------------------------------
# Correct code


PROGRAM = """
from dataclasses import dataclass
from decimal import Decimal

class LedgerError(Exception):
    def __init__(self, code, amount=None):
        super().__init__(code)
        self.code, self.amount, self.handle = code, amount, object()

@dataclass
class Entry:
    amount: int

RATES = {"gold": Decimal("0.025"), "silver": Decimal("0.04")}

def fee_for(amount, tier):
    return (amount * RATES[tier]).quantize(Decimal("0.01"))

def settle(entries):
    if not entries:
        raise LedgerError("E-417", amount=0)
    return {"total": sum(e["amount"] for e in entries), "ids": tuple(e["id"] for e in entries)}

def stats(xs):
    return [len(xs), sum(xs) / len(xs), None, True, "ok", float("inf")]

if __name__ == "__main__":
    raise SystemExit("demo code must not run")
"""


def test_values_exceptions_and_decimals_come_back_as_plain_data():
    results = run(PROGRAM, [
        "fee_for(1250, 'gold')",
        "settle([])",
        "settle([{'amount': 5, 'id': 'a'}, {'amount': 7, 'id': 'b'}])",
        "stats([1, 2, 3])",
        "__name__",
        "Entry(3)",
        "RATES['platinum']",
    ])
    assert [r.status for r in results] == ["ok", "raised", "ok", "ok", "ok", "error", "raised"]
    assert results[0].value == {"__decimal__": "31.25"}
    assert decode_value(results[0].value) == __import__("decimal").Decimal("31.25")
    assert results[1].exc_type == "LedgerError" and results[1].exc_args == ["E-417"]
    assert results[1].exc_attrs == {"code": "E-417", "amount": 0}  # the object() is dropped
    assert passes(results[2], {"total": 12, "ids": ["a", "b"]})
    assert results[3].value == [3, 2.0, None, True, "ok", float("inf")]
    assert results[4].value == "solution"
    assert "Entry" in results[5].detail
    assert results[6].exc_type == "KeyError" and results[6].exc_args == ["platinum"]
    assert results[1].to_dict() == {"status": "raised", "value": None, "exc_type": "LedgerError",
                                    "exc_args": ["E-417"], "exc_attrs": {"code": "E-417", "amount": 0},
                                    "detail": None}
    assert all(isinstance(r, CallResult) for r in results)


def test_no_opt_in_refuses_with_instructions(monkeypatch):
    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(CodeExecutionNotAllowed, match="PACE_ALLOW_CODE_EVAL=1.*HF_ALLOW_CODE_EVAL=1"):
        run_calls("x = 1", ["x"])
    monkeypatch.setenv("PACE_ALLOW_CODE_EVAL", "yes")
    with pytest.raises(CodeExecutionNotAllowed):
        require_opt_in()
    assert issubclass(CodeExecutionNotAllowed, RuntimeError)


def test_hf_code_eval_opt_in_is_accepted(monkeypatch):
    """code_eval users already set HF_ALLOW_CODE_EVAL=1: it opts in too, and only "1" does."""
    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "0")
    with pytest.raises(CodeExecutionNotAllowed):
        require_opt_in()
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    require_opt_in()


def test_program_that_does_not_load_makes_every_call_an_error():
    results = run("def f(:\n    return 1\n", ["f()", "1 + 1"])
    assert [r.status for r in results] == ["error", "error"]
    assert "SyntaxError" in results[0].detail
    results = run("raise ValueError('boom at import')", ["1"])
    assert results[0].status == "error" and "boom at import" in results[0].detail
    results = run("x = 1", ["x +", "x"])
    assert results[0].status == "error" and "does not compile" in results[0].detail
    assert passes(results[1], 1)


def test_common_stdlib_usage_is_not_mistaken_for_an_escape():
    results = run("""
        import asyncio, concurrent.futures, datetime, json, os, pathlib, shutil, sqlite3, tempfile
        import zoneinfo
        def files():
            with tempfile.TemporaryDirectory() as d:
                os.makedirs(os.path.join(d, "x"))
                with open(os.path.join(d, "x", "a.json"), "w") as f:
                    json.dump({"a": 1}, f)
                os.rename(os.path.join(d, "x", "a.json"), os.path.join(d, "b.json"))
                with open(os.path.join(d, "b.json")) as f:
                    first = json.load(f)
            p = pathlib.Path("data") / "f.txt"
            p.parent.mkdir()
            p.write_text("hi")
            second = p.read_text()
            shutil.rmtree("data")
            return [first, second]
        def threads():
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda x: x * x, range(5)))
        def db():
            con = sqlite3.connect(":memory:")
            return con.execute("select 6 * 7").fetchone()[0]
        async def later():
            await asyncio.sleep(0.01)
            return "async"
        def zone():
            return str(datetime.datetime(2024, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC")))
        """, ["files()", "threads()", "db()", "zone()", "asyncio.run(later())"])
    expected = [[{"a": 1}, "hi"], [0, 1, 4, 9, 16], 42, "2024-01-01 00:00:00+00:00"]
    assert [r.status for r in results[:4]] == ["ok"] * 4, results
    assert all(passes(r, e) for r, e in zip(results, expected))
    # An event loop needs a socket pair for its self-pipe, and a run can make no socket (each takes its
    # inode number from a host-wide counter, a channel to the next run): asyncio fails, and says why.
    assert results[4].status == "raised" and results[4].exc_type == "PermissionError", results


def test_a_refusal_swallowed_at_import_time_fails_every_call():
    results = run("""
        import socket
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=0.1)
        except Exception:
            pass
        def answer():
            return 42
        """, ["answer()", "answer()"])
    assert [r.status for r in results] == ["error", "error"]
    assert "blocked operation: socket." in results[0].detail


def test_limits_are_validated_and_os_layers_reported():
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=1.5)
    layers = isolation_layers()
    assert "rlimits" in layers
    assert {"netns", "mountns", "pidns", "ipcns", "utsns", "seccomp allowlist"} <= set(layers), layers
    assert any(layer.startswith("tmpfs") and "inodes" in layer for layer in layers)
    assert {"no /proc", "fifos"} <= set(layers) and any(layer.startswith("private image") for layer in layers)
    if os.geteuid() == 0:  # this container: the uid drop must work too
        assert any(layer.startswith("uid ") for layer in layers)


# --------------------------------------------------------------------------------------------
# Escape attempts: each contained, each not passing


def test_infinite_loop_times_out_and_the_process_group_is_killed(host):
    start = time.monotonic()
    results = run("import os\ndef spin():\n    while True: pass\n",
                  ["__import__('os').getuid()", "spin()", "1"], SandboxLimits(timeout_s=1.0))
    assert time.monotonic() - start < 4
    assert results[0].status == "ok"
    assert [r.status for r in results[1:]] == ["timeout", "timeout"]
    assert not passes(results[2], 1)
    assert _gone(results[0].value)


def test_cpu_limit_kills_a_busy_child():
    results = run("def spin():\n    while True: pass\n", ["spin()"],
                  SandboxLimits(timeout_s=8.0, cpu_s=1))
    assert results[0].status == "error" and "SIGXCPU" in results[0].detail


def test_fork_and_fork_bomb_are_refused(host):
    results = run("""
        import os
        def bomb():
            while True:
                os.fork()
        def quiet_fork():
            try:
                os.fork()
            except Exception:
                pass
            return 42
        """, ["__import__('os').getuid()", "bomb()", "quiet_fork()"])
    assert results[1].status == "error" and "os.fork" in results[1].detail
    assert not passes(results[2], 42)  # a swallowed refusal still fails the call
    assert _gone(results[0].value)


def test_subprocess_and_os_system_cannot_touch_the_host(host):
    target = host / "pwned"
    results = run(f"""
        import os, subprocess
        def via_subprocess():
            subprocess.run(["/bin/sh", "-c", "touch {target}"])
            return 42
        def via_system():
            return os.system("touch {target}")
        def via_exec():
            os.execv("/bin/sh", ["sh", "-c", "touch {target}"])
        def via_spawn():
            return os.posix_spawn("/bin/sh", ["sh", "-c", "touch {target}"], {{}})
        """, ["via_subprocess()", "via_system()", "via_exec()", "via_spawn()"])
    assert not any(passes(r, 42) or passes(r, 0) for r in results)
    assert all(r.status == "error" for r in results)
    assert not target.exists()


def test_unbounded_allocation_hits_the_memory_limit():
    results = run("""
        def grow():
            chunks = []
            while True:
                chunks.append(bytearray(10 ** 7))
        def huge():
            return len(bytearray(10 ** 10))
        """, ["grow()", "huge()", "1 + 1"], SandboxLimits(timeout_s=5.0, memory_mb=128))
    assert [r.status for r in results] == ["error", "error", "ok"]
    assert "memory" in results[0].detail.lower()


def test_writing_files_outside_the_working_directory_is_refused(host):
    outside = host / "evil.txt"
    results = run(f"""
        import os, pathlib
        def plain_open():
            with open({str(outside)!r}, "w") as f:
                f.write("pwned")
            return 42
        def low_level():
            fd = os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)
            return 42
        def relative():
            with open("../../../../../../../../" + {str(outside)!r}.lstrip("/"), "w") as f:
                f.write("pwned")
            return 42
        def via_pathlib():
            pathlib.Path({str(outside)!r}).write_text("pwned")
            return 42
        def inside():
            with open("scratch.txt", "w") as f:
                f.write("fine")
            with open("scratch.txt") as f:
                return f.read()
        """, ["plain_open()", "low_level()", "relative()", "via_pathlib()", "inside()"])
    assert [r.status for r in results] == ["error"] * 4 + ["ok"]
    assert all("blocked" in r.detail for r in results[:4])
    assert results[4].value == "fine"  # the program's own directory stays usable
    assert not outside.exists()


def test_deleting_or_renaming_host_files_is_refused(host):
    sentinel = host / "sentinel.txt"
    results = run(f"""
        import os, shutil
        def remove():
            os.remove({str(sentinel)!r}); return 42
        def rename():
            os.rename({str(sentinel)!r}, "stolen.txt"); return 42
        def rmtree():
            shutil.rmtree({str(host)!r}); return 42
        def chmod():
            os.chmod({str(sentinel)!r}, 0o777); return 42
        """, ["remove()", "rename()", "rmtree()", "chmod()"])
    assert not any(passes(r, 42) for r in results)
    assert oct(sentinel.stat().st_mode & 0o777) != oct(0o777)


def test_reading_hidden_files_outside_is_refused(host):
    hidden = host / "hidden_tests.py"
    hidden.write_text("EXPECTED = 42\n")
    try:
        results = run(f"""
            import sys
            def read():
                return int(open({str(hidden)!r}).read().split("=")[1])
            def via_import():
                sys.path.insert(0, {str(host)!r})
                import hidden_tests
                return hidden_tests.EXPECTED
            def passwd():
                return open("/etc/passwd").read()
            """, ["read()", "via_import()", "passwd()"])
    finally:
        hidden.unlink()
    assert not any(passes(r, 42) for r in results)
    assert results[2].status == "error"


def test_network_is_unreachable_even_on_loopback(host):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        results = run(f"""
            import socket
            def connect():
                s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
                s.sendall(b"hello")
                return 42
            def udp():
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port}))
                return 42
            def resolve():
                return socket.getaddrinfo("example.com", 80)
            """, ["connect()", "udp()", "resolve()"])
        with pytest.raises(socket.timeout):
            server.accept()  # the server saw no connection
    finally:
        server.close()
    assert all(r.status == "error" for r in results)


def test_lookalike_values_with_forged_equality_are_errors():
    results = run("""
        import builtins, collections
        class AlwaysEqualInt(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        class AlwaysEqualStr(str):
            def __eq__(self, other): return True
            __hash__ = str.__hash__
        class Anything:
            def __eq__(self, other): return True
        class Dict(dict):
            pass
        Point = collections.namedtuple("Point", "x y")
        def fool_the_checker():
            builtins.type = lambda x: int  # the converter captured `type` before the program ran
            return AlwaysEqualInt(0)
        """, ["AlwaysEqualInt(1)", "AlwaysEqualStr('x')", "Anything()", "[1, Anything()]",
              "Dict(a=1)", "{1: 'int key'}", "Point(1, 2)", "{'__decimal__': '42'}",
              "fool_the_checker()"])
    assert all(r.status == "error" for r in results), results
    assert "AlwaysEqualInt" in results[0].detail and "Anything" in results[2].detail
    assert not any(passes(r, expected) for r, expected in
                   zip(results, [1, "x", 42, [1, 42], {"a": 1}, {}, [1, 2], {"__decimal__": "42"}, 0]))


def test_fake_report_lines_on_stdout_are_ignored_and_none_reach_the_pipe():
    """Lines on stdout/stderr mean nothing; a line the program writes to every descriptor it has reaches
    no report pipe (issue 66: the harness's descriptors are its own; what the parent makes of an unasked
    answer: test_unasked_duplicate_and_early_lines_fail_the_calls)."""
    results = run("""
        import os, sys
        FAKE = '{"c": "0", "status": "ok", "value": 42}'
        def on_stdout():
            print(FAKE)
            print(FAKE, file=sys.stderr)
            return "real"
        def forge():
            for fd in range(3, 64):  # RLIMIT_NOFILE is 64: this hits the report pipe
                try:
                    os.write(fd, (FAKE + "\\n").encode())
                except OSError:
                    pass
            return "real"
        """, ["on_stdout()", "forge()", "'after'"])
    assert passes(results[0], "real") and not passes(results[0], 42)
    assert passes(results[1], "real") and passes(results[2], "after"), results


def test_stdout_flood_does_not_block_or_confuse_the_parent():
    start = time.monotonic()
    results = run("""
        import sys
        def flood():
            line = '{"i": 0, "status": "ok", "value": 42}\\n' * 20000
            for _ in range(25):  # about 20 MB on each stream
                sys.stdout.write(line)
                sys.stderr.write(line)
            return "flooded"
        def flood_forever():
            while True:
                sys.stdout.write("x" * 65536)
        """, ["flood()", "flood_forever()"], SandboxLimits(timeout_s=1.5))
    assert time.monotonic() - start < 6
    assert passes(results[0], "flooded") and not passes(results[0], 42)
    assert results[1].status == "timeout"


def test_exit_calls_are_contained():
    results = run("import os\nos._exit(0)\n", ["1", "2"])
    assert [r.status for r in results] == ["error", "error"]
    assert results[0].detail.startswith("child exited")
    results = run("import sys\nsys.exit(0)\n", ["1"])
    assert results[0].status == "error" and "SystemExit" in results[0].detail
    results = run("import os, sys\ndef leave(): sys.exit(3)\n",
                  ["1", "leave()", "__import__('os')._exit(7)", "4"])
    assert passes(results[0], 1)
    assert results[1].status == "error" and "SystemExit" in results[1].detail
    assert [r.status for r in results[2:]] == ["error", "error"]
    assert results[3].detail.startswith("child exited")


def test_killing_the_parent_is_refused(host):
    results = run("""
        import os, signal
        def kill():
            os.kill(os.getppid(), signal.SIGKILL); return 42
        def killpg():
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL); return 42
        def pidfd():
            signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL); return 42
        """, ["kill()", "killpg()", "pidfd()"])
    assert not any(passes(r, 42) for r in results)
    assert results[0].status == "error" and "os.kill" in results[0].detail
    # ...and this test process is still alive to check it.


def test_ctypes_and_other_c_escape_hatches_are_refused(host):
    target = host / "pwned"
    results = run(f"""
        import sys
        def via_ctypes():
            import ctypes
            ctypes.CDLL(None).system(b"touch {target}")
            return 42
        def via_subinterpreter():
            import _xxsubinterpreters as interpreters
            interpreters.run_string(interpreters.create(), "import os; os.system('touch {target}')")
            return 42
        def via_reimport():
            del sys.modules["_posixsubprocess"]
            import _posixsubprocess  # a fresh copy would have an unstubbed fork_exec
            return 42
        def via_trace():
            sys.settrace(lambda *a: None); return 42
        def via_gc():
            import gc
            return len(gc.get_objects()) and 42
        """, ["via_ctypes()", "via_subinterpreter()", "via_reimport()", "via_trace()", "via_gc()"])
    assert all(r.status == "error" for r in results), results
    assert not target.exists()


def test_base_exceptions_are_not_reported_as_raised():
    results = run("""
        class Escape(BaseException):
            pass
        def escape(): raise Escape("E-417")
        def interrupt(): raise KeyboardInterrupt
        def gen_exit(): raise GeneratorExit
        """, ["escape()", "interrupt()", "gen_exit()", "'still here'"])
    assert [r.status for r in results] == ["error", "error", "error", "ok"]
    assert "Escape" in results[0].detail and results[0].exc_type is None


def test_deep_recursion_is_an_error_not_a_crash_of_the_host():
    results = run("""
        import sys
        def down(n): return down(n + 1)
        def deeper():
            sys.setrecursionlimit(10 ** 8)
            return down(0)
        """, ["down(0)", "1", "deeper()"], SandboxLimits(timeout_s=5.0, memory_mb=64))
    assert results[0].status == "error" and "recursion" in results[0].detail
    assert passes(results[1], 1)
    # CPython 3.11 runs out of memory for frames here and raises SystemError (or MemoryError)
    assert results[2].status in ("error", "raised") and results[2].exc_type != "RecursionError"


def test_limits_cannot_be_raised_from_inside():
    results = run("""
        import resource
        def lift():
            try:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except Exception:
                pass
            return len(bytearray(300 * 1024 * 1024))
        def current():
            return list(resource.getrlimit(resource.RLIMIT_AS))
        """, ["lift()", "current()"], SandboxLimits(timeout_s=5.0, memory_mb=128))
    assert results[0].status == "error"
    assert results[1].value == [128 * 1024 * 1024] * 2


def test_threads_left_running_do_not_outlive_the_run(host):
    results = run("""
        import os, threading, time
        def busy():
            while True:
                time.sleep(0.01)
        def start():
            for _ in range(3):
                threading.Thread(target=busy, daemon=False).start()
            return os.getuid()
        """, ["start()", "sum(range(10))"])
    assert results[0].status == "ok" and passes(results[1], 45)
    time.sleep(0.1)
    assert _gone(results[0].value)


def test_oversized_and_odd_values():
    results = run("""
        def big(): return "x" * 2_000_000
        def deep():
            x = []
            for _ in range(500): x = [x]
            return x
        def cyclic():
            x = []; x.append(x); return x
        class Weird(Exception):
            def __str__(self): raise RuntimeError("no")
        def weird(): raise Weird(object(), 1)
        """, ["big()", "deep()", "cyclic()", "weird()", "10 ** 5000", "'é\\ud800'"])
    assert [r.status for r in results[:3]] == ["error"] * 3
    assert results[3].status == "raised" and results[3].exc_args == [None, 1]
    assert results[4].status == "error"
    assert results[5].value == "é\ud800"


# --------------------------------------------------------------------------------------------
# Issue 13: the attack classes found by the second audit. Each attack runs against an "exposed"
# host: a world-writable directory under /tmp (the child's fresh uid could write there if no
# OS-level wall stood in the way), holding a world-readable secret file and SQLite database,
# plus a secret in the parent's environment. Afterwards nothing may have changed there, no file
# named after the run's token may exist under /tmp or the working directory, and the secret may
# appear in no result.


@pytest.fixture
def exposed(monkeypatch):
    import shutil
    import sqlite3
    import tempfile

    token = "pace13-" + os.urandom(6).hex()
    secret = "SECRET-" + os.urandom(8).hex()
    from pathlib import Path

    root = tempfile.mkdtemp(prefix=token + "-", dir="/tmp")
    os.chmod(root, 0o777)
    Path(root, "secret.txt").write_text(secret)
    con = sqlite3.connect(os.path.join(root, "secret.db"))
    con.execute("create table s(v)")
    con.execute("insert into s values (?)", (secret,))
    con.commit()
    con.close()
    for name in ("secret.txt", "secret.db"):
        os.chmod(os.path.join(root, name), 0o666)
    monkeypatch.setenv("PACE_TEST_SECRET", secret)
    before = {name: Path(root, name).read_bytes() for name in os.listdir(root)}
    running = children()
    host = type("Host", (), {"dir": root, "token": token, "secret": secret})()
    try:
        yield host
        assert {name: Path(root, name).read_bytes() for name in os.listdir(root)} == before
        assert [p for p in os.listdir("/tmp") if token in p] == [os.path.basename(root)]
        assert not [p for p in os.listdir(os.getcwd()) if token in p]
        assert children() <= running
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _leaks(results, secret):
    return [r for r in results if secret in repr(r.to_dict())]


def test_an_os_wall_keeps_reads_and_writes_in_the_scratch_directory():
    """Defect 1: Landlock must be active here (it walls reads and writes; the read-only root walls
    writes only); run_calls refuses to run code where it cannot be set up."""
    layers = isolation_layers()
    assert any(layer.startswith("landlock") for layer in layers), layers
    assert "violation counter" in layers
    if os.geteuid() == 0:
        assert "read-only root" in layers
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1:  # Landlock's ABI version
        assert any(layer.startswith("landlock") for layer in layers)


def test_libraries_that_open_files_themselves_meet_the_wall(exposed):
    """Defect 1: SQLite opens paths the audit hook never sees (ATTACH, VACUUM INTO, file: URIs);
    C extensions and other path forms meet the same wall. Reads of the host's secrets too."""
    d = exposed.dir
    results = run(f"""
        import os, sqlite3, zipfile
        D = {d!r}
        def attach():
            con = sqlite3.connect(":memory:")
            con.execute("ATTACH DATABASE '" + D + "/attached.db' AS x")
            con.execute("create table x.t(a)")
            con.commit()
            return 42
        def attach_many():
            con, made = sqlite3.connect(":memory:"), 0
            for k in range(5):
                try:
                    con.execute("ATTACH DATABASE '" + D + "/many%d.db' AS x%d" % (k, k))
                    con.execute("create table x%d.t(a)" % k)
                    made += 1
                except sqlite3.Error:
                    pass
            con.commit()
            return 42 if made else 0
        def vacuum_into():
            con = sqlite3.connect("local.db")
            con.execute("create table t(a)")
            con.commit()
            con.execute("VACUUM INTO '" + D + "/vacuumed.db'")
            return 42
        def uri():
            con = sqlite3.connect("file:" + D + "/uri.db?mode=rwc", uri=True)
            con.execute("create table t(a)")
            con.commit()
            return 42
        def read_secret_db():
            con = sqlite3.connect(":memory:")
            con.execute("ATTACH DATABASE 'file:" + D + "/secret.db?mode=ro' AS s")
            return con.execute("select v from s.s").fetchone()[0]
        def via_dbm():
            import dbm.dumb
            with dbm.dumb.open(D + "/store", "c") as db:
                db[b"k"] = b"v"
            return 42
        def via_zipfile():
            with zipfile.ZipFile(D + "/archive.zip", "w") as z:
                z.writestr("a.txt", "pwned")
            return 42
        def via_proc_cwd():
            fd = os.open("/proc/self/cwd/" + "../" * 12 + D.lstrip("/") + "/proc_cwd", os.O_WRONLY | os.O_CREAT)
            return 42
        def via_proc_fd():
            here = os.open(".", os.O_RDONLY)
            with open("/proc/self/fd/%d/" % here + "../" * 12 + D.lstrip("/") + "/proc_fd", "w") as f:
                f.write("pwned")
            return 42
        def read_secret_file():
            return open(D + "/secret.txt").read()
        def inside():
            con = sqlite3.connect("file:inside.db?mode=rwc&vfs=unix-none", uri=True)  # no locks (seccomp)
            con.execute("create table t(a)")
            con.execute("insert into t values (42)")
            con.commit()
            return con.execute("select a from t").fetchone()[0]
        """, ["attach()", "attach_many()", "vacuum_into()", "uri()", "read_secret_db()", "via_dbm()",
              "via_zipfile()", "via_proc_cwd()", "via_proc_fd()", "read_secret_file()", "inside()"])
    assert not any(passes(r, 42) for r in results[:-1]), results
    assert passes(results[-1], 42)  # SQLite inside the scratch directory still works, without locks
    assert not _leaks(results, exposed.secret)


def test_a_result_nested_700_deep_is_a_failed_call_not_a_crash():
    """Defect 2: the parent validates a result's shape and size itself (a forged report line, or
    a child that does not check) and turns anything else into an error; a line nested deeper than any
    reply of the harness is not parsed at all (issue 66): it breaks the protocol."""
    import json

    from pace_bench.metrics.pace_coding import sandbox as S

    rfd, wfd = os.pipe()
    sent = []
    try:
        run_ = S._Run(["a()", "b()", "c()", "d()"], os.getpid(), wfd)

        def answer(raw=None, **msg):
            """Answer the request just sent, with its nonce."""
            nonce, payload = os.read(rfd, 1 << 16).decode().rstrip("\n").split(" ")
            sent.append(bytes.fromhex(payload).decode())
            run_.feed(raw.replace(b"NONCE", nonce.encode()) if raw else json.dumps(dict(msg, c=nonce)).encode())

        run_.feed(json.dumps({"setup": ["landlock v7"]}).encode())
        answer(ready=True, violations=[])
        answer(status="ok", value=[[[]]] * 3 + [{"__decimal__": "not a number"}], violations=[])
        answer(status="raised", exc_type="E", exc_args=[{"__decimal__": "sNaN"}], exc_attrs={"k": {"__decimal__": "sNaN"}},
               violations=[])
        answer(status="ok", value={"__decimal__": "1.25"}, violations=[])
        answer(b'{"c": "NONCE", "status": "ok", "value": ' + b"[" * 700 + b"]" * 700 + b', "violations": []}')
        results = run_.results(None, 1.0, "")
    finally:
        os.close(rfd)
        run_.close_calls()
    assert [r.status for r in results] == ["error", "raised", "ok", "error"]
    assert "decimal" in results[0].detail and "deeper than" in results[3].detail  # not parsed: no reply
    assert results[1].exc_args is None and results[1].exc_attrs == {}
    assert S.decode_value(results[2].value) == __import__("decimal").Decimal("1.25")
    assert sent == ["", "a()", "b()", "c()", "d()"]  # the load, then one call at a time
    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert "deeper" in S.plain_data_error(deep)  # iterative: no RecursionError at any depth


_SPY = """
import gc, inspect, sys

def _dump(found, obj):
    try:
        found.append(repr(obj)[:20000])
    except Exception:
        pass

def spy(loud):
    found = []
    frame = sys._getframe()
    while frame is not None:          # f_back is not audited: every frame below ours
        _dump(found, frame.f_locals)
        _dump(found, frame.f_globals)
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            if type(value) is list:   # rewrite any list of strings we can reach
                for k, item in enumerate(value):
                    if type(item) is str and "SECRET" in item:
                        value[k] = "'FORGED'"
            for cell in getattr(value, "__closure__", None) or ():
                try:
                    _dump(found, cell.cell_contents)
                except Exception:
                    pass
        frame = frame.f_back
    attempts = [lambda: [f.frame.f_locals for f in inspect.stack()],
                lambda: sys._getframe(1).f_back.f_locals]
    if loud:                           # each of these is refused, which fails the call
        attempts += [lambda: gc.get_referrers(sys.modules[__name__].__dict__),
                     lambda: [getattr(o, "f_locals", None) for o in gc.get_objects()]]
    for attempt in attempts:
        try:
            _dump(found, attempt())
        except Exception as e:
            _dump(found, e)
    def gen():
        yield sys._getframe().f_back
    g = gen()
    _dump(found, next(g).f_locals)
    if loud:                           # a suspended generator's frame is refused outright
        try:
            _dump(found, g.gi_frame.f_back)
        except Exception as e:
            _dump(found, e)
        try:
            open("/etc/hostname", "w")
        except Exception as e:         # the refusal's traceback passes through the audit hook
            tb = e.__traceback__
            while tb is not None:
                try:
                    _dump(found, tb.tb_frame.f_locals)
                except Exception:
                    pass
                tb = tb.tb_next
    return "\\n".join(found)
"""


def test_later_calls_are_not_in_the_child_and_cannot_be_rewritten(exposed):
    """Defect 3: a program that walks every frame, closure, generator and traceback it can reach
    learns nothing of a call before it is asked, and cannot change one."""
    results = run(_SPY, ["spy(False)", "'SECRET-ONE'", "spy(True)", "'SECRET-TWO'"])
    assert results[0].status == "ok" and "'box'" in results[0].value  # it reached the bottom frame
    assert "SECRET-ONE" not in results[0].value and "SECRET-TWO" not in results[0].value
    assert results[2].status == "error" and "blocked operation" in results[2].detail
    assert passes(results[1], "SECRET-ONE") and passes(results[3], "SECRET-TWO")
    assert not _leaks(results, exposed.secret)


def test_harness_frames_are_refused_to_the_program():
    """Defect 2/3, second layer: sys._getframe, tracebacks and generators do not hand out the
    harness's frames (whose closures hold the audit hook and the reporting channel)."""
    results = run("""
        import sys
        def depth():
            n, frame = 0, sys._getframe()
            while frame is not None:
                n, frame = n + 1, frame.f_back
            return n
        def hook_frames():
            try:
                open("/etc/hostname", "w")
            except PermissionError as e:
                tb, names = e.__traceback__, []
                while tb is not None:
                    names.append(tb.tb_frame.f_code.co_name)
                    tb = tb.tb_next
                return names
        def beyond():
            return sys._getframe(3)
        """, ["depth()", "hook_frames()", "beyond()", "1"])
    assert passes(results[0], 3)  # depth(), the call, the worker loop: nothing of the harness
    assert results[1].status == "error" and "blocked operation" in results[1].detail
    assert results[2].status == "raised" and results[2].exc_type == "ValueError"
    assert passes(results[3], 1)


def test_a_refusal_is_scored_by_the_parent_whatever_the_program_edits(exposed):
    """Defect 4: the program cannot escape "a blocked operation fails the call" by editing the
    harness's state, by hijacking the report pipe, or by acting from a thread later."""
    results = run(f"""
        import fcntl, os, stat, sys, threading, time
        def _silenced(action):
            pipes = [fd for fd in range(3, 64) if _is_write_pipe(fd)]
            saved = {{fd: os.dup(fd) for fd in pipes}}
            null = os.open("/dev/null", os.O_WRONLY)
            for fd in pipes:
                os.dup2(null, fd)
            try:
                action()
            except Exception:
                pass
            finally:
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
        def _is_write_pipe(fd):
            try:
                return stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR)
            except OSError:
                return False
        def edit_state():
            frame = sys._getframe()
            while frame is not None:
                for value in frame.f_locals.values():
                    if type(value) is list and value and type(value[0]) is int:
                        value[0] = 10 ** 6   # the old harness's call index
                frame = frame.f_back
            try:
                os.fork()
            except Exception:
                pass
            return 42
        def hijack_pipe():
            _silenced(lambda: open({exposed.dir!r} + "/x", "w"))
            return 42
        def later():
            def act():
                time.sleep(0.3)
                try:
                    os.kill(os.getppid(), 0)
                except Exception:
                    pass
            threading.Thread(target=act).start()
            return 42
        def slow():
            time.sleep(1.0)
            return 42
        def lower_counter():
            import resource
            try:
                resource.setrlimit(10, (10 ** 9, 10 ** 9))  # raise the counter back: refused
            except Exception:
                pass
            return 42
        """, ["edit_state()", "hijack_pipe()", "later()", "slow()", "lower_counter()", "42"])
    assert [r.status for r in results[:2]] == ["error", "error"], results
    assert passes(results[2], 42)
    assert results[3].status == "error" and "blocked operation" in results[3].detail
    assert results[4].status == "error"
    assert passes(results[5], 42)


def test_inputs_are_refused_not_reinterpreted():
    """Defect 6: a str is not a list of calls; timeouts must be real positive numbers."""
    with pytest.raises(TypeError, match="list of str"):
        run_calls("def fee_for(x): return x", "fee_for(1)")
    with pytest.raises(TypeError, match="list of str"):
        run_calls("x = 1", {"x": 1})
    with pytest.raises(TypeError, match="program must be a str"):
        run_calls(b"x = 1", ["x"])
    for bad in (0, -1, True, float("nan"), float("inf"), "10"):
        with pytest.raises(ValueError):
            SandboxLimits(timeout_s=bad)
    assert passes(run_calls("x = 1", ("x",), QUICK)[0], 1)  # a tuple of calls is fine


def test_no_write_wall_means_no_code_runs(monkeypatch):
    """Defect 1: without Landlock (a read-only root alone is not enough) the child runs nothing and run_calls says
    why instead of running the code half-confined (isolation_layers still reports)."""
    from pace_bench.metrics.pace_coding import sandbox as S

    for layers in (b'["netns", "rlimits", "seccomp allowlist"]', b'["netns", "read-only root", "rlimits"]'):
        run_ = S._Run(["1"], os.getpid(), -1)  # a read-only root walls writes, not reads of the host
        run_.feed(b'{"setup": ' + layers + b'}')
        assert run_.finished() and "Landlock" in run_.refusal and run_.done == []
    monkeypatch.setattr(S, "_run", lambda program, calls, limits, answers=None: ([], ["rlimits"], "no OS-level wall", (None, {})))
    with pytest.raises(S.SandboxUnavailable, match="no OS-level wall"):
        run_calls("x = 1", ["x"])
    assert S.isolation_layers() == ["rlimits"]


def test_diagnostics_do_not_name_the_runs_scratch_folder():
    # an import error and an exception carrying a stdlib path: the random scratch path is <sandbox>
    failed = run("from email.utils import no_such_name\ndef f():\n    return 1\n", ["f()"])[0]
    raised = run("import email.utils\ndef f():\n    raise ValueError(email.utils.__file__)\n", ["f()"])[0]
    assert failed.status == "error" and "no_such_name" in failed.detail
    assert raised.status == "raised" and raised.exc_type == "ValueError"
    for text in (failed.detail, raised.exc_args[0]):
        assert "email/utils.py" in text and "pace-sandbox-" not in text


# --------------------------------------------------------------------------------------------
# Issue 66: the parent's side of a run, where the report channel is reached (code on the harness's thread)


def _fake_child(call_fd, report_fd, reply):
    """Answer each request on ``call_fd`` with ``reply(k, nonce)`` (the load is request 0) on ``report_fd``,
    as the child's harness would; a thread of this process."""
    import threading

    def serve():
        buf, k = b"", 0
        while True:
            try:
                chunk = os.read(call_fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    data = reply(k, line.split(b" ")[0].decode()) + b"\n"
                    while data:
                        data = data[os.write(report_fd, data):]
                except OSError:
                    return
                k += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _parent_run(calls, reply, deadline_s=5.0):
    """``_read_reports`` against a fake child that answers with ``reply``; returns the run's results."""
    import json

    from pace_bench.metrics.pace_coding import sandbox as S

    call_r, call_w = os.pipe()
    report_r, report_w = os.pipe()
    err_r, err_w = os.pipe()
    os.set_blocking(call_w, False)
    run_ = S._Run(list(calls), os.getpid(), call_w)
    try:
        _fake_child(call_r, report_w, reply)
        run_.feed(json.dumps({"setup": ["landlock v7"]}).encode())
        with os.fdopen(err_r, "rb") as err:
            S._read_reports(report_r, S._Tail(err), run_, time.monotonic() + deadline_s)
        return run_.results(None, deadline_s, "")
    finally:
        run_.close_calls()
        for fd in (call_r, report_r, report_w, err_w):
            os.close(fd)


def test_a_reply_beyond_the_harnesss_caps_breaks_the_protocol():
    """Issue 66: the parent took any plain-data exception args up to the 4 MiB line (108,000 error codes
    passed ``settle_error_code``), where the child's harness sends at most 64 of at most 65,536 characters.
    A reply beyond the harness's own caps (args, attributes, type name, value, detail, refusals named, keys)
    was written by other code: it breaks the protocol. At the caps, the reply is taken."""
    import json

    def reply(extra):
        return lambda k, nonce: json.dumps(dict(extra, c=nonce, violations=[]) if k else
                                           {"c": nonce, "violations": [], "ready": True}).encode()

    raised = {"status": "raised", "exc_type": "E", "exc_args": ["x"] * 64, "exc_attrs": {f"a{k}": 1 for k in range(64)}}
    at_caps = _parent_run(["f()"], reply(raised))[0]
    assert at_caps.status == "raised" and len(at_caps.exc_args) == 64, at_caps
    over = [dict(raised, exc_args=["x"] * 65), dict(raised, exc_args=["x" * 70_000]),
            dict(raised, exc_attrs={f"a{k}": 1 for k in range(65)}), dict(raised, exc_attrs={"__code": "E-1"}),
            dict(raised, exc_type="E" * 201), {"status": "ok", "value": "x" * 1_000_001},
            {"status": "error", "detail": "x" * 1001}, dict(raised, more=1),
            {"status": "ok", "value": 1, "violations": ["x"] * 65}, {"status": "ok", "value": 1, "violations": ["x" * 101]}]
    for extra in over:
        result = _parent_run(["f()"], lambda k, nonce, extra=extra: json.dumps(
            dict({"violations": []}, **extra, c=nonce) if k else {"c": nonce, "violations": [], "ready": True}).encode())[0]
        assert result.status == "error" and "broke the protocol" in result.detail, (list(extra), result)


def test_unasked_duplicate_and_early_lines_fail_the_calls():
    """What the sandbox tests can no longer send from the answer's threads (they hold no descriptor of the
    channel): a second answer to the load, a duplicate of call 0's answer and an answer with a nonce never
    sent each fail the call outstanding and every later one (a repeated nonce, the call it repeats too)."""
    import json

    sent = {}

    def reply(k, nonce):
        sent[k] = nonce
        if k == 0:
            return json.dumps({"c": nonce, "violations": [], "ready": True}).encode()
        answer = json.dumps({"c": nonce, "violations": [], "status": "ok", "value": k})
        if k == 2:  # a second answer to call 0 before call 1's
            answer = json.dumps({"c": sent[1], "violations": [], "status": "ok", "value": 42}) + "\n" + answer
        if k == 3:
            answer = json.dumps({"c": "0" * 32, "violations": [], "status": "ok", "value": 42})
        return answer.encode()

    results = _parent_run(["0", "1", "2"], reply)
    assert [r.status for r in results] == ["error"] * 3 and all("broke the protocol" in r.detail for r in results)
    early = _parent_run(["0", "1", "2"], lambda k, nonce: reply(k, nonce) if k != 2 else reply(3, nonce))
    assert [r.status for r in early] == ["ok", "error", "error"], early


def test_an_error_reading_the_reports_fails_that_answer_alone(monkeypatch):
    """Issue 66, attack 3: the parent's ``os.read`` of the non-blocking report FIFO raised BlockingIOError
    out of ``compute`` when the child read the bytes back between ``select`` and ``read``. An empty read is
    now nothing to read; any other error reading the reports stops that run, its calls failed with the
    reason, and raises nothing."""
    import errno
    import json

    from pace_bench.metrics.pace_coding import sandbox as S

    failures = []

    class FlakyOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def read(fd, n):
            if failures:
                raise failures.pop()
            return os.read(fd, n)

    def reply(k, nonce):
        if k == 1:
            failures.append(error)
        body = {"ready": True} if k == 0 else {"status": "ok", "value": k}
        return json.dumps(dict(body, c=nonce, violations=[])).encode()

    monkeypatch.setattr(S, "os", FlakyOs())
    error = BlockingIOError(errno.EAGAIN, "stolen")
    assert [r.value for r in _parent_run(["1", "2"], reply)] == [1, 2]
    error = OSError(errno.EIO, "I/O error")
    results = _parent_run(["1", "2"], reply)
    assert [r.status for r in results] == ["error", "error"], results
    assert all("could not read the run's reports" in r.detail for r in results)


_FLOOD_WRITER = """
import os, sys
fd, line = int(sys.argv[1]), ("[" + ",".join(["[" * 49 + "]" * 49] * 42_000) + "]\\n").encode()
os.write(fd, b"not an answer\\n")
while True:
    os.write(fd, line)
"""


def test_the_parent_reads_nothing_once_the_run_has_ended(monkeypatch):
    """Issue 66: the parent read and parsed every line of a flood (4 MB JSON lines of lists nested 50 deep)
    until the deadline, even after the flood had broken the protocol: its CPU grew with the timeout. Here
    the channel is reached, as by code on the harness's thread: a process writes the flood to the report
    pipe; with a 20 s deadline the parent stops at the first line, which ends the run, and parses nothing
    larger than the caps (``json.loads`` never sees a flood line)."""
    import json
    import subprocess
    import sys

    from pace_bench.metrics.pace_coding import sandbox as S

    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(S.json, "loads", lambda text, *a, **k: (parsed.append(len(text)), real_loads(text, *a, **k))[1])
    report_r, report_w = os.pipe()
    err_r, err_w = os.pipe()
    writer = subprocess.Popen([sys.executable, "-c", _FLOOD_WRITER, str(report_w)], pass_fds=(report_w,))
    os.close(report_w)
    call_r, call_w = os.pipe()
    run_ = S._Run(["1"], os.getpid(), call_w)
    try:
        run_.feed(b'{"setup": ["landlock v7"]}')  # the load request is sent: the flood answers no request
        cpu, wall = time.process_time(), time.monotonic()
        with os.fdopen(err_r, "rb") as err:
            S._read_reports(report_r, S._Tail(err), run_, time.monotonic() + 20.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        writer.kill()
        writer.wait()
        run_.close_calls()
        for fd in (call_r, report_r, err_w):
            os.close(fd)
    assert run_.finished() and run_.broken_from == 0
    assert cpu < 0.5 and wall < 5.0 and max(parsed) < 100, (cpu, wall, parsed[:5])
    # and a flood line is refused unparsed wherever it comes: too many values
    line = ("[" + ",".join(["[" * 49 + "]" * 49] * 42_000) + "]").encode()
    assert "values" in S._shape_error(line) and "deeper" in S._shape_error(b"[" * 200 + b"]" * 200)
    assert S._shape_error(b'{"c": "x", "value": ["[[[[\\\\", "\\\\\\"{{"]}') is None  # brackets in strings


def test_what_the_parent_reads_of_one_run_is_capped():
    """Issue 66: however long the timeout, the parent reads at most 16 MiB of one run's reports: a child
    that answers every call with a value near the 1 MB cap stops being read there, and the calls it has
    not answered yet fail with the reason."""
    import json

    results = _parent_run([f"f({k})" for k in range(24)], lambda k, nonce: json.dumps(
        {"c": nonce, "violations": [], "ready": True} if k == 0 else
        {"c": nonce, "violations": [], "status": "ok", "value": "x" * 999_000}).encode(), deadline_s=20.0)
    ok = [r for r in results if r.status == "ok"]
    assert 12 <= len(ok) <= 16 and results[len(ok)].status == "error", [r.status for r in results]
    assert all("more than 16 MiB" in r.detail for r in results[len(ok):])


def test_only_the_host_check_raises_sandbox_unavailable(monkeypatch):
    """Issue 66: an answer's failed setup made ``compute`` raise SandboxUnavailable for the whole batch and
    say, wrongly, that the host could not build a sandbox. The host is now checked once per process, by a
    run that holds no answer; a later answer whose run fails to set up fails alone, with the reason."""
    from pace_bench.metrics.pace_coding import sandbox as S

    runs = []

    def fake_run(program, calls, limits, answers=None):
        runs.append(answers)
        refusal = host_refusal if answers is None else "sandbox setup failed: this answer's run"
        return [], [], refusal, (None, {}, None)

    monkeypatch.setattr(S, "_run", fake_run)
    monkeypatch.setattr(S, "_HOST_READY", [])
    host_refusal = "no OS-level wall"
    with pytest.raises(S.SandboxUnavailable, match="no OS-level wall"):
        S.run_answer(["x = 1"], ["x"])
    host_refusal = None
    first, second = S.run_answer(["x = 1"], ["x", "x"]), S.run_answer(["x = 1"], ["x"])
    assert runs == [None, None, ["x = 1"], ["x = 1"]]  # the host is checked until it builds, then not again
    assert first.failed == "sandbox setup failed: this answer's run" and first.chosen is None
    assert [r.status for r in first.results + second.results] == ["error"] * 3
    assert "this answer's run" in first.results[0].detail
