"""The host's kernel objects that outlive a process: what the sandbox tests read before and after a run
to show that nothing a program made inside survives it."""

import ctypes
import os


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
