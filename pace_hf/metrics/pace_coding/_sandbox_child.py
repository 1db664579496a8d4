"""Child side of :mod:`pace_hf.metrics.pace_coding.sandbox`: confine this process, run the program, report plain data.

Started by ``pace_hf.metrics.pace_coding.sandbox`` as ``python -I -S -B _sandbox_child.py JOB_FD CALL_FD REPORT_FD``.
It uses the standard library only: the isolated interpreter sees neither site-packages nor
``pace_hf``.

Order matters. Everything the harness needs is imported and bound to closure variables first,
then the OS-level confinement (namespaces, a read-only root, Landlock, rlimits, uid drop,
seccomp), then the audit hook, and only then the untrusted program.

Nothing in this process is secret and nothing in it decides a score. The parent holds the calls
and sends call ``i`` only after it has the result of call ``i - 1``; it compares results with
expected values that never leave it, and it attributes blocked operations itself (see
``_install_audit_hook``). The program runs in a worker thread whose stack starts at C level, so
its frames lead to no harness frame; the audit hook also refuses frame objects of the harness.
"""

import builtins
import decimal
import json
import os
import resource
import struct
import sys
import _thread

try:  # pre-imported so `import subprocess`/`asyncio` work; fork_exec itself is stubbed below
    import _posixsubprocess
except ImportError:  # pragma: no cover - always present on Linux
    _posixsubprocess = None

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 1, 2, 4, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscall table)
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446
# Landlock filesystem rights (uapi/linux/landlock.h); EXECUTE is left to seccomp
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 14, 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV
# Paths C code may read besides the standard library: shared libraries, locales, time zones
_SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime")
RLIMIT_LOCKS = 10  # ignored by Linux since 2.4.25: free to serve as the violation counter
VIOLATION_BUDGET = 1_000_000  # RLIMIT_LOCKS hard limit at start; each refusal lowers it by one

# seccomp (x86_64 only: syscall numbers differ per architecture). Refused with EPERM whatever
# the audit hook does: signals to other processes (incl. pidfd ones, which Python does not audit),
# new processes, network sockets, namespace/mount changes, links and device nodes, and kernel
# interfaces a program has no business with.
_AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64_DENY = {
    "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "tkill": 200,
    "connect": 42, "bind": 49, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "mount": 165, "umount2": 166, "unshare": 272, "setns": 308, "pivot_root": 155, "chroot": 161,
    "mknod": 133, "mknodat": 259, "symlink": 88, "symlinkat": 266, "link": 86, "linkat": 265,
    "open_by_handle_at": 304, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250,
    "add_key": 248, "request_key": 249, "kexec_load": 246, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    "iopl": 172, "ioperm": 173, "fsopen": 430, "fsmount": 432, "move_mount": 429, "open_tree": 428,
}
_X86_64_PROCESS = {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322}
_X86_64_CLONE, _X86_64_CLONE3, _X86_64_KILL, _X86_64_TGKILL = 56, 435, 62, 234
_X86_64_SOCKET, _X86_64_SOCKETPAIR = 41, 53

MAX_VALUE_CHARS = 1_000_000  # JSON size of one returned value
MAX_EXC_CHARS = 65_536  # JSON size of an exception's args (and, separately, its attributes)
MAX_DEPTH = 100
MAX_NODES = 200_000
MAX_WRITE_OPENS = 64  # files opened for writing per run: with RLIMIT_FSIZE this bounds disk use

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
})
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
_FAST_ALLOW = frozenset({
    "object.__setattr__", "object.__delattr__", "exec", "compile", "builtins.id",
    "marshal.loads", "code.__new__", "function.__new__",
})
# Attributes that hand out frame objects (each raises an "object.__getattr__" audit event).
# frame.f_back does not, which is why the program's own stack starts at C level.
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


def main():
    job_fd, call_fd, report_fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    with open(job_fd, "rb") as f:
        job = json.loads(f.read())
    report = _make_reporter(report_fd, job["nonce"])
    try:
        layers, read_roots = _confine(job)
        to_plain, describe_exception, type_name = _make_converter()
        _install_audit_hook(job["work"], read_roots, job["limits"]["max_processes"] > 0, report)
    except BaseException as e:  # noqa: BLE001 - the parent must hear why
        report({"setup": [], "failed": "%s: %s" % (type(e).__name__, str(e)[:300])})
        os._exit(0)
    report({"setup": layers})
    if not any(layer.startswith(("landlock", "read-only root")) for layer in layers):
        os._exit(0)  # no OS-level wall against writes: the parent refuses to run code here
    _serve(job["program"], _make_call_reader(call_fd), report, to_plain, describe_exception, type_name)


# The worker thread's code. It starts from C (``_thread.start_new_thread(exec, ...)``), so it is
# the bottom frame of every program frame; its globals are this small dict, not the harness's.
_WORKER = """
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


def _serve(program, next_call, report, to_plain, describe_exception, type_name):
    """Load the program as module ``solution``, then evaluate each call the parent sends, one
    report per call. Program code runs only in the worker thread; this thread only converts
    exact builtin types, and keeps every object the program handed back so that no finalizer
    of the program runs here."""
    _compile, _str, _type, _issubclass = compile, str, type, issubclass
    _BaseException, _Exception = BaseException, Exception
    _MemoryError, _RecursionError, _exit, _modules = MemoryError, RecursionError, os._exit, sys.modules
    go, done = _thread.allocate_lock(), _thread.allocate_lock()
    go.acquire()
    done.acquire()
    box, keep = [None, None], []
    module = type(sys)("solution")  # not "__main__": demo blocks must not run
    _modules["solution"] = module  # dataclasses and typing look their module up here
    module.__builtins__ = builtins  # eval would otherwise give it the worker's empty builtins
    worker_globals = {"__builtins__": {}, "go": go, "done": done, "box": box, "run": eval,
                      "ns": module.__dict__, "str": str, "type": type, "BaseException": BaseException}
    _thread.start_new_thread(exec, (_compile(_WORKER, "<worker>", "exec"), worker_globals))

    def run(code):
        box[0], box[1] = code, None
        go.release()
        done.acquire()
        keep.append(box[1])
        return box[1]

    def outcome_of(code):
        """``(raised, object, text)`` from the worker; None if the program tampered with it."""
        out = run(code)
        if _type(out) is tuple and len(out) == 3 and _type(out[0]) is int and (out[0] == 0 or _type(out[2]) is _str):
            return out
        return None

    def describe(out):
        if out is None:
            return "no result (the program tampered with the harness)"
        return type_name(_type(out[1])) + (": " + out[2] if out[2] else "")

    try:
        code = _compile(program, "<solution>", "exec")
    except _BaseException as e:  # noqa: BLE001 - SyntaxError, or the compiler's own limits
        code, failed = None, "program failed: %s: %s" % (type_name(_type(e)), _str(e)[:300])
    if code is not None:
        out = outcome_of(code)
        failed = None if out is not None and out[0] == 0 else "program failed: " + describe(out)
    report({"load_error": failed} if failed else {"ready": True})
    if failed:
        _exit(0)

    i = 0
    while True:
        expr = next_call()
        if expr is None:
            _exit(0)  # do not wait for threads the program left running, do not run its atexit hooks
        message = None
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
        message["i"] = i
        if not report(message):
            report({"i": i, "status": "error", "detail": "result could not be reported"})
        i += 1


def _make_call_reader(fd):
    """Return ``next_call() -> str | None``: the next call expression the parent sent, or None
    when the parent closed the pipe (no more calls)."""
    read, buf = os.read, [b""]

    def next_call():
        while b"\n" not in buf[0]:
            try:
                chunk = read(fd, 1 << 16)
            except OSError:
                return None
            if not chunk:
                return None
            buf[0] += chunk
        line, _, buf[0] = buf[0].partition(b"\n")
        try:
            return json.loads(line)["call"]
        except (ValueError, KeyError, TypeError):
            return None

    return next_call


def _make_reporter(fd, nonce):
    """Return ``report(dict) -> bool`` that writes one JSON line to the report pipe.

    A lock keeps lines from interleaving when the audit hook reports from another thread."""
    encode = json.JSONEncoder(ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode
    write, lock, _memoryview, _Exception = os.write, _thread.allocate_lock(), memoryview, Exception

    def report(message):
        message["n"] = nonce
        try:
            view = _memoryview((encode(message) + "\n").encode("ascii"))
        except _Exception:  # noqa: BLE001
            return False
        if not lock.acquire(True, 5.0):
            return False
        try:
            while view:
                view = view[write(fd, view):]
        except OSError:
            return False
        finally:
            lock.release()
        return True

    return report


def _make_converter():
    """Return ``(to_plain, describe_exception, type_name)``.

    ``to_plain`` checks exact types (``type(x) is int``), so no program code runs while a value is
    copied, and subclasses with a forged ``__eq__`` cannot pass for plain data."""
    _type, _str, _len, _list, _tuple, _dict = type, str, len, list, tuple, dict
    _bool, _int, _float, _Decimal = bool, int, float, decimal.Decimal
    _Exception, _BaseException = Exception, BaseException
    type_name = type.__dict__["__name__"].__get__  # the real name, even under a metaclass property
    exc_args = BaseException.__dict__["args"].__get__  # the real args, even if `args` is overridden
    exc_dict = BaseException.__dict__["__dict__"].__get__
    encode = json.JSONEncoder(ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode

    class NotPlain(Exception):
        pass

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
            for a in _tuple(exc_args(e))[:64]:
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
                for k, v in _list(d.items())[:64]:
                    if _type(k) is _str and not k.startswith("__"):
                        try:
                            attrs[k] = to_plain(v, MAX_EXC_CHARS)
                        except _BaseException:  # noqa: BLE001
                            pass
            to_plain(attrs, MAX_EXC_CHARS)
        except _BaseException:  # noqa: BLE001
            attrs = {}
        return {"exc_type": type_name(_type(e))[:200], "exc_args": args, "exc_attrs": attrs}

    return to_plain, describe_exception, type_name


def _confine(job):
    """OS-level confinement. Returns ``(active layer names, read roots)``.

    The walls against writes outside the working directory, at least one of which must hold
    (``main`` refuses to run the program otherwise): a mount namespace whose every mount is
    read-only except the tmpfs working directory (needs root), and a Landlock ruleset that allows
    writes only beneath the working directory and reads only beneath it, the standard library and
    the system's shared libraries (needs Linux >= 5.13, works without privileges). Both hold for C
    code too: SQLite's ATTACH or a C extension meets the same wall as ``open``.

    Further, each best effort: a new network namespace, the standard library bind-mounted where an
    unprivileged uid can read it, resource limits (set before the uid drop, so their hard values
    cannot be raised again), a drop to a fresh uid (so RLIMIT_NPROC counts and signals to the host
    fail), and seccomp."""
    limits, work, lib, uid = job["limits"], job["work"], job["lib"], job["uid"]
    layers = []
    script_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p != script_dir]  # Python 3.10: -I does not imply -P
    stdlib = [p for p in sys.path if os.path.exists(p)]
    read_roots = list(stdlib) + ["/usr/share/zoneinfo"]
    libc = _load_libc()
    mounted_stdlib = False
    if libc is not None:
        if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) == 0:
            layers += ["netns", "mountns"]
            if _private_read_only_root(libc, layers):
                mounted_stdlib = _mount_tmpfs_and_stdlib(libc, work, lib, uid, limits, stdlib, layers, read_roots)
        elif libc.unshare(_CLONE_NEWNET) == 0:
            layers.append("netns")
        elif libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
            layers.append("netns (user namespace)")
    ruleset, abi = _landlock_ruleset(libc, work, read_roots) if libc is not None else (None, 0)

    _set_rlimits(limits, uid is not None)
    layers.append("rlimits")

    if uid is not None and (mounted_stdlib or all(_readable_by_others(p) for p in stdlib)):
        try:
            if "tmpfs" not in layers:
                os.chown(work, uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            layers.append("uid %d" % uid)
        except OSError:
            pass
    if libc is not None:
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # keeps /proc/self/fd readable after the uid drop
        libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # set after the uid drop, which clears it
        if os.getppid() != job["parent_pid"]:
            os._exit(1)
        if ruleset is not None:  # needs no_new_privs; applies to this thread and all it starts
            import ctypes
            if libc.syscall(_SYS_LANDLOCK_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) == 0:
                layers.append("landlock v%d" % abi)
            os.close(ruleset)
        if _install_seccomp(libc, limits["max_processes"] > 0):
            layers.append("seccomp")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # a later `import ctypes` then meets the audit hook
    if _posixsubprocess is not None:
        _posixsubprocess.fork_exec = _make_fork_exec_stub(_posixsubprocess.fork_exec)
    os.chdir(work)
    return layers, read_roots


def _private_read_only_root(libc, layers):
    """In the new mount namespace: stop propagation to the host (nothing is mounted otherwise),
    then make every mount read-only, recursively (mount_setattr, Linux >= 5.12). Mounts made
    after this (the working directory's tmpfs) stay writable."""
    import ctypes
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    attr = struct.pack("=QQQQ", 1 | 2, 0, 0, 0)  # MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID
    if libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(-100), b"/", ctypes.c_uint(0x8000),  # AT_FDCWD,
                    attr, ctypes.c_size_t(len(attr))) == 0:                                # AT_RECURSIVE
        layers.append("read-only root")
    return True


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
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # variadic: pass full words
        libc.syscall.restype = ctypes.c_long
        return libc
    except (ImportError, OSError, AttributeError):
        return None


def _install_seccomp(libc, allow_processes):
    """Kernel-enforced refusals (see ``_X86_64_DENY``); returns whether the filter is active.

    Threads stay possible: clone is allowed with CLONE_THREAD only, and clone3 (whose flags a
    filter cannot read) answers ENOSYS so that glibc falls back to clone. kill/tgkill may only
    target this process, sockets may only be AF_UNIX stream ones (asyncio's self-pipe)."""
    import ctypes
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return False
    LD, JEQ, JGE, JSET, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
    NR, ARCH, ARG0, ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (little endian)
    me = os.getpid()
    prog = [(LD, 0, 0, ARCH), (JEQ, 1, 0, _AUDIT_ARCH_X86_64), (RET, 0, 0, KILL),
            (LD, 0, 0, NR), (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # no x32 ABI
    deny = dict(_X86_64_DENY)
    if not allow_processes:
        deny.update(_X86_64_PROCESS)
    for nr in deny.values():
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, _X86_64_CLONE3), (RET, 0, 0, ENOSYS)]
    if not allow_processes:  # clone without CLONE_THREAD is a new process
        prog += [(JEQ, 0, 4, _X86_64_CLONE), (LD, 0, 0, ARG0), (JSET, 0, 1, 0x00010000),
                 (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    for nr in (_X86_64_KILL, _X86_64_TGKILL):  # first argument: the target pid / tgid
        prog += [(JEQ, 0, 4, nr), (LD, 0, 0, ARG0), (JEQ, 0, 1, me),
                 (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    for nr in (_X86_64_SOCKET, _X86_64_SOCKETPAIR):  # AF_UNIX (1), SOCK_STREAM (1)
        prog += [(JEQ, 0, 7, nr), (LD, 0, 0, ARG0), (JEQ, 0, 4, 1), (LD, 0, 0, ARG1),
                 (AND, 0, 0, 0xF), (JEQ, 0, 1, 1), (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    prog.append((RET, 0, 0, ALLOW))

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    return libc.prctl(_PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0) == 0


def _mount_tmpfs_and_stdlib(libc, work, lib, uid, limits, stdlib, layers, read_roots):
    """Inside the new, private mount namespace: tmpfs over ``work`` and the stdlib under ``lib``;
    returns whether the stdlib was moved there."""
    def mount(src, target, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
            raise OSError("mount %s failed" % target)

    owner = "" if uid is None else ",uid=%d,gid=%d" % (uid, uid)
    try:
        mount("pace-sandbox", work, "tmpfs", _MS_NOSUID | _MS_NODEV,
              "size=%dm,mode=0700%s" % (limits["max_disk_mb"], owner))
        layers.append("tmpfs")
    except OSError:
        pass
    if uid is None or all(_readable_by_others(p) for p in stdlib):
        return False
    try:
        mount("pace-sandbox-lib", lib, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=0755")
        moved = {}
        for k, src in enumerate(stdlib):
            target = "%s/%d" % (lib, k)
            if os.path.isdir(src):
                os.mkdir(target)
            else:
                open(target, "wb").close()
            mount(src, target, None, _MS_BIND)
            try:
                mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            except OSError:
                pass
            moved[src] = target
    except OSError:
        return False

    def rehome(path):
        for src, target in moved.items():
            if path == src or path.startswith(src + "/"):
                return target + path[len(src):]
        return path

    sys.path[:] = [rehome(p) for p in sys.path if p in moved]
    sys.path_importer_cache.clear()
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if type(search) is list:
            search[:] = [rehome(p) for p in search]
    read_roots[:0] = list(moved.values())
    layers.append("stdlib bind mounts")
    return True


def _readable_by_others(path):
    """Whether a process with an unrelated uid can reach and read ``path``."""
    try:
        st = os.stat(path)
        if os.path.isdir(path) and st.st_mode & 0o005 != 0o005:
            return False
        if not os.path.isdir(path) and not st.st_mode & 0o004:
            return False
        parent = os.path.dirname(path)
        while parent and parent != "/":
            if not os.stat(parent).st_mode & 0o001:
                return False
            parent = os.path.dirname(parent)
        return True
    except OSError:
        return False


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


def _install_audit_hook(work, read_roots, allow_processes, report):
    """Refuse network, process creation, signals, foreign calls, harness frames and file changes
    outside ``work``: a second layer behind the OS walls of ``_confine``, which hold even where
    this hook is fooled (C code such as SQLite opens files without an audit event).

    Reads are allowed inside ``work`` and the standard library only. The hook cannot be removed
    once added. Each refusal raises PermissionError in the program, and first lowers the hard
    RLIMIT_LOCKS by one: the parent reads that counter between calls and scores the call during
    which it dropped as an error, even if the program caught the exception. A hard limit cannot
    be raised again, so the program can make the count go down (only against itself) but never
    back up. The refusal is also reported on the pipe, which gives the parent its name."""
    _type, _str, _bytes, _int, _len, _tuple = type, str, bytes, int, len, tuple
    _PermissionError, _Exception, _getattr = PermissionError, Exception, getattr
    getcwd, readlink, collapse = os.getcwd, os.readlink, _collapse
    getrlimit, setrlimit, exit_, get_ident = resource.getrlimit, resource.setrlimit, os._exit, _thread.get_ident
    harness_globals, frame_attrs = globals(), _FRAME_ATTRS
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    default_dir_fds = (None, -1, -100)  # -100: AT_FDCWD
    denied_events, denied_prefixes = _DENIED_EVENTS, _DENIED_PREFIXES
    process_events, fast_allow = _PROCESS_EVENTS, _FAST_ALLOW
    blocked_imports, blocked_import_prefixes = _BLOCKED_IMPORTS, _BLOCKED_IMPORT_PREFIXES
    work = _normalize(work)
    work_roots = (work,)
    read_roots = tuple(_normalize(r) for r in read_roots) + work_roots
    # event -> position of its dir_fd argument (shutil.* are checked through the os.* they call)
    mutating = {"os.remove": -1, "os.rmdir": -1, "os.mkdir": -1, "os.chmod": -1, "os.chown": -1,
                "os.utime": -1, "os.truncate": None}
    writes, reports, inside = [0], [0], set()

    def deny(event):
        try:
            hard = getrlimit(RLIMIT_LOCKS)[1]
            setrlimit(RLIMIT_LOCKS, (hard - 1, hard - 1))
        except _Exception:  # noqa: BLE001 - the counter is spent or gone: stop the run here
            exit_(3)
        if reports[0] < 64:  # the counter counts them all; the names of the first few suffice
            reports[0] += 1
            report({"violation": event[:100]})
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

    def fd_path(fd):
        if _type(fd) is not _int:
            return None
        try:
            return readlink("/proc/self/fd/%d" % fd)
        except _Exception:  # noqa: BLE001
            return None

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
        if event in fast_allow:
            return
        if event == "object.__getattr__":
            if args[1] in frame_attrs and get_ident() not in inside and harness_frame(frame_of(args[0], args[1])):
                deny("reading a harness frame (%s)" % args[1])
        elif event == "sys._getframe":
            if harness_frame(args[0]):
                deny("sys._getframe reaching a harness frame")
        elif event == "resource.setrlimit" and args[0] == RLIMIT_LOCKS:
            new = args[1]
            if not (_type(new) is _tuple and _len(new) == 2 and _type(new[1]) is _int
                    and new[1] < getrlimit(RLIMIT_LOCKS)[1]):
                deny(event + " raising the violation counter")
        elif event == "open":
            check_open(event, args[0], args[1], args[2])
        elif event == "import":
            name = args[0]
            top = name.partition(".")[0] if _type(name) is _str else ""
            if top in blocked_imports or top.startswith(blocked_import_prefixes):
                deny("import " + top)
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
            if not (event == "socket.__new__" and _len(args) > 1 and args[1] == 1):
                deny(event)  # only AF_UNIX socket pairs (asyncio's self-pipe) may be created
        elif event == "sqlite3.connect":
            db = args[0]
            if db not in (":memory:", "", b":memory:", b"") and not under(db, work_roots):
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
