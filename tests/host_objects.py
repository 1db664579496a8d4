"""The host's kernel objects that outlive a process: what the sandbox tests read before and after a run
to show that nothing a program made inside survives it."""

import contextlib
import ctypes
import os

from pace_bench.host_slab import slab_mb


def sysv_objects() -> dict[str, list[str]]:
    """The host's System V shared-memory segments, message queues and semaphores (header lines aside)."""
    found = {}
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            found[kind] = sorted(f.read().splitlines()[1:])
    return found


def mqueue_exists(name: str | bytes) -> bool:
    """Whether the POSIX message queue ``name`` exists in the host's IPC namespace (removed if so)."""
    name = name.encode() if isinstance(name, str) else name
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.restype = ctypes.c_int
    fd = libc.mq_open(name, os.O_RDONLY)
    if fd < 0:
        return False
    os.close(fd)
    libc.mq_unlink(name)
    return True


def run_cgroups() -> set[str]:
    """The sandbox's per-run memory cgroups (``pace-run-*``) that exist on the host now."""
    found = set()
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        found |= {os.path.join(root, d) for d in dirs if d.startswith("pace-run-")}
        if root.count("/") > 8:
            dirs[:] = []
    return found


def children() -> set[str]:
    """Live (non-zombie) child processes of this process."""
    me, found = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.add(pid)
    return found


@contextlib.contextmanager
def host_unchanged(slack_mb: float = 64):
    """Around sandbox runs: afterwards this process is alive, no process it started and no run cgroup is
    left (another test process's run may hold one for a moment), and the host's kernel slab grew by less
    than ``slack_mb`` (other processes of the host move it too)."""
    import time

    before, cgroups, slab = children(), run_cgroups(), slab_mb()
    yield
    os.kill(os.getpid(), 0)
    assert children() <= before, "a sandbox process outlived its run"
    for _ in range(40):
        left = run_cgroups() - cgroups
        if not left:
            break
        time.sleep(0.05)
    assert not left, left
    assert slab_mb() - slab < slack_mb, (slab, slab_mb())
