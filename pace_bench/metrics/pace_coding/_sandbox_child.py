"""Child side of :mod:`pace_bench.metrics.pace_coding.sandbox`: confine a process, run the program in it,
report plain data.

Started by ``pace_bench.metrics.pace_coding.sandbox`` as ``python -I -S -B _sandbox_child.py JOB_FD CALL_FD
REPORT_FD``. It uses the standard library only: the isolated interpreter sees neither site-packages
nor ``pace_hf``.

The program is treated as native code in control of this interpreter from the moment it loads:
nothing here is trusted after that. The walls that must hold are set up before, by the kernel:

* three processes: this one (outside the pid namespace, waits), an init (pid 1 of a new pid namespace, waits
  and passes the exit status on) and the sandbox process (pid 2) that confines itself and runs the
  program; when init ends the kernel kills everything left in the namespace;
* new mount, network, pid, IPC and UTS namespaces (``_enter_namespaces``): no pid counter, System V
  object, POSIX message queue, abstract socket or host name is shared with the host or another run;
* the run's memory cgroup, where the parent could make one (``_join_cgroup``): the kernel objects
  the run makes (negative dentries, page cache, slab) count against its limit;
* a minimal read-only root of private copies (the standard library, the shared libraries it needs and
  the mount points below: no other host path exists, even for ``stat``, and no page of a host file is
  shared with another run), no ``/proc``, and a
  ``noexec`` scratch tmpfs whose ``size=`` and ``nr_inodes=`` cap disk and kernel memory (a mkdir
  flood meets ENOSPC), Landlock, resource limits,
  a fresh uid, and a seccomp allowlist (``_install_seccomp``);
* the parent holds the calls and the expected values, sends one call at a time with a fresh nonce
  and accepts exactly one answer for it, within the caps of this harness's replies (``MAX_*``), and
  counts refusals through a kernel counter;
* only the harness holds the channel to the parent: before the program loads, the FIFOs' paths are
  removed (``_swap_pipes``) and the harness's thread takes a descriptor table of its own, while the
  table that the program's threads and processes share has no FIFO (``_start_worker``);
* no inode whose number comes from the host-wide counter (``get_next_ino``: pipes, sockets, procfs)
  is left in reach of the program: the pipes to the parent are swapped for FIFOs in the scratch tmpfs
  (``_swap_pipes``), whose inode numbers are the tmpfs's own, and the program can make no pipe,
  socket or procfs inode.

Order matters. Everything the harness needs is imported and bound to closure variables first,
then the confinement, then the audit hook (a layer: refusals raise PermissionError in the program
and are counted), and only then the program. Between calls the harness runs no Python code that
the program could have replaced: it reads and writes the pipes with ``os.read``/``os.write`` on
raw bytes, encodes with functions captured before the program loaded, and gives each call a fresh
copy of the builtins. The program runs in a worker thread whose stack starts at C level.
"""

import _json
import builtins
import decimal
import fcntl
import json
import os
import resource
import struct
import sys
import _thread
import types as _types

try:  # pre-imported so `import subprocess`/`asyncio` work; fork_exec itself is stubbed below
    import _posixsubprocess
except ImportError:  # pragma: no cover - always present on Linux
    _posixsubprocess = None

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWCGROUP, _CLONE_NEWTIME, _CLONE_THREAD, _CLONE_FILES = 0x02000000, 0x00000080, 0x00010000, 0x00000400
_NAMESPACES = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
_NAMESPACE_FLAGS = _NAMESPACES | _CLONE_NEWUSER | _CLONE_NEWCGROUP | _CLONE_NEWTIME
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 22, 38
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscall table)
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446
# Landlock filesystem rights (uapi/linux/landlock.h); EXECUTE is left to seccomp
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 14, 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV
# Paths C code may read besides the standard library: shared libraries, locales, time zones
_SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime")
# The run's private image (see _pivot_to_minimal_root): its tmpfs, what it leaves out of the standard
# library (tests, tools, GUI, installers, ctypes: about 150 MB this image does not copy), the few host files it
# copies besides, and where shared libraries are looked up by soname.
_IMAGE_MB, _IMAGE_INODES = 160, 8192
_IMAGE_SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "tkinter",
                         "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "__phello__", "venv", "distutils",
                         "ctypes"})
# and extensions of no use without a network or a screen (hashlib falls back to its own hashes without
# _hashlib, and so needs no OpenSSL: 5 MB less to copy per run)
_IMAGE_SKIP_EXTENSIONS = frozenset({"_tkinter", "_curses", "_curses_panel", "readline", "nis", "_crypt", "_ssl",
                                    "_hashlib"})
_IMAGE_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo/UTC", "/usr/share/zoneinfo/Etc/UTC")
_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
             "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")
RLIMIT_LOCKS = 10  # ignored by Linux since 2.4.25: free to serve as the violation counter
VIOLATION_BUDGET = 1_000_000  # RLIMIT_LOCKS hard limit at start; each refusal lowers it by one
SANDBOX_PID = 2  # the sandbox process's pid in its namespace (init is 1)
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}  # per architecture
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

# seccomp allowlist (x86_64 only: syscall numbers differ per architecture). Every other system
# call fails with EPERM: among them System V IPC, mq_*, memfd_create, userfaultfd, io_uring, bpf,
# ptrace, process_vm_*, pidfd_*, mount and namespace calls, links, device nodes, keyrings, xattrs,
# sysinfo and prctl. These are what CPython and the standard library use for files in the scratch
# directory, memory, threads, time, polling, AF_UNIX socket pairs and signals to itself; not flock (a
# covert channel between concurrent runs: see _FCNTL_ALLOW).
_AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64_ALLOW = {
    "write": 1, "read": 0, "mmap": 9, "munmap": 11, "futex": 202, "newfstatat": 262, "lseek": 8,
    "close": 3, "openat": 257, "brk": 12, "mprotect": 10, "fstat": 5, "getdents64": 217,
    "rt_sigprocmask": 14, "rt_sigaction": 13, "rt_sigreturn": 15, "gettid": 186, "getpid": 39,
    "getcwd": 79, "readlink": 89, "readlinkat": 267, "statx": 332, "pread64": 17, "pwrite64": 18,
    "readv": 19, "writev": 20, "preadv": 295, "pwritev": 296, "preadv2": 327, "pwritev2": 328,
    "open": 2, "stat": 4, "lstat": 6, "access": 21, "faccessat": 269, "faccessat2": 439,
    "mremap": 25, "msync": 26, "dup": 32, "dup2": 33, "dup3": 292,
    "select": 23, "pselect6": 270, "poll": 7, "ppoll": 271,
    "epoll_create": 213, "epoll_create1": 291, "epoll_ctl": 233, "epoll_wait": 232,
    "epoll_pwait": 281, "epoll_pwait2": 441, "eventfd": 284, "eventfd2": 290,
    "timerfd_create": 283, "timerfd_settime": 286, "timerfd_gettime": 287,
    "sched_yield": 24, "nanosleep": 35, "clock_nanosleep": 230, "clock_gettime": 228,
    "clock_getres": 229, "gettimeofday": 96, "time": 201, "times": 100, "getrusage": 98,
    "getitimer": 36, "setitimer": 38, "alarm": 37, "timer_create": 222, "timer_settime": 223,
    "timer_gettime": 224, "timer_getoverrun": 225, "timer_delete": 226,
    "rt_sigpending": 127, "rt_sigtimedwait": 128, "rt_sigsuspend": 130, "sigaltstack": 131,
    "pause": 34, "restart_syscall": 219, "exit": 60, "exit_group": 231, "wait4": 61, "waitid": 247,
    "set_robust_list": 273, "get_robust_list": 274, "set_tid_address": 218, "rseq": 334,
    "sendfile": 40, "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "shutdown": 48,
    "getsockname": 51, "getpeername": 52, "listen": 50, "splice": 275, "tee": 276, "copy_file_range": 326,
    "fsync": 74, "fdatasync": 75, "truncate": 76, "ftruncate": 77, "fallocate": 285,
    "fadvise64": 221, "sync_file_range": 277, "chdir": 80, "fchdir": 81, "rename": 82,
    "renameat": 264, "renameat2": 316, "mkdir": 83, "mkdirat": 258, "rmdir": 84, "unlink": 87,
    "unlinkat": 263, "chmod": 90, "fchmod": 91, "fchmodat": 268, "umask": 95, "utime": 132,
    "utimes": 235, "futimesat": 261, "utimensat": 280, "statfs": 137, "fstatfs": 138,
    "getrlimit": 97, "setrlimit": 160, "uname": 63, "getuid": 102, "getgid": 104,
    "geteuid": 107, "getegid": 108, "getppid": 110, "getpgrp": 111, "getpgid": 121,
    "getsid": 124, "getgroups": 115, "getresuid": 118, "getresgid": 120, "getpriority": 140,
    "sched_getaffinity": 204, "sched_getparam": 143, "sched_getscheduler": 145,
    "sched_get_priority_max": 146, "sched_get_priority_min": 147, "sched_rr_get_interval": 148,
    "getcpu": 309, "getrandom": 318, "close_range": 436,
}
# Answered "not supported" (EOPNOTSUPP), as on a file system without them, so that shutil's copies
# carry on: extended attributes.
_X86_64_UNSUPPORTED = {
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "getxattr": 191, "lgetxattr": 192,
    "fgetxattr": 193, "listxattr": 194, "llistxattr": 195, "flistxattr": 196, "removexattr": 197,
    "lremovexattr": 198, "fremovexattr": 199,
}
_X86_64_PROCESS = {"fork": 57, "vfork": 58, "execve": 59, "setsid": 112, "setpgid": 109, "arch_prctl": 158}
_X86_64_CLONE, _X86_64_CLONE3, _X86_64_KILL, _X86_64_TGKILL = 56, 435, 62, 234
_X86_64_SOCKET, _X86_64_SOCKETPAIR, _X86_64_PRLIMIT64 = 41, 53, 302
_X86_64_UNSHARE = 272  # only CLONE_FILES: the harness's descriptor table of its own (see _start_worker)
_X86_64_IOCTL, _X86_64_FCNTL = 16, 72
# Only where processes are allowed (subprocess needs pipes): each pipe or socket takes its inode number
# from a host-wide counter (get_next_ino) that one run can move and the next read, a covert channel.
_X86_64_PIPES = {"pipe": 22, "pipe2": 293, "accept": 43, "accept4": 288}
# Socket options, but SO_PASSPIDFD (76) and SO_PEERPIDFD (77): a pidfd's inode number comes from a
# host-wide counter that every new thread or process moves, a covert channel between runs.
_X86_64_SETSOCKOPT, _X86_64_GETSOCKOPT, _PIDFD_SOCKOPTS = 54, 55, (76, 77)
# madvise: the advice CPython and malloc give; not WILLNEED, COLD or PAGEOUT, which read in or evict
# pages of files mapped before the confinement (the interpreter's own, shared with the host), and not
# MERGEABLE (12): on a host that runs KSM, a page merged with another process's equal page is slower to
# write (copy on write), so a run could tell what another run or the host holds, or signal to a later
# run; and each process that asks costs a KSM slot no cgroup counts. No answer needs it.
_X86_64_MADVISE, _MADVISE_ALLOW = 28, (0, 1, 2, 4, 8, 9, 10, 11, 13, 14, 15, 16, 17)
# ioctl: only terminal/size queries (isatty), FIONREAD and the close-on-exec/non-blocking ones
_IOCTL_ALLOW = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)
# fcntl: dup, fd/file flags, pipe size; not F_SETOWN/F_SETSIG (signals), leases, notify, and no record
# lock at all (F_GETLK, F_SETLK, F_SETLKW and their OFD forms). A lock seen across runs on a shared file
# is a covert channel (flock is refused too, see _X86_64_ALLOW); and each byte unlocked from the middle of
# a locked range splits it in two: the lock cache is charged to no memory cgroup on this kernel and
# RLIMIT_LOCKS is not enforced, so 4 million splits in 12 s grew the host's slab by 745 MB. No answer needs
# a lock (SQLite in the scratch directory: ``?vfs=unix-none``, or ``:memory:``).
_FCNTL_ALLOW = (0, 1, 2, 3, 4, 1030, 1032)
# mmap: private mappings only. Each shared mapping is a shmem file of its own (inode, dentry, file, page)
# that never merges with its neighbour: 65,000 of them, the map count's limit, cost 90 MB of slab and
# 290 MB of shared pages per run. MAP_SHARED and MAP_SHARED_VALIDATE both set bit 0.
_X86_64_MMAP, _MAP_SHARED = 9, 1

MAX_VALUE_CHARS = 1_000_000  # JSON size of one returned value
MAX_EXC_CHARS = 65_536  # JSON size of an exception's args (and, separately, its attributes)
MAX_DEPTH = 100
MAX_NODES = 200_000
MAX_WRITE_OPENS = 64  # files opened for writing per run: with RLIMIT_FSIZE this bounds disk use
MAX_VIOLATION_NAMES = 64  # refusals named in one answer (the kernel counter counts them all)
MAX_VIOLATION_CHARS = 100  # each refusal's name
MAX_EXC_ITEMS = 64  # an exception's args reported, and (separately) its attributes
MAX_TYPE_CHARS = 200  # an exception's class name
MAX_DETAIL_CHARS = 1000  # why a call or the load failed
MAX_PENDING_SIGNALS = 64  # RLIMIT_SIGPENDING: the kernel's own signals (SIGXCPU, SIGCHLD) are not counted

# Events that are always refused. Process creation is refused unless the limits allow processes.
_DENIED_EVENTS = frozenset({
    "os.kill", "os.killpg", "signal.pthread_kill",
    "os.link", "os.symlink", "os.setxattr", "os.removexattr", "os.chflags", "os.lchflags",
    "resource.setrlimit", "resource.prlimit",
    "sys.addaudithook", "sys.settrace", "sys.setprofile", "sys._current_frames",
    "sys._current_exceptions", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "cpython.PyInterpreterState_New", "setopencode",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
    "os.add_dll_directory", "os.startfile", "webbrowser.open", "ensurepip.bootstrap",
    "function.__new__",
})
# code.__new__ (also raised by code.replace) builds hand-made bytecode: refused, except from
# types.coroutine, which only sets a flag on the code of the function it decorates. marshal.loads
# builds code objects from bytes: allowed only to the import system, for the stdlib's .pyc files.
_CODE_NEW, _MARSHAL_LOADS = "code.__new__", ("marshal.loads", "marshal.load")
_DENIED_PREFIXES = ("ctypes.", "_winapi.", "winreg.", "msvcrt.", "syslog.")
_PROCESS_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "_posixsubprocess.fork_exec",
})
# Modules whose import is refused: C-level escape hatches (foreign calls, subinterpreters without
# our hook, unaudited file/shm creation), and a re-import of _posixsubprocess, which would hand
# out an unstubbed fork_exec.
_BLOCKED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "_xxsubinterpreters", "_xxinterpchannels", "_xxinterpqueues",
    "_posixsubprocess", "_posixshmem", "_multiprocessing", "_gdbm", "_dbm", "_tkinter",
    "readline", "_curses", "_curses_panel",
})
_BLOCKED_IMPORT_PREFIXES = ("_test", "_xx")
# Events the hook sees most often; answered first so the hook stays cheap.
_FAST_ALLOW = frozenset({"object.__setattr__", "object.__delattr__", "exec", "compile", "builtins.id"})
# Attributes that hand out frame objects (each raises an "object.__getattr__" audit event).
# Generator, coroutine and async-generator frames are refused outright: a suspended one's f_back
# leads to whoever resumed it, the harness included. Traceback frames only when they reach the
# harness (the program's own tracebacks are ordinary). frame.f_back raises no event, which is why
# the program's own stack starts at C level.
_ALWAYS_DENIED_ATTRS = frozenset({"gi_frame", "cr_frame", "ag_frame"})


def main():
    job_fd, call_fd, report_fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    with open(job_fd, "rb") as f:
        job = json.loads(f.read())
    send = _make_sender(report_fd)
    try:  # nothing here reads the answer: a failure is the host's, and the parent refuses to run code here
        joined = _join_cgroup(job.get("cgroup"))
        layers, read_roots, unshare = _confine(job, (call_fd, report_fd))  # returns in the sandbox process only
        layers += joined
        worker = _start_worker(unshare, (call_fd, report_fd))
        layers.append("channel held by the harness alone")
        to_plain, describe_exception, type_name, encode = _make_converter()
        violations = []
        _install_audit_hook(job["work"], read_roots, job["limits"]["max_processes"] > 0, violations)
    except BaseException as e:  # noqa: BLE001 - the parent must hear why
        send(_plain_json({"setup": [], "failed": "%s: %s" % (type(e).__name__, str(e)[:300])}))
        os._exit(0)
    send(encode({"setup": layers}))
    if not any(layer.startswith("landlock") for layer in layers):
        os._exit(0)  # no OS-level wall against reads and writes: the parent refuses to run code here
    if job.get("answers") is not None:  # parsed here, confined, before any of it runs
        parsed = _parse_answers(job["answers"])
        send(encode(parsed))
        if "rejected" in parsed:
            os._exit(0)
        code = job["answers"][parsed["chosen"] or 0]
        job["program"] = job["program"] + "\n\n" + code if job["program"] else code
    _serve(job["program"], worker, _make_request_reader(call_fd), send, encode, to_plain, describe_exception,
           type_name, violations)


def _parse_answers(codes):
    """``{"chosen", "uses"}`` (see ``_choose_answer``), or ``{"rejected": why}`` where reading, parsing or
    describing the answer raised anything (an int literal too long for ``repr``, memory): that answer alone
    scores 0, with the reason, and none of it runs. Never raises."""
    try:
        chosen, uses = _choose_answer(codes)
        return {"chosen": chosen, "uses": uses}
    except BaseException as e:  # noqa: BLE001
        try:
            return {"rejected": "%s: %s" % (type(e).__name__, str(e)[:300])}
        except BaseException:  # noqa: BLE001
            return {"rejected": "the answer could not be described"}


MAX_USES = 2048  # values per kind in an answer's uses (see _answer_uses)
MAX_USE_CHARS = 64  # longer names and strings are no session fact


def _choose_answer(codes):
    """``(index of the first code that parses and compiles, its uses)``, or ``(None, {})`` if none does.
    The parse runs here, inside the run's limits: a hostile answer's parse costs the parent nothing."""
    import ast
    for k, code in enumerate(codes):
        if not code.strip():
            continue
        try:
            tree = ast.parse(code)
            compile(tree, "<solution>", "exec")  # what the parser takes and the compiler refuses ('return')
        except Exception:  # noqa: BLE001 - SyntaxError, or the parser's or compiler's MemoryError/RecursionError
            continue
        return k, _answer_uses(tree)
    return None, {}


def _answer_uses(tree):
    """How the code uses each name and value, by kind: ``classes`` it defines, names it ``raised``,
    ``fields`` (a class body's annotated names, and attributes), ``names`` it reads (not imports),
    ``strings`` (whole string constants) and ``numbers`` (numeric constants as ``repr`` writes them, and
    string constants, which ``Decimal("0.25")`` takes; not the arguments of ``quantize``, which are the
    rounding's unit, not a constant of the rule). At most ``MAX_USES`` of each, each at most
    ``MAX_USE_CHARS`` long."""
    import ast
    uses = {k: set() for k in ("classes", "raised", "fields", "names", "strings", "numbers")}

    def add(kind, text):
        if type(text) is str and len(text) <= MAX_USE_CHARS and len(uses[kind]) < MAX_USES:
            uses[kind].add(text)

    units = set()  # the constants quantize is called with
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "quantize":
            for arg in node.args[:1]:
                units.update(id(n) for n in ast.walk(arg))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            add("classes", node.name)
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    add("fields", item.target.id)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            add("raised", exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else None)
        elif isinstance(node, ast.Attribute):
            add("fields", node.attr)
            add("names", node.attr)
        elif isinstance(node, ast.Name):
            add("names", node.id)
        elif isinstance(node, ast.Constant) and id(node) not in units:
            value = node.value
            if type(value) is str:
                add("strings", value)
                add("numbers", value)
            elif type(value) in (int, float):
                add("numbers", repr(value))
    return {k: sorted(v) for k, v in uses.items()}


def _join_cgroup(cgroup):
    """Move this process (and so all it starts) into the run's memory cgroup, made by the parent with
    its limit (``cgroup``: its folder, or None where the host has none for us). Returns the layer."""
    if not cgroup:
        return []
    with open(os.path.join(cgroup["path"], "cgroup.procs"), "w") as f:
        f.write("0")
    return ["memory cgroup %d MB" % cgroup["limit_mb"]]


def _plain_json(message):
    return json.dumps(message, ensure_ascii=True)  # only before the program loads


# The worker thread's code. It starts from C (``_thread.start_new_thread(exec, ...)``), so it is
# the bottom frame of every program frame; its globals are this small dict, not the harness's,
# and the harness restores them before every call. Its first lines close the channel to the parent
# in the descriptor table it keeps once the harness has taken a copy of its own (``_start_worker``).
_WORKER = """
go.acquire()
try:
    close(channel[0])
    close(channel[1])
    box[1] = True
except BaseException:
    box[1] = False
del close, channel
done.release()
while True:
    go.acquire()
    try:
        box[1] = (0, run(box[0], ns), None)
    except BaseException as e:
        try:
            text = str(e)
            text = text[:300] if type(text) is str else "?"
        except BaseException:
            text = "?"
        box[1] = (1, e, text)
    done.release()
"""


def _start_worker(unshare, channel):
    """Start the thread that will run the program, with the namespace of module ``solution``; returns
    ``(go, done, box, ns, worker_globals, pristine worker globals)`` for ``_serve``.

    Only the harness answers the parent: threads share one descriptor table, so this thread takes a
    private copy of it (``unshare(CLONE_FILES)``) and the worker closes ``channel`` (the call and report
    FIFOs) in the table it keeps, which every thread and process the program starts inherits. The
    FIFOs' paths are gone already (``_swap_pipes``): no code of the program holds a descriptor of the
    channel or can open one. Raises OSError where the split fails: then no code runs."""
    go, done = _thread.allocate_lock(), _thread.allocate_lock()
    go.acquire()
    done.acquire()
    box = [None, None]
    module = type(sys)("solution")  # not "__main__": demo blocks must not run
    sys.modules["solution"] = module  # dataclasses and typing look their module up here
    sys.modules["__main__"] = type(sys)("__main__")  # the harness's module is not the program's to edit
    ns = module.__dict__
    ns["__builtins__"] = builtins.__dict__  # as in any imported module (the worker's are empty)
    worker_globals = {"__builtins__": {}, "go": go, "done": done, "box": box, "run": eval, "ns": ns,
                      "str": str, "type": type, "BaseException": BaseException}
    pristine = dict(worker_globals)
    worker_globals.update(close=os.close, channel=channel)  # the worker's first lines delete them
    _thread.start_new_thread(exec, (compile(_WORKER, "<worker>", "exec"), worker_globals))
    if unshare(_CLONE_FILES) != 0:
        raise OSError("the harness cannot take a descriptor table of its own (unshare CLONE_FILES)")
    go.release()
    done.acquire()
    if box[1] is not True:
        raise OSError("the program's thread could not close the channel to the parent")
    return go, done, box, ns, worker_globals, pristine


def _serve(program, worker, next_request, send, encode, to_plain, describe_exception, type_name, violations,
           _compile=compile, _str=str, _type=type, _issubclass=issubclass, _dict=dict, _list=list,
           _BaseException=BaseException, _Exception=Exception, _MemoryError=MemoryError,
           _RecursionError=RecursionError, _exit=os._exit, _len=len, _tuple=tuple, _int=int):
    """Answer the parent's requests, one answer each, carrying the request's nonce: the first
    request loads the program as module ``solution``, each later one evaluates a call in its
    namespace. Program code runs only in the worker thread (``worker``, from ``_start_worker``); this
    thread only converts exact
    builtin types, and keeps every object the program handed back so that no finalizer of the
    program runs here. Before each call it restores the worker's globals and gives the call a
    fresh copy of the builtins (a ``__builtins__`` with ``__missing__`` answers nothing), after
    checking that no key of either namespace is a str lookalike whose ``__eq__`` would run here."""
    go, done, box, ns, worker_globals, pristine_worker = worker
    keep = []
    pristine_builtins = _dict(builtins.__dict__)

    def only_str_keys(d):
        for k in d:  # iterating compares and hashes nothing
            if _type(k) is not _str:
                return False
        return True

    def fresh_state():
        """None, or why the program's namespace cannot be given a fresh state safely."""
        if not (only_str_keys(ns) and only_str_keys(worker_globals)):
            return "the program put a non-str key into a namespace"
        keep.append(_list(worker_globals.values()))  # no finalizer runs in this thread
        worker_globals.clear()
        worker_globals.update(pristine_worker)
        keep.append(ns.get("__builtins__"))
        ns["__builtins__"] = _dict(pristine_builtins)
        return None

    def run(code):
        box[0], box[1] = code, None
        go.release()
        done.acquire()
        keep.append(box[1])
        return box[1]

    def outcome_of(code):
        """``(raised, object, text)`` from the worker; None if the program tampered with it."""
        out = run(code)
        if _type(out) is _tuple and _len(out) == 3 and _type(out[0]) is _int and (out[0] == 0 or _type(out[2]) is _str):
            return out
        return None

    def describe(out):
        if out is None:
            return "no result (the program tampered with the harness)"
        return type_name(_type(out[1])) + (": " + out[2] if out[2] else "")

    def answer(nonce, message):
        """Send the one reply to request ``nonce``, within the caps the parent enforces (see ``MAX_*``)."""
        refused = violations[:MAX_VIOLATION_NAMES]
        del violations[:]
        for key in ("detail", "load_error"):
            if _type(message.get(key)) is _str:
                message[key] = message[key][:MAX_DETAIL_CHARS]
        message["c"] = nonce
        message["violations"] = refused
        try:
            text = encode(message)
        except _BaseException:  # noqa: BLE001
            text = encode({"c": nonce, "status": "error", "detail": "result could not be reported",
                           "violations": refused})
        send(text)

    request = next_request()
    if request is None:
        _exit(0)
    try:
        code = _compile(program, "<solution>", "exec")
    except _BaseException as e:  # noqa: BLE001 - SyntaxError, or the compiler's own limits
        code, failed = None, "program failed: %s: %s" % (type_name(_type(e)), _str(e)[:300])
    if code is not None:
        out = outcome_of(code)
        failed = None if out is not None and out[0] == 0 else "program failed: " + describe(out)
    answer(request[0], {"load_error": failed} if failed else {"ready": True})
    if failed:
        _exit(0)

    i = 0
    while True:
        request = next_request()
        if request is None:
            _exit(0)  # do not wait for threads the program left running, do not run its atexit hooks
        nonce, expr = request
        message = None
        try:
            unsafe = fresh_state()
        except _BaseException:  # noqa: BLE001 - e.g. a program thread resizing a namespace meanwhile
            unsafe = "the program's namespace changed while the harness reset it"
        if unsafe is not None:
            message = {"status": "error", "detail": unsafe}
        else:
            try:
                code = _compile(expr, "<call %d>" % i, "eval")
            except _BaseException as e:  # noqa: BLE001
                message = {"status": "error", "detail": "call does not compile: %s: %s" % (
                    type_name(_type(e)), _str(e)[:300])}
        if message is None:
            out = outcome_of(code)
            if out is not None and out[0] == 0:
                try:
                    message = {"status": "ok", "value": to_plain(out[1], MAX_VALUE_CHARS)}
                except _BaseException as e:  # noqa: BLE001 - NotPlain, or MemoryError while copying
                    keep.append(e)
                    message = {"status": "error", "detail": "result is not plain data: " + _str(e)[:300]}
            elif out is not None:
                kind = _type(out[1])
                if _issubclass(kind, _MemoryError):
                    message = {"status": "error", "detail": "memory limit exceeded (MemoryError)"}
                elif _issubclass(kind, _RecursionError):
                    message = {"status": "error", "detail": "recursion limit exceeded (RecursionError)"}
                elif _issubclass(kind, _Exception):
                    message = {"status": "raised"}
                    message.update(describe_exception(out[1]))
                else:  # not an Exception: never a valid "raised"
                    message = {"status": "error", "detail": "call raised " + describe(out)}
            else:
                message = {"status": "error", "detail": describe(out)}
        answer(nonce, message)
        i += 1


def _make_request_reader(fd, _read=os.read, _bytes=bytes, _len=len, _OSError=OSError, _ValueError=ValueError):
    """Return ``next_request() -> (nonce, text) | None``: the parent's next request, a line
    ``NONCE HEX`` (the text as hex-encoded UTF-8), or None when the parent closed the pipe or sent
    something else. Bytes methods only: no Python-level code the program could replace."""
    buf = [b""]
    fromhex = _bytes.fromhex

    def next_request():
        while b"\n" not in buf[0]:
            try:
                chunk = _read(fd, 1 << 16)
            except _OSError:
                return None
            if not chunk:
                return None
            buf[0] += chunk
        line, _, buf[0] = buf[0].partition(b"\n")
        nonce, _, payload = line.partition(b" ")
        if _len(nonce) != 32:
            return None
        try:
            return nonce.decode("ascii"), fromhex(payload.decode("ascii")).decode("utf-8")
        except _ValueError:
            return None

    return next_request


def _make_sender(fd, _write=os.write, _memoryview=memoryview, _OSError=OSError):
    """Return ``send(text)``: one line (ASCII JSON) to the report pipe, written with ``os.write``."""

    def send(text):
        view = _memoryview((text + "\n").encode("ascii"))
        try:
            while view:
                view = view[_write(fd, view):]
        except _OSError:
            pass

    return send


def _make_converter():
    """Return ``(to_plain, describe_exception, type_name, encode)``.

    ``to_plain`` checks exact types (``type(x) is int``), so no program code runs while a value is
    copied, and subclasses with a forged ``__eq__`` cannot pass for plain data. ``encode`` writes
    JSON from such plain data with C functions captured here, before the program loads: replacing
    ``json``'s functions later changes nothing."""
    _type, _str, _len, _list, _tuple, _dict = type, str, len, list, tuple, dict
    _bool, _int, _float, _Decimal = bool, int, float, decimal.Decimal
    _Exception, _BaseException = Exception, BaseException
    type_name = type.__dict__["__name__"].__get__  # the real name, even under a metaclass property
    exc_args = BaseException.__dict__["args"].__get__  # the real args, even if `args` is overridden
    exc_dict = BaseException.__dict__["__dict__"].__get__
    quote, int_text, float_text = _json.encode_basestring_ascii, int.__repr__, float.__repr__
    join, inf, _enumerate = "".join, float("inf"), enumerate

    class NotPlain(Exception):
        pass

    def emit(x, out):
        t = _type(x)
        if x is None:
            out.append("null")
        elif t is _bool:
            out.append("true" if x else "false")
        elif t is _int:
            out.append(int_text(x))
        elif t is _float:
            out.append("NaN" if x != x else "Infinity" if x == inf else "-Infinity" if x == -inf
                       else float_text(x))
        elif t is _str:
            out.append(quote(x))
        elif t is _list:
            out.append("[")
            for k, v in _enumerate(x):
                if k:
                    out.append(",")
                emit(v, out)
            out.append("]")
        elif t is _dict:
            out.append("{")
            first = True
            for k, v in x.items():
                if _type(k) is not _str:
                    raise NotPlain("dict key of type %r" % type_name(_type(k))[:100])
                out.append(quote(k) + ":" if first else "," + quote(k) + ":")
                first = False
                emit(v, out)
            out.append("}")
        else:
            raise NotPlain("value of type %r" % type_name(t)[:100])

    def encode(x):
        out = []
        emit(x, out)
        return join(out)

    def to_plain(x, max_chars):
        budget = [MAX_NODES, max_chars]

        def walk(x, depth):
            t = _type(x)
            budget[0] -= 1
            if budget[0] < 0:
                raise NotPlain("more than %d elements" % MAX_NODES)
            if x is None or t is _bool or t is _float:
                return x
            if t is _int:
                budget[1] -= x.bit_length() // 3  # decimal digits, roughly: refuse before str()
            elif t is _str:
                budget[1] -= _len(x)
            elif t is _Decimal:
                x = {"__decimal__": _str(x)}
            elif depth >= MAX_DEPTH:
                raise NotPlain("nested deeper than %d" % MAX_DEPTH)
            elif t is _list or t is _tuple:
                x = [walk(v, depth + 1) for v in x]
            elif t is _dict:
                out = {}
                for k, v in x.items():
                    if _type(k) is not _str:
                        raise NotPlain("dict key of type %r" % type_name(_type(k))[:100])
                    budget[1] -= _len(k)
                    out[k] = walk(v, depth + 1)
                if _len(out) == 1 and "__decimal__" in out:
                    raise NotPlain("a dict with the reserved key '__decimal__'")
                x = out
            else:
                raise NotPlain("value of type %r" % type_name(t)[:100])
            if budget[1] < 0:
                raise NotPlain("larger than %d characters" % max_chars)
            return x

        plain = walk(x, 0)
        try:
            size = _len(encode(plain))
        except _Exception as e:  # noqa: BLE001 - e.g. an int too long for str()
            raise NotPlain("cannot be encoded (%s)" % type_name(_type(e)))
        if size > max_chars:
            raise NotPlain("larger than %d characters of JSON" % max_chars)
        return plain

    def describe_exception(e):
        """Type name, args and plain instance attributes; anything not plain becomes None/dropped."""
        args = []
        try:
            for a in _tuple(exc_args(e))[:MAX_EXC_ITEMS]:
                try:
                    args.append(to_plain(a, MAX_EXC_CHARS))
                except _BaseException:  # noqa: BLE001
                    args.append(None)
            to_plain(args, MAX_EXC_CHARS)
        except _BaseException:  # noqa: BLE001
            args = None
        attrs = {}
        try:
            d = exc_dict(e)
            if _type(d) is _dict:
                for k, v in _list(d.items())[:MAX_EXC_ITEMS]:
                    if _type(k) is _str and not k.startswith("__"):
                        try:
                            attrs[k] = to_plain(v, MAX_EXC_CHARS)
                        except _BaseException:  # noqa: BLE001
                            pass
            to_plain(attrs, MAX_EXC_CHARS)
        except _BaseException:  # noqa: BLE001
            attrs = {}
        return {"exc_type": type_name(_type(e))[:MAX_TYPE_CHARS], "exc_args": args, "exc_attrs": attrs}

    return to_plain, describe_exception, type_name, encode


def _confine(job, pipes):
    """OS-level confinement. Returns ``(active layer names, read roots, libc's unshare)``, in the sandbox
    process only (see ``_enter_namespaces``); raises where a required wall cannot be set up.

    Required: new mount, network, pid, IPC and UTS namespaces, a fresh ``/proc`` (or none), the
    scratch tmpfs with its size and inode caps, and at least one wall against writes outside it
    (``main`` refuses to run the program otherwise): a mount namespace whose every mount is
    read-only except the scratch tmpfs (needs root, or a user namespace), and a Landlock ruleset
    that allows writes only beneath the working directory and reads only beneath it, the standard
    library and the system's shared libraries (Linux >= 5.13). Both hold for C code too: SQLite's
    ATTACH or a C extension meets the same wall as ``open``.

    Further, each where the OS allows: the standard library bind-mounted where an unprivileged uid
    can read it, resource limits (set before the uid drop, so their hard values cannot be raised
    again), a drop to a fresh uid (so RLIMIT_NPROC counts and the host's files and processes are
    the kernel's to protect), and the seccomp allowlist."""
    limits, work, uid = job["limits"], job["work"], job["uid"]
    script_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p != script_dir]  # Python 3.10: -I does not imply -P
    sys.path[:] = stdlib = [p for p in sys.path if os.path.exists(p)]  # what the image copies
    read_roots = list(stdlib) + ["/usr/share/zoneinfo"]
    libc = _load_libc()
    if libc is None:
        raise OSError("ctypes cannot load the C library: no namespaces, no seccomp")
    layers = _enter_namespaces(libc, job["parent_pid"], pipes)
    if "userns" in layers:
        uid = None  # no uid of the host to drop to from a user namespace
    _private_read_only_root(libc, work, read_roots, layers)
    _mount_scratch(libc, work, uid, limits, layers)
    if job.get("fifos"):
        _swap_pipes(work, pipes)
        layers.append("fifos")
    if libc.sethostname(b"pace-sandbox", 12) == 0:
        layers.append("utsns hostname")
    ruleset, abi = _landlock_ruleset(libc, work, read_roots)

    _set_rlimits(limits, uid is not None)
    layers.append("rlimits")

    if uid is not None:  # the image is readable by every uid
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            layers.append("uid %d" % uid)
        except OSError:
            pass
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if _drop_capabilities(libc):  # root in a user namespace (or a failed uid drop) keeps none
        layers.append("no capabilities")
    if ruleset is not None:  # needs no_new_privs; applies to this thread and all it starts
        import ctypes
        if libc.syscall(_SYS_LANDLOCK_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) == 0:
            layers.append("landlock v%d" % abi)
        os.close(ruleset)
    if _install_seccomp(libc, limits["max_processes"] > 0):
        layers.append("seccomp allowlist")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # a later `import ctypes` then meets the audit hook
    if _posixsubprocess is not None:
        _posixsubprocess.fork_exec = _make_fork_exec_stub(_posixsubprocess.fork_exec)
    os.chdir(work)
    return layers, read_roots, libc.unshare


def _enter_namespaces(libc, parent_pid, pipes):
    """New mount, network, pid, IPC and UTS namespaces, as root or else inside a new user
    namespace; raises OSError where neither works. Returns the layer names, in the sandbox process.

    A new pid namespace takes effect for children only, so this forks twice: this process stays
    outside and waits; its child is init (pid 1), which waits for the sandbox process (pid 2) and
    exits with its status (init cannot be killed by a signal from inside, which would swallow
    SIGXCPU); then the kernel kills whatever is left in the namespace. Each of the waiting
    processes dies with its parent (PR_SET_PDEATHSIG), and neither keeps the pipes open."""
    import ctypes
    libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
    layers = ["netns", "mountns", "pidns", "ipcns", "utsns"]
    if libc.unshare(_NAMESPACES) != 0:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | _NAMESPACES) != 0:
            raise OSError("cannot create new pid, IPC, UTS, network and mount namespaces (errno %d): "
                          "no root, and no user namespaces" % ctypes.get_errno())
        for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % outer_uid),
                           ("gid_map", "0 %d 1" % outer_gid)):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        layers.insert(0, "userns")
    for _level in ("init", "sandbox"):
        alive_r, alive_w = os.pipe()  # EOF on alive_r: the process above has died
        pid = os.fork()
        if pid:
            for fd in list(pipes) + [alive_r]:
                os.close(fd)
            _wait_and_pass_on(pid)
        os.close(alive_w)
        libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
        os.set_blocking(alive_r, False)
        try:
            if os.read(alive_r, 1) == b"":
                os._exit(1)  # the process above died before PDEATHSIG was set
        except BlockingIOError:
            pass
        os.close(alive_r)
    if os.getpid() != SANDBOX_PID:
        raise OSError("the new pid namespace gave pid %d, not %d" % (os.getpid(), SANDBOX_PID))
    return layers


def _drop_capabilities(libc):
    """Empty this process's capability sets (capset, version 3); returns whether it worked."""
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two __user_cap_data_struct: effective, permitted, inheritable, all empty
    nr = _SYS_CAPSET.get(os.uname().machine)
    return nr is not None and libc.syscall(nr, header, data) == 0


def _wait_and_pass_on(pid):
    """Wait for ``pid`` and end with its status: the same exit code, or, for a signal, exit code
    128 + signal in init (which a signal from inside its namespace cannot end) and the same signal
    outside. Never returns."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        sig = code - 128 if os.getpid() != 1 and 128 < code < 128 + 65 else 0
    else:
        code, sig = 128 + os.WTERMSIG(status), os.WTERMSIG(status)
    if sig and os.getpid() != 1:
        import signal
        try:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), sig)
    os._exit(code)


def _private_read_only_root(libc, work, read_roots, layers):
    """In the new mount namespace: stop propagation to the host, move to a minimal root of private
    copies (``_pivot_to_minimal_root``), then make every mount read-only, recursively (mount_setattr,
    Linux >= 5.12). Mounts made after this (the working directory's tmpfs) stay writable. Raises where
    the root cannot be built: the program never runs on the host's files."""
    import ctypes
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError("cannot make the new mount namespace private")
    _pivot_to_minimal_root(libc, work, read_roots, layers)
    attr = struct.pack("=QQQQ", 1 | 2, 0, 0, 0)  # MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID
    if libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(-100), b"/", ctypes.c_uint(0x8000),  # AT_FDCWD,
                    attr, ctypes.c_size_t(len(attr))) == 0:                                # AT_RECURSIVE
        layers.append("read-only root")


def _pivot_to_minimal_root(libc, work, read_roots, layers):
    """A root of the sandbox's own: a tmpfs holding a private copy of what the interpreter and C code may
    read (:func:`_copy_image`), a bind mount of /dev/null and the empty directory the scratch mount needs
    (``work``). The host's root is then detached. No /proc: every inode of a procfs takes its number from
    a host-wide counter (get_next_ino) that one run can move and the next read, as pipes and sockets do.

    Copies, not bind mounts of the host's files: a file shared with other runs shares its page cache
    (one run evicts a page, the next sees it missing: a covert channel), and a lookup of a missing name
    under a host directory leaves a negative dentry on the host's file system, which a ``stat`` flood grows
    by a GiB and which outlives the run. Under the copy, both belong to this tmpfs and die with it.
    Landlock walls reads but not ``stat``: on the host's root the program could still learn which paths
    exist. Raises where it cannot be built (the half-built root is then detached again)."""
    import ctypes
    pivot_root = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if pivot_root is None:
        raise OSError("no pivot_root number for %s" % os.uname().machine)
    new = work  # an existing directory to build on; the scratch tmpfs goes over ``work`` inside it later
    _mount(libc, "pace-sandbox-root", new, "tmpfs", _MS_NOSUID | _MS_NODEV,
           "size=%dm,nr_inodes=%d,mode=0755" % (_IMAGE_MB, _IMAGE_INODES))
    pivoted = False
    try:
        size = _copy_image(new, read_roots)
        os.makedirs(new + "/dev", 0o755, exist_ok=True)
        open(new + "/dev/null", "wb").close()
        _mount(libc, "/dev/null", new + "/dev/null", None, _MS_BIND)
        at = ""
        for part in [p for p in work.split("/") if p]:  # the mount point, and folders the fresh uid passes
            at += "/" + part
            if not os.path.isdir(new + at):
                os.mkdir(new + at, 0o711)
        os.chdir(new)
        if libc.syscall(pivot_root, b".", b".") != 0:
            raise OSError("pivot_root failed (errno %d)" % ctypes.get_errno())
        pivoted = True
        if libc.umount2(b".", 2) != 0:  # MNT_DETACH: the host's root, now stacked over the new one
            raise OSError("cannot detach the host's root (errno %d)" % ctypes.get_errno())
    except OSError:
        os.chdir("/")
        if not pivoted:
            libc.umount2(new.encode(), 2)
        raise
    os.chdir("/")
    layers += ["minimal root", "private image %d MB" % (size >> 20), "no /proc"]


def _copy_image(new, read_roots):
    """Copy into ``new`` (at their own paths, through the same symlinks) the standard library but its
    tests, tools and site-packages, the C extensions the program may import, the shared libraries they
    name (found by their sonames in the system's library folders, then theirs in turn), the loader's
    cache and a UTC time zone. Files are readable by every uid, so the fresh uid needs no other mount.
    Returns the bytes copied."""
    copied = 0
    libs = [d for d in _LIB_DIRS if os.path.isdir(d)]
    wanted = []  # (path on the host) files to copy, in order; shared libraries found on the way join it
    for root in read_roots:
        if os.path.isdir(root) and not root.startswith("/usr/share"):
            for folder, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if d not in _IMAGE_SKIP and not d.startswith("config-")]
                wanted += [os.path.join(folder, f) for f in files if _image_file(f)]
    wanted += [p for p in _IMAGE_FILES if os.path.exists(p)]
    seen, placed = set(), {}  # placed: host folder -> where it is in the new root

    def place(path, depth=0):
        """The new root's path for host ``path``: its folders made, symlinks on the way copied."""
        folder, name = path.rsplit("/", 1)
        if folder in placed and not os.path.islink(path):
            return placed[folder] + "/" + name
        if depth > 16:
            raise OSError("too many symlinks under %s" % path)
        at = ""
        parts = [p for p in path.split("/") if p]
        for k, part in enumerate(parts):
            at += "/" + part
            if os.path.islink(at):
                if not os.path.lexists(new + at):
                    os.symlink(os.readlink(at), new + at)
                rest = "/".join(parts[k + 1:])
                return place(os.path.normpath(os.path.join(os.path.dirname(at), os.readlink(at), rest)), depth + 1)
            if k < len(parts) - 1 and not os.path.isdir(new + at):
                os.mkdir(new + at, 0o755)
        placed[folder] = os.path.dirname(new + at)
        return new + at

    while wanted:
        path = wanted.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path, "rb") as f, open(place(path), "wb") as out:
            size = os.fstat(f.fileno()).st_size
            if path.endswith(".py") or path.endswith(".pyc"):  # most of the bytes: copied in the kernel
                while os.sendfile(out.fileno(), f.fileno(), None, 1 << 24):
                    pass
            else:
                data = f.read()
                out.write(data)
                for name in _needed(data):  # the shared libraries it needs, by soname
                    found = next((d + "/" + name for d in libs if os.path.exists(d + "/" + name)), None)
                    if found is not None:
                        wanted.append(found)
        copied += size
    return copied


def _needed(data):
    """The sonames an ELF64 little-endian shared object needs (its DT_NEEDED entries); [] for other files."""
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for k in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + k * phentsize)
        if kind == 1:  # PT_LOAD
            loads.append((vaddr, offset, filesz))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<QQ", data, dynamic[0] + k) for k in range(0, dynamic[1], 16)]
    strtab = next((v for tag, v in entries if tag == 5), None)  # DT_STRTAB, an address
    at = next((off + strtab - va for va, off, size in loads if va <= (strtab or -1) < va + size), None)
    if at is None:
        return []
    return [data[at + v:data.index(b"\0", at + v)].decode() for tag, v in entries if tag == 1]  # DT_NEEDED


def _image_file(name):
    """Whether a file of the standard library goes into the image: not optimised bytecode (never read
    under -I without -O), not an extension module whose import is refused anyway."""
    if ".opt-" in name:
        return False
    module = name.split(".", 1)[0]
    return not (name.endswith(".so") and (module in _BLOCKED_IMPORTS or module.startswith(_BLOCKED_IMPORT_PREFIXES)
                                          or module in _IMAGE_SKIP_EXTENSIONS))


def _mount(libc, src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError("mount %s (%s) failed" % (target, fstype))


def _swap_pipes(work, pipes):
    """Replace the pipes to the parent (``pipes``: the call and report fds) and stderr with FIFOs in the
    scratch tmpfs, at the same fd numbers. A pipe's inode number comes from a host-wide counter that
    every pipe, socket and procfs inode of the host moves: the parent's pipes, made just before this
    run, would tell the program how far the previous run moved it. A FIFO's number is its tmpfs's own.

    The handshake: make the FIFOs and open them (the call FIFO for reading without waiting, the others
    read-write, which never waits), tell the parent on the old report pipe, which opens them through
    ``/proc/PID/root`` and closes the old call pipe; at its end of file, remove their paths and move the
    FIFOs onto the old numbers."""
    call_fd, report_fd = pipes
    paths = [os.path.join(work, ".pace-" + name) for name in ("call", "report", "stderr")]
    for path in paths:
        os.mkfifo(path, 0o600)
    fifos = [os.open(paths[0], os.O_RDONLY | os.O_NONBLOCK)] + [os.open(p, os.O_RDWR) for p in paths[1:]]
    line = (_plain_json({"fifos": work}) + "\n").encode()
    while line:
        line = line[os.write(report_fd, line):]
    while os.read(call_fd, 1 << 16):  # the parent closes it once it holds the FIFOs
        pass
    for path in paths:  # no one opens them again: no program code can reach the channel by its path
        os.unlink(path)
    fcntl.fcntl(fifos[0], fcntl.F_SETFL, fcntl.fcntl(fifos[0], fcntl.F_GETFL) & ~os.O_NONBLOCK)
    for fifo, fd in zip(fifos, (call_fd, report_fd, 2)):
        os.dup2(fifo, fd)
        os.close(fifo)


def _mount_scratch(libc, work, uid, limits, layers):
    """The scratch tmpfs over ``work``: ``size=`` caps its blocks and ``nr_inodes=`` its files,
    directories and links, so that neither disk nor kernel memory grows past them; ``noexec``, so
    that bytes the program writes there never run as machine code (a shared object it wrote loaded
    with ``_imp.create_dynamic``, an executable where processes are allowed)."""
    owner = "" if uid is None else ",uid=%d,gid=%d" % (uid, uid)
    _mount(libc, "pace-sandbox", work, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
           "size=%dm,nr_inodes=%d,mode=0700%s" % (limits["max_disk_mb"], limits["max_inodes"], owner))
    layers.append("tmpfs %d MB, %d inodes" % (limits["max_disk_mb"], limits["max_inodes"]))


def _landlock_ruleset(libc, work, read_roots):
    """``(ruleset fd, ABI version)``, or ``(None, 0)`` where the kernel has no Landlock.

    Handles every filesystem right but EXECUTE (left to seccomp), TCP bind/connect (ABI 4) and
    signals and abstract sockets outside the sandbox (ABI 6). Allows all of them beneath ``work``,
    reading beneath ``read_roots`` and the system's shared libraries, and /dev/null. Built before
    the uid drop (the rules need the paths opened), applied after (see ``_confine``)."""
    import ctypes
    abi = libc.syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # VERSION
    if abi < 1:
        return None, 0
    fs = ((1 << 13) - 1) | (1 << 13 if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    fs = (fs | (_LL_IOCTL_DEV if abi >= 5 else 0)) & ~_LL_EXECUTE
    attr = struct.pack("=QQQ", fs, 3, 3)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return None, 0
    read = _LL_READ_FILE | _LL_READ_DIR
    rules = [(work, fs), ("/dev/null", _LL_READ_FILE | _LL_WRITE_FILE)]
    rules += [(path, read) for path in list(read_roots) + list(_SYSTEM_READ_ROOTS)]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if not os.path.isdir(path):
            rights &= _LL_FILE_RIGHTS
        rule = struct.pack("=Qi", rights & fs, fd)  # struct landlock_path_beneath_attr (packed)
        libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0))
        os.close(fd)
    return ruleset, abi


def _load_libc():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_char_p]
        libc.unshare.argtypes = [ctypes.c_int]
        libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # variadic: pass full words
        libc.syscall.restype = ctypes.c_long
        return libc
    except (ImportError, OSError, AttributeError):
        return None


def _install_seccomp(libc, allow_processes):
    """The seccomp allowlist (see ``_X86_64_ALLOW``); returns whether the filter is active.

    Deny by default, with EPERM (extended attributes: EOPNOTSUPP). Checked arguments: clone only for threads (CLONE_THREAD, no
    namespace flags) unless processes are allowed, and clone3 (whose flags a filter cannot read)
    answers ENOSYS so that glibc falls back to clone; kill/tgkill only to this process (unless
    processes are allowed: then to the run's pid namespace, which holds only its own), prlimit64
    only on itself, unshare only CLONE_FILES (a thread's descriptor table of its own), sockets only AF_UNIX stream ones (asyncio's self-pipe), mmap only private
    mappings, ioctl and fcntl only the harmless commands (no locks)."""
    import ctypes
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return False
    LD, JEQ, JSET, AND, RET = 0x20, 0x15, 0x45, 0x54, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM, ENOSYS, EOPNOTSUPP = 0x00050000 | 1, 0x00050000 | 38, 0x00050000 | 95
    NR, ARCH, ARG0, ARG1, ARG2, ARG3 = 0, 4, 16, 24, 32, 40  # offsets in struct seccomp_data (little endian)
    me = os.getpid()

    def argument_in(offset, values):
        """Allow if the 32-bit argument at ``offset`` is one of ``values``, else EPERM."""
        body = [(LD, 0, 0, offset)]
        for v in values:
            body += [(JEQ, 0, 1, v), (RET, 0, 0, ALLOW)]
        return body + [(RET, 0, 0, EPERM)]

    def only(nr, body):
        return [(JEQ, 0, len(body), nr)] + body

    clone = [(LD, 0, 0, ARG0), (JSET, 0, 1, _NAMESPACE_FLAGS), (RET, 0, 0, EPERM)]
    clone += [(RET, 0, 0, ALLOW)] if allow_processes else \
        [(JSET, 0, 1, _CLONE_THREAD), (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    unix_stream = [(LD, 0, 0, ARG0), (JEQ, 1, 0, 1), (RET, 0, 0, EPERM), (LD, 0, 0, ARG1),
                   (AND, 0, 0, 0xF), (JEQ, 0, 1, 1), (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    prog = [(LD, 0, 0, ARCH), (JEQ, 1, 0, _AUDIT_ARCH_X86_64), (RET, 0, 0, KILL), (LD, 0, 0, NR)]
    prog += only(_X86_64_CLONE, clone)
    prog += only(_X86_64_CLONE3, [(RET, 0, 0, ENOSYS)])
    if not allow_processes:  # else the pid namespace holds only the program's own processes
        prog += only(_X86_64_KILL, argument_in(ARG0, [me]))
        prog += only(_X86_64_TGKILL, argument_in(ARG0, [me]))
    prog += only(_X86_64_PRLIMIT64, argument_in(ARG0, [0, me]))
    prog += only(_X86_64_UNSHARE, argument_in(ARG0, [_CLONE_FILES]))
    if allow_processes:  # else no socket: each takes its inode number from the host-wide counter
        prog += only(_X86_64_SOCKET, unix_stream)
        prog += only(_X86_64_SOCKETPAIR, unix_stream)
    prog += only(_X86_64_IOCTL, argument_in(ARG1, _IOCTL_ALLOW))
    prog += only(_X86_64_FCNTL, argument_in(ARG1, _FCNTL_ALLOW))
    prog += only(_X86_64_MMAP, [(LD, 0, 0, ARG3), (JSET, 0, 1, _MAP_SHARED), (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)])
    prog += only(_X86_64_MADVISE, argument_in(ARG2, _MADVISE_ALLOW))
    for nr in (_X86_64_SETSOCKOPT, _X86_64_GETSOCKOPT):
        prog += only(nr, [(LD, 0, 0, ARG2), (JEQ, 1, 0, _PIDFD_SOCKOPTS[0]), (JEQ, 0, 1, _PIDFD_SOCKOPTS[1]),
                          (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)])
    allowed = list(_X86_64_ALLOW.values()) + (list(_X86_64_PROCESS.values()) + list(_X86_64_PIPES.values())
                                               + [_X86_64_KILL, _X86_64_TGKILL] if allow_processes else [])
    for nr in allowed:  # x32 numbers (>= 0x40000000) are never equal to these
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ALLOW)]
    for nr in _X86_64_UNSUPPORTED.values():
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, EOPNOTSUPP)]
    prog.append((RET, 0, 0, EPERM))

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    return libc.prctl(_PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0) == 0


def _set_rlimits(limits, own_uid):
    mb = 1024 * 1024

    def cap(which, value):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            soft, hard = resource.getrlimit(which)  # cannot lower the hard limit: lower the soft one
            resource.setrlimit(which, (min(value, hard) if hard >= 0 else value, hard))

    cap(resource.RLIMIT_AS, limits["memory_mb"] * mb)
    cap(resource.RLIMIT_FSIZE, limits["max_file_mb"] * mb)
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, 64)
    cap(resource.RLIMIT_MEMLOCK, 0)
    # queued signals and POSIX timers (each holds one) are kernel memory outside RLIMIT_AS: under the
    # host's default (about 100,000; it grows with RAM) timers pinned 37 MB of unreclaimable slab per run
    cap(resource.RLIMIT_SIGPENDING, MAX_PENDING_SIGNALS)
    cap(RLIMIT_LOCKS, VIOLATION_BUDGET)  # the violation counter (see _install_audit_hook)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    if own_uid:  # counts threads too, and only for this fresh uid
        cap(resource.RLIMIT_NPROC, 1 + limits["max_threads"] + limits["max_processes"])


def _make_fork_exec_stub(original):
    """`subprocess` calls this C function directly; route it through the audit hook."""
    audit = sys.audit

    def fork_exec(*args):
        audit("_posixsubprocess.fork_exec")
        return original(*args)

    return fork_exec


def _install_audit_hook(work, read_roots, allow_processes, violations):
    """Refuse network, process creation, signals, foreign calls, hand-made code objects, frames
    that lead to the harness and file changes outside ``work``: a layer behind the OS walls of
    ``_confine``, which hold even where this hook is fooled or switched off (C code such as SQLite
    opens files without an audit event; a program with arbitrary memory access can empty the hook
    list).

    Reads are allowed inside ``work`` and the standard library only. Each refusal raises
    PermissionError in the program, and first lowers the hard RLIMIT_LOCKS of the sandbox process
    (pid 2, whichever process of the run refused: a forked child's own limit is not the one the
    parent reads; seccomp lets prlimit reach pid 2 from each of them): the parent reads that counter
    between calls and scores the call during which it dropped as an error, even if the program
    caught the exception. A hard limit cannot be raised again, so the program can make the
    count go down (only against itself) but never back up. The refusal is also named in the call's
    answer. Every argument's type is checked before it is compared (``==``, ``in``), so no object
    of the program runs code inside the hook."""
    _type, _str, _bytes, _int, _len, _tuple = type, str, bytes, int, len, tuple
    _PermissionError, _Exception, _getattr = PermissionError, Exception, getattr
    getcwd, fstat, collapse = os.getcwd, os.fstat, _collapse
    getrlimit, exit_, get_ident = resource.getrlimit, os._exit, _thread.get_ident
    prlimit = resource.prlimit
    harness_globals, always_denied = globals(), _ALWAYS_DENIED_ATTRS
    getframe, code_new, flag_setter = sys._getframe, _CODE_NEW, _types.coroutine.__code__
    marshal_loads, pyc_loader = _MARSHAL_LOADS, sys.modules["_frozen_importlib_external"]._compile_bytecode.__code__
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    default_dir_fds = (None, -1, -100)  # -100: AT_FDCWD
    denied_events, denied_prefixes = _DENIED_EVENTS, _DENIED_PREFIXES
    process_events, fast_allow = _PROCESS_EVENTS, _FAST_ALLOW
    blocked_imports, blocked_import_prefixes = _BLOCKED_IMPORTS, _BLOCKED_IMPORT_PREFIXES
    work = _normalize(work)
    work_roots = (work,)
    work_dev, image_dev = os.stat(work).st_dev, os.stat("/").st_dev  # the scratch tmpfs, the run's image
    image_path = _normalize(read_roots[0]) + "/.fd"
    read_roots = tuple(_normalize(r) for r in read_roots) + work_roots
    memory_dbs = (":memory:", "", b":memory:", b"")
    # event -> position of its dir_fd argument (shutil.* are checked through the os.* they call)
    mutating = {"os.remove": -1, "os.rmdir": -1, "os.mkdir": -1, "os.chmod": -1, "os.chown": -1,
                "os.utime": -1, "os.truncate": None}
    writes, inside = [0], set()

    def deny(event):
        try:
            hard = prlimit(SANDBOX_PID, RLIMIT_LOCKS)[1]
            prlimit(SANDBOX_PID, RLIMIT_LOCKS, (hard - 1, hard - 1))
        except _Exception:  # noqa: BLE001 - the counter is spent or gone: stop the run here
            exit_(3)
        if _len(violations) < MAX_VIOLATION_NAMES:  # the counter counts them all
            violations.append(event[:MAX_VIOLATION_CHARS])
        raise _PermissionError("sandbox: %s is not allowed" % event[:100])

    def harness_frame(frame):
        """Whether ``frame`` or a frame below it runs harness code (whose closures hold the hook)."""
        while frame is not None:
            if frame.f_globals is harness_globals:
                return True
            frame = frame.f_back
        return False

    def frame_of(obj, name):
        me = get_ident()
        inside.add(me)  # reading the attribute raises this event again: let that one through
        try:
            return _getattr(obj, name)
        finally:
            inside.discard(me)

    def caller_code():
        """The code object of the Python function whose C call raised the current event."""
        me = get_ident()
        inside.add(me)  # sys._getframe raises its own event: let that one through
        try:
            return getframe(2).f_code  # 0: this function, 1: the hook
        except _Exception:  # noqa: BLE001
            return None
        finally:
            inside.discard(me)

    def fd_path(fd):
        """Where ``fd`` lies, as far as the checks need it (there is no /proc to read its path from): a
        path inside ``work`` for a file or folder of the scratch tmpfs, inside the standard library for
        one of the run's image, None for anything else."""
        if _type(fd) is not _int:
            return None
        try:
            dev = fstat(fd).st_dev
        except _Exception:  # noqa: BLE001
            return None
        return work + "/.fd" if dev == work_dev else image_path if dev == image_dev else None

    def resolve(path, dir_fd=None):
        """Absolute, lexically normalised path; no symlink lookup (none can be made in work)."""
        t = _type(path)
        if t is _int:
            path = fd_path(path)  # fd-based operation: the file the fd refers to
        elif t is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif t is not _str:
            return None
        if path is None or "\0" in path:
            return None
        if not path.startswith("/"):
            if dir_fd is not None and _type(dir_fd) is not _int:
                return None
            base = getcwd() if dir_fd in default_dir_fds else fd_path(dir_fd)
            if base is None:
                return None
            path = base + "/" + path
        return collapse(path)

    def under(path, roots, dir_fd=None):
        try:
            p = resolve(path, dir_fd)
        except _Exception:  # noqa: BLE001
            return False
        if p is None:
            return False
        for root in roots:
            if p == root or p.startswith(root + "/"):
                return True
        return False

    def check_open(event, path, mode, flags):
        if _type(path) is _int and mode is not None:
            return  # wrapping a descriptor that was opened (and checked) before
        writing = _type(flags) is not _int or flags & write_flags
        if mode is None:  # os.open: dir_fd is not in the event, so no ".." and only inside work
            text = path.decode("utf-8", "surrogateescape") if _type(path) is _bytes else path
            if _type(text) is not _str or ".." in text.split("/") or not under(text, work_roots):
                deny(event + " (os.open outside the working directory)")
        elif writing and not under(path, work_roots):
            deny(event + " for writing outside the working directory")
        elif not writing and not under(path, read_roots):
            deny(event + " outside the working directory and the standard library")
        if writing:
            writes[0] += 1
            if writes[0] > MAX_WRITE_OPENS:
                deny(event + " (more than %d files opened for writing)" % MAX_WRITE_OPENS)

    def hook(event, args):
        if _type(event) is not _str or _type(args) is not _tuple:
            return  # the interpreter passes exactly these types
        if event in fast_allow:
            return
        if event == "object.__getattr__":
            name = args[1] if _len(args) > 1 else None
            if _type(name) is not _str:
                return
            if name in always_denied:
                deny("reading a suspended frame (%s)" % name)
            if name == "tb_frame" and get_ident() not in inside and harness_frame(frame_of(args[0], name)):
                deny("reading a harness frame (%s)" % name)
        elif event == code_new:
            if caller_code() is not flag_setter:
                deny(event + " (hand-made code objects)")
        elif event in marshal_loads:
            if caller_code() is not pyc_loader:
                deny(event + " (code objects from bytes)")
        elif event == "sys._getframe":
            if get_ident() not in inside and harness_frame(args[0]):
                deny("sys._getframe reaching a harness frame")
        elif event == "resource.setrlimit" and _type(args[0]) is _int and args[0] == RLIMIT_LOCKS:
            new = args[1]
            if not (_type(new) is _tuple and _len(new) == 2 and _type(new[1]) is _int
                    and new[1] < getrlimit(RLIMIT_LOCKS)[1]):
                deny(event + " raising the violation counter")
        elif event == "resource.prlimit" and _len(args) == 3 and _type(args[1]) is _int \
                and args[1] == RLIMIT_LOCKS:
            new = args[2]  # None: a read
            if not (new is None or _type(new) is _tuple and _len(new) == 2 and _type(new[1]) is _int
                    and new[1] < prlimit(SANDBOX_PID, RLIMIT_LOCKS)[1]):
                deny(event + " raising the violation counter")
        elif event == "open":
            check_open(event, args[0], args[1], args[2])
        elif event == "import":
            name = args[0]
            top = name.partition(".")[0] if _type(name) is _str else ""
            if top in blocked_imports or top.startswith(blocked_import_prefixes):
                deny("import " + top)
            origin = args[1] if _len(args) > 1 else None  # a C extension's file (_imp.create_dynamic)
            if origin is not None and not under(origin, read_roots):
                deny("import %s from outside the standard library" % top)
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and _type(args[0]) is not _int and not under(args[0], read_roots):
                deny(event + " outside the working directory and the standard library")
        elif event in mutating:
            pos = mutating[event]
            if not under(args[0], work_roots, None if pos is None else args[pos]):
                deny(event + " outside the working directory")
        elif event == "os.rename":
            if not (under(args[0], work_roots, args[2]) and under(args[1], work_roots, args[3])):
                deny(event + " outside the working directory")
        elif event == "os.chdir":
            if not under(args[0], work_roots):
                deny(event + " outside the working directory")
        elif event.startswith("socket."):
            family = args[1] if event == "socket.__new__" and _len(args) > 1 else None
            if not (_type(family) is _int and family == 1):
                deny(event)  # only AF_UNIX socket pairs (asyncio's self-pipe) may be created
        elif event == "sqlite3.connect":
            db = args[0]
            if not ((_type(db) is _str or _type(db) is _bytes) and db in memory_dbs) and not under(db, work_roots):
                deny(event + " outside the working directory")
        elif event in denied_events or event.startswith(denied_prefixes):
            deny(event)
        elif event in process_events and not allow_processes:
            deny(event)

    sys.addaudithook(hook)


def _normalize(path):
    return _collapse(os.path.abspath(path))


def _collapse(path):
    """Lexically normalise an absolute path ("..", ".", repeated "/"); pure string work, safe
    inside the audit hook."""
    parts = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


if __name__ == "__main__":
    main()
