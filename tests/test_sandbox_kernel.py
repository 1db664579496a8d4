"""Kernel objects that a run's memory cgroup does not bound, and the cgroup's own removal (issue 54).

Each attack is a real run of :func:`run_calls`; the host's kernel memory (slab, and page tables where the
attack maps) is sampled while it lasts, as ``tests/test_sandbox_channels.py`` does."""

import os
import signal
import subprocess
import textwrap

import pytest

from pace_bench.host_slab import KERNEL, SlabPeak
from pace_bench.metrics.pace_coding import sandbox
from pace_bench.metrics.pace_coding.sandbox import SandboxLeak, SandboxLimits, run_calls

from host_objects import host_unchanged, run_cgroups

pytestmark = pytest.mark.usefixtures("code_eval_allowed")
ATTACK = SandboxLimits(timeout_s=20.0, memory_mb=512, cpu_s=15)


def run(program, calls, limits=ATTACK):
    return run_calls(textwrap.dedent(program), calls, limits)


@pytest.fixture
def host():
    with host_unchanged():
        yield


_LOCKS = """
import fcntl, os, time
def split(n, seconds, files):
    # lock a long range of each file, then unlock every other byte from its end: each unlock splits the
    # lock in two, and the kernel's lock cache is charged to no memory cgroup
    made, start = 0, time.monotonic()
    for j in range(files):
        fd = os.open("f%d.lock" % j, os.O_RDWR | os.O_CREAT)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 2 * n + 2, 0)
        for k in range(n):
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, 2 * (n - k))
            made += 1
            if time.monotonic() - start > seconds:
                return made
    return made
"""


def test_byte_range_lock_splits_are_refused(host):
    """Unlocking single bytes of a locked range split it into millions of locks: 4 million in 12 s grew
    the host's slab by 745 MB while the run's cgroup held 55 MB (the lock cache is not charged; Linux does
    not enforce RLIMIT_LOCKS). seccomp now refuses every record lock: the first one fails."""
    with SlabPeak() as slab:
        results = run(_LOCKS, ["split(200_000, 6, 20)"])
    assert results[0].status == "raised" and results[0].exc_type == "PermissionError", results
    assert slab.peak_growth < 64, (slab.before, slab.peak)


def test_same_page_merging_is_refused():
    """MADV_MERGEABLE offers a run's pages to KSM, which merges equal pages across processes: where the host
    runs KSM, write timing then tells a run what others hold. seccomp refuses the advice; the advice
    CPython and malloc give still works."""
    results = run("""
import mmap
def advise(name):
    m = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE)
    m.write(b"x" * (1 << 16))
    m.madvise(getattr(mmap, name))
    return name
""", ["advise('MADV_MERGEABLE')", "advise('MADV_DONTNEED')", "advise('MADV_HUGEPAGE')"])
    assert results[0].status == "raised" and results[0].exc_type == "PermissionError", results
    assert [r.status for r in results[1:]] == ["ok", "ok"], results


_MAPS = """
import mmap, time
keep = []
def shared(n):
    # one page each, never merged with its neighbour: a shmem file (inode, dentry, file) per mapping
    for _ in range(n):
        m = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
        m[0] = 1
        keep.append(m)
    return len(keep)
def private(n, gap):
    # a touched page, then a gap mapped and later closed: the pages cannot merge into one mapping
    gaps = []
    for _ in range(n):
        try:
            m = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
            m[0] = 1
            keep.append(m)
            gaps.append(mmap.mmap(-1, gap, flags=mmap.MAP_PRIVATE))
        except OSError:  # the map count's limit (65,530 mappings)
            break
        if len(gaps) >= 100:
            for g in gaps:
                g.close()
            gaps = []
    return len(keep) > 50_000
"""


def test_shared_mappings_are_refused_and_private_ones_stay_charged(host):
    """65,000 shared one-page mappings (the map count's limit) grew the host's slab by 90 MB and its
    shared pages by 290 MB per run. seccomp now refuses MAP_SHARED; private mappings split apart by closed
    gaps reach the map count's limit too, but cost the host almost no slab or page tables."""
    with SlabPeak(fields=KERNEL) as kernel:
        results = run(_MAPS, ["shared(100_000)", "private(100_000, 4096)", "private(100_000, 2 << 20)"])
    assert results[0].status == "raised" and results[0].exc_type == "PermissionError", results
    assert [r.value for r in results[1:]] == [True, True], results
    assert kernel.peak_growth < 64, (kernel.before, kernel.peak)


_HOLD = """
import mmap, os, time
def hold(n):
    # allocate what the run may, then never answer: the parent kills the run at its deadline
    keep = [mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE) for _ in range(n)]
    for m in keep:
        m[0] = 1
    while True:
        pass
"""


@pytest.mark.slow
def test_twenty_runs_killed_while_holding_objects_leave_no_cgroup(host):
    """A run that dies slower than the parent waited left its cgroup behind, silently (2-3 per harness run;
    each holds one of the host's 65,535 memory-cgroup ids). The parent now kills every process in the
    cgroup, waits until ``cgroup.procs`` is empty and only then removes it: after each of 20 runs killed at
    their deadline, no cgroup is left."""
    before = run_cgroups()
    for k in range(20):
        results = run(_HOLD, [f"hold({20_000 + k})"], SandboxLimits(timeout_s=1.5, memory_mb=256, cpu_s=5))
        assert results[0].status == "timeout", results
        assert run_cgroups() == before, k


def _cgroup_base():
    """This process's memory cgroup folder (v1), or skip where there is none we may use."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                base = "/sys/fs/cgroup/memory" + path
                if os.access(base, os.W_OK):
                    return base
    pytest.skip("no cgroup v1 memory hierarchy this process may write")


def test_a_dead_parents_cgroup_is_swept_at_start_up(monkeypatch, host):
    """A parent killed before its cleanup leaves its run's cgroup, with whatever still lives in it. The
    first run of the next process removes every ``pace-run-PID-*`` folder whose PID is gone: it kills the
    processes still in it, waits for it to empty and removes it."""
    base = _cgroup_base()
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = os.path.join(base, f"pace-run-{gone.pid}-feedfacefeedface")
    os.mkdir(left)
    squatter = subprocess.Popen(["sleep", "60"])
    try:
        with open(os.path.join(left, "cgroup.procs"), "w") as f:
            f.write(str(squatter.pid))
        monkeypatch.setattr(sandbox, "_SWEPT", set())  # a fresh process's first run
        assert run("def f():\n    return 1\n", ["f()"])[0].value == 1
        assert not os.path.exists(left)
        assert squatter.wait(timeout=5) == -signal.SIGKILL
    finally:
        squatter.kill()
        squatter.wait()
        if os.path.exists(left):
            os.rmdir(left)


def test_a_cgroup_that_cannot_be_removed_is_a_loud_error(monkeypatch):
    """The parent gave up on a cgroup it could not remove after 50 tries, silently. Now it raises: here a
    run's folder holds a cgroup of its own, which the kernel refuses to remove it around."""
    base = _cgroup_base()
    folder = os.path.join(base, f"pace-run-{os.getpid()}-0123456789abcdef")
    monkeypatch.setattr(sandbox, "_REMOVE_S", 0.2)
    os.makedirs(os.path.join(folder, "inner"))
    try:
        with pytest.raises(SandboxLeak, match="could not be removed"):
            sandbox._remove_cgroup({"path": folder, "v1": True})
    finally:
        os.rmdir(os.path.join(folder, "inner"))
        os.rmdir(folder)
