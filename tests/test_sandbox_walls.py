"""The kernel walls of the sandbox hold when the interpreter does not: a stand-in for a program that
has taken over the child's interpreter (native code, ctypes in hand, no audit hook) runs inside the
real confinement of ``_sandbox_child`` and tries what issue 22 found getting through."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict

import pytest

from pace_bench.metrics.pace_coding import sandbox as S

from host_objects import mqueue_exists, sysv_objects

_NATIVE = r'''
import ctypes, errno, fcntl, json, os, socket, struct, sys
sys.path.insert(0, sys.argv[1])
import _sandbox_child as C
job, out_fd, mode = json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def err(result):
    return ctypes.get_errno() if result < 0 else 0

def os_err(action):
    try:
        action()
        return 0
    except OSError as e:
        return e.errno

facts = {}
if mode == "namespaces":  # only the namespaces, no seccomp: objects made here must die with the run
    C._enter_namespaces(C._load_libc(), job["parent_pid"], (out_fd,))
    facts = {"shm": libc.shmget(0, 1 << 20, 0o1600), "msg": libc.msgget(0, 0o1600),
             "sem": libc.semget(0, 1, 0o1600),
             "mq": libc.mq_open(job["queue"].encode(), os.O_CREAT | os.O_RDWR, 0o600, None),
             "pid": os.getpid()}
else:
    layers, _roots, _unshare = C._confine(job, (out_fd,))
    buf = ctypes.create_string_buffer(512)
    work = job["work"]
    facts["layers"] = layers
    facts["pid"], facts["proc"], facts["hostname"] = os.getpid(), os.path.exists("/proc"), os.uname().nodename
    facts["denied"] = {
        "shmget": err(libc.shmget(0, 32 << 20, 0o1600)), "msgget": err(libc.msgget(0, 0o1600)),
        "semget": err(libc.semget(0, 1, 0o1600)),
        "mq_open": err(libc.mq_open(job["queue"].encode(), os.O_CREAT | os.O_RDWR, 0o600, None)),
        "memfd_create": err(libc.syscall(319, b"x", 0)), "userfaultfd": err(libc.syscall(323, 0)),
        "io_uring_setup": err(libc.syscall(425, 1, buf)), "sysinfo": err(libc.syscall(99, buf)),
        "ptrace": err(libc.syscall(101, 16, 1, 0, 0)), "prctl": err(libc.prctl(4, 0, 0, 0, 0)),
        "unshare": err(libc.unshare(0x10000000)), "setns": err(libc.syscall(308, 0, 0)),
        "kill init": os_err(lambda: os.kill(1, 0)), "fork": os_err(lambda: os.fork() or os._exit(0)),
        "inet socket": os_err(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
        "link": os_err(lambda: (open(work + "/f", "w").close(), os.link(work + "/f", work + "/g"))),
        "symlink": os_err(lambda: os.symlink("/", work + "/s")),
        "mknod": os_err(lambda: os.mknod(work + "/fifo", 0o10600)),
        "write outside": os_err(lambda: open(job["outside"] + "/escaped", "w")),
        # a lock on a file every run reads (the standard library), or the question whose lock it holds:
        # a channel between concurrent runs
        "flock shared": os_err(lambda: fcntl.flock(os.open(os.__file__, os.O_RDONLY), fcntl.LOCK_SH | fcntl.LOCK_NB)),
        "F_GETLK shared": os_err(lambda: fcntl.fcntl(os.open(os.__file__, os.O_RDONLY), fcntl.F_GETLK,
                                                     struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))),
    }
    facts["locks"] = {  # no record lock even on the run's own files: each split is uncharged slab (issue 54)
        "lockf own": os_err(lambda: fcntl.lockf(os.open(work + "/own.lock", os.O_RDWR | os.O_CREAT),
                                                fcntl.LOCK_EX | fcntl.LOCK_NB)),
    }
    host = [job["outside"], "/etc/passwd", "/home", os.path.dirname(os.path.abspath(sys.argv[1])), sys.argv[0]]
    facts["stat host"] = {path: os_err(lambda path=path: os.stat(path)) for path in host}
    facts["stdlib"] = []  # still importable: pure Python, and a C extension with a system library (libsqlite3)
    for name in ("csv", "sqlite3"):
        try:
            __import__(name).__name__
            facts["stdlib"].append(name)
        except ImportError as e:
            facts["stdlib"].append(str(e))
    made, code = 0, 0
    while made < 100_000:
        try:
            os.mkdir("%s/d%d" % (work, made))
            made += 1
        except OSError as e:
            code = e.errno
            break
    facts["mkdir"] = [made, code]
os.write(out_fd, json.dumps(facts).encode())
'''


def _native(mode, tmp_path, prefix=()):
    """Run the stand-in in ``mode`` under the real confinement (``prefix``: a command that
    execs it, e.g. with fewer capabilities); returns what it reported and the job."""
    base = tempfile.mkdtemp(prefix="pace-sandbox-walls-")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(outside, 0o777)
    try:
        os.chmod(base, 0o711)
        work, lib = os.path.join(base, "work"), os.path.join(base, "lib")
        os.mkdir(work, 0o700)
        os.mkdir(lib, 0o755)
        limits = {k: v for k, v in asdict(S.SandboxLimits()).items() if k != "timeout_s"}
        job = {"program": "", "work": work, "lib": lib, "uid": S._pick_uid(), "parent_pid": os.getpid(),
               "limits": limits, "queue": "/pace-walls-%d" % os.getpid(), "outside": str(outside)}
        script = tmp_path / "native.py"
        script.write_text(_NATIVE)
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-S", "-B", str(script), os.path.dirname(S._CHILD), json.dumps(job),
                 str(w), mode], pass_fds=(w,), cwd=work, stderr=subprocess.PIPE, start_new_session=True)
            os.close(w)
            w = -1
            chunks = []
            while chunk := os.read(r, 1 << 16):
                chunks.append(chunk)
            _, stderr = proc.communicate(timeout=30)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        assert chunks, stderr.decode()[-2000:]
        assert os.listdir(outside) == []
        return json.loads(b"".join(chunks)), job
    finally:
        shutil.rmtree(os.path.join(base, "work"), ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux namespaces")
def test_kernel_objects_made_inside_die_with_the_run(tmp_path):
    """Without seccomp, only the namespaces: System V objects and a POSIX queue made in the run
    are the run's IPC namespace's, and go with it; the host never sees them."""
    before = sysv_objects()
    facts, job = _native("namespaces", tmp_path)
    assert facts["pid"] == 2  # pid 2 of its own pid namespace (init is 1)
    assert min(facts["shm"], facts["msg"], facts["sem"], facts["mq"]) >= 0, facts  # made, inside
    assert sysv_objects() == before
    assert not mqueue_exists(job["queue"])


# Without CAP_SYS_ADMIN (as for a user without root), the namespaces come from a user namespace.
_NO_ADMIN = ("setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "--")


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86_64 seccomp")
@pytest.mark.parametrize("prefix", [(), _NO_ADMIN], ids=["as-is", "user-namespace"])
def test_native_code_meets_the_kernel_walls(tmp_path, prefix):
    """With the whole confinement and no audit hook: every call issue 22 named (and more) is
    refused by the kernel, nothing is written outside, and a mkdir flood stops at the inode cap;
    the same from a user namespace, where the process keeps no capabilities."""
    if prefix and (shutil.which("setpriv") is None or os.geteuid() != 0):
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN")
    before = sysv_objects()
    facts, job = _native("full", tmp_path, prefix)
    assert "seccomp allowlist" in facts["layers"] and "ipcns" in facts["layers"], facts
    if prefix:
        assert facts["layers"][0] == "userns" and "no capabilities" in facts["layers"], facts
    assert facts["pid"] == 2 and facts["proc"] is False and facts["hostname"] == "pace-sandbox"
    allowed = {name: code for name, code in facts["denied"].items() if code == 0}
    assert not allowed, allowed
    assert all(code in (1, 13, 30) for name, code in facts["denied"].items() if name != "write outside"), facts
    # EPERM, EACCES, EROFS; the outside folder, the host's files, this repository, the stand-in itself:
    # not in the minimal root (Landlock walls reads, not stat)
    assert "minimal root" in facts["layers"] and facts["denied"]["write outside"] == 2, facts  # ENOENT
    assert set(facts["stat host"].values()) == {2} and facts["stdlib"] == ["csv", "sqlite3"], facts
    assert facts["locks"] == {"lockf own": 1}, facts  # EPERM
    made, code = facts["mkdir"]
    assert code == 28 and made < job["limits"]["max_inodes"], facts  # ENOSPC at the cap
    assert sysv_objects() == before
    assert not mqueue_exists(job["queue"])
