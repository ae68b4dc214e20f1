"""The tool sandbox's server: the program that runs inside the isolation (`python server.py serve|once`).

Standard library only, and light at the top: whatever this file imports is inherited by every
sandboxed process (the server forks them). The client (`client.py`) starts it under the isolation
that `isolation.py` builds and talks to it over a Unix socket; nothing here trusts a request for
more than the code (or query) to run.

Shape of one call (docs/sandbox.md):

    zygote (PID 1 of the sandbox's namespace; its configuration is fixed at start)
      └─ handler: one per connection, checks the peer, enters a fresh user, mount, PID, IPC and
         network namespace, mounts the call's size-limited tmpfs on the work directory and an empty
         one on /proc, drops every capability
           └─ init (PID 1 of the call): keeps the CPU limit, reaps, reports the code's exit status
              and CPU time; when it ends, the kernel ends every process of the call
                └─ the sandboxed process: rlimits, empty environment, audit hook, runs the code

The handler answers with a status decided here, from what the kernel says (exit status, signal, CPU
time), the server's own clock and byte counts, and audit-hook notes signed with a key the code never
sees; never from what the code prints.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import linecache
import math
import os
import resource
import select
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
import types

# modules the server imports up front: sandboxed code gets them without an import (forked, warm)
PRELOAD = ("bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools", "heapq",
           "itertools", "json", "math", "numbers", "operator", "random", "re", "statistics", "string", "textwrap",
           "typing")
# the audit hook's import rules: a name (any dotted part of an import, or the file an extension module
# is loaded from) and why it is refused
DENIED_IMPORTS = {
    **dict.fromkeys(("ctypes", "_ctypes"), "ctypes is disabled in the sandbox"),
    **dict.fromkeys(("_posixsubprocess", "subprocess", "_multiprocessing", "_posixshmem"),
                    "starting processes is disabled in the sandbox"),
    **dict.fromkeys(("_sqlite3", "sqlite3", "_dbm", "_gdbm"), "database modules are disabled in the sandbox"),
    **dict.fromkeys(("_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testclinic",
                     "_testimportmultiple", "_testsinglephase", "_xxsubinterpreters", "_xxinterpchannels",
                     "_xxtestfuzz", "_ctypes_test", "xxsubtype", "_tkinter", "readline", "posix", "_signal",
                     "_socket", "_io", "builtins", "sys", "_imp"), "this module is disabled in the sandbox"),
}
# never present in a sandboxed process (popped from sys.modules; the hook refuses importing them)
DENIED_MODULES = ("_ctypes", "ctypes", "_posixsubprocess", "subprocess", "_multiprocessing", "_posixshmem",
                  "_sqlite3", "sqlite3", "_dbm", "_gdbm")
EXIT_MEMORY = 101  # the code ended on MemoryError (or ENOMEM)
EXIT_SETUP = 102  # the sandbox failed before running the code
EXIT_FILE_SIZE = 103  # the code ended on EFBIG: a file reached RLIMIT_FSIZE
EXIT_DISK = 104  # the code ended on ENOSPC: its tmpfs is full (bytes or files)
_EXIT_FOR_ERRNO = {errno.ENOMEM: EXIT_MEMORY, errno.EFBIG: EXIT_FILE_SIZE, errno.ENOSPC: EXIT_DISK,
                   errno.EDQUOT: EXIT_DISK}
NOTES_CAP = 4096
CPU_BACKSTOP = 3  # RLIMIT_CPU at this many times the CPU limit (+1 s): CpuWatch keeps the limit itself
CPU_POLL_S = 0.005  # CpuWatch looks at least this far apart
MAX_REQUEST = 64 << 20
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_EXTRA_READ_ROOTS = ("/dev/null", "/dev/urandom", "/dev/zero", "/usr/share/zoneinfo")

# Linux constants (sched.h, mount.h, prctl.h, capability.h)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = \
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
CALL_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 28, 38
SECURE_ALL = 0x3F  # noroot, no_setuid_fixup, keep_caps_locked and their locks: uid 0 never regains capabilities
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


# ---------------------------------------------------------------------------------------------------
# The kernel: namespaces, mounts, capabilities, dumpability (ctypes on libc: os.unshare is 3.12+)
# ---------------------------------------------------------------------------------------------------

_kernel: list = []  # [libc] once loaded (ctypes stays out of sandboxed processes: see _child)


def _libc():
    if not _kernel:
        import ctypes

        _kernel.append(ctypes.CDLL(None, use_errno=True))
    return _kernel[0]


def _call(name: str, *args) -> None:
    import ctypes

    if getattr(_libc(), name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    _call("prctl", option, value, 0, 0, 0)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _call("mount", enc(source), enc(target), enc(fstype), flags, enc(data))


def _drop_capabilities() -> None:
    """No capability in any set (the handler has them all in its fresh user namespace)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _call("capset", header, data)


def non_dumpable() -> None:
    """Neither a core dump nor /proc/<pid>/{fd,mem,environ} nor ptrace for processes of the same uid
    without CAP_SYS_PTRACE in this process's user namespace: one call cannot open another's
    descriptors or memory. Inherited by every fork (the zygote sets it for all it forks)."""
    _prctl(PR_SET_DUMPABLE, 0)


def enter_call_namespaces(work: str, lim: dict) -> None:
    """Move this process (a disposable handler) into fresh user, mount, PID, IPC and network namespaces,
    so that what one call does cannot reach another: its processes live in their own PID namespace
    (all killed when its init ends), its files on its own size-limited tmpfs mounted on `work` (gone
    when the call's last process ends), /proc is an empty read-only tmpfs (no view of any other
    process's descriptors), and it has no SysV/POSIX IPC objects or sockets (abstract ones included)
    shared with anyone. Then every capability is dropped, and uid 0 (weaker isolation levels run as a
    mapped root) never regains them."""
    uid, gid = os.getuid(), os.getgid()
    _call("unshare", CALL_NAMESPACES)
    _prctl(PR_SET_DUMPABLE, 1)  # while non-dumpable, /proc/self/*_map belong to root: not writable
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    finally:
        non_dumpable()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={lim['disk_kb']}k,nr_inodes={lim['max_files'] + 1},mode=0700")
    _mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=2,mode=0555")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    try:
        _prctl(PR_SET_SECUREBITS, SECURE_ALL)
    except OSError:
        pass  # already locked by the caller's isolation
    _drop_capabilities()


def _percall_self_test(work: str, lim: dict) -> str:
    """'' if per-call namespaces work here (tried in a throwaway child), else why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        why = b""
        try:
            enter_call_namespaces(work, lim)
        except BaseException as e:  # noqa: BLE001 - any failure means: not available
            why = f"{type(e).__name__}: {e}".encode()[:500]
        os.write(w, why)
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------------
# The sandboxed process
# ---------------------------------------------------------------------------------------------------

def _norm(path, cwd, _isinstance=isinstance, _str=str, _bytes=bytes, _join="".join, _decode=bytes.decode):
    """(absolute normalised path, whether it had a '..' part) of a path argument, by text alone: the
    sandbox cannot create links, so inside the work directory text is the truth. Builtins come in as
    default arguments: sandboxed code can rebind module globals, not these (setting __defaults__ is
    denied). A str subclass is copied to a plain str, so overridden methods never run here."""
    if _isinstance(path, _str):
        p = _join((path,))
    elif _isinstance(path, _bytes):
        p = _decode(path, "utf-8", "surrogateescape")
    else:
        raise TypeError("path")
    if p[:1] != "/":
        p = cwd + "/" + p
    raw = p.split("/")
    parts = []
    for seg in raw:
        if seg == "..":
            if parts:
                parts.pop()
        elif seg and seg != ".":
            parts.append(seg)
    return "/" + "/".join(parts), ".." in raw


def _hook_factory(workdir: str, read_roots: tuple[str, ...], notes_fd: int, pid: int, max_files: int, key: str):
    """The audit hook of a sandboxed process. Sys.addaudithook hooks cannot be removed; everything the
    hook uses is a default argument or a constant of its code (immutable from inside), it fails closed
    (an unexpected error blocks the event) and it writes each block's reason to the notes pipe,
    signed with `key`: the hook function is reachable from nowhere in the process (only the
    interpreter's hook list holds it), so code writing to the pipe itself cannot sign a note."""

    def hook(event, args, _wd=workdir, _wd_in=workdir + "/", _roots=read_roots, _fd=notes_fd, _pid=pid,
             _made=[0], _max=max_files, _norm=_norm, _write=os.write, _getcwd=os.getcwd, _stat=os.stat,
             _isinstance=isinstance, _int=int, _str=str, _join="".join, _encode=str.encode, _wf=_WRITE_FLAGS,
             _creat=os.O_CREAT, _Error=PermissionError, _Exception=Exception, _OSError=OSError, _any=any,
             _denied=DENIED_IMPORTS, _key=key + " ", _basename=os.path.basename):
        if event in {"exec", "compile", "object.__getattr__", "sys._getframe", "builtins.id", "time.sleep"}:
            return  # the frequent harmless ones first
        why = None
        try:
            if event == "open" or event in {"os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.utime",
                                            "os.setxattr", "os.removexattr", "os.rename", "os.chdir",
                                            "os.listdir", "os.scandir"}:
                path = args[0]
                writes = True
                if event == "open":
                    writes = not _isinstance(args[2], _int) or (args[2] & _wf) != 0
                elif event in {"os.chdir", "os.listdir", "os.scandir"}:
                    writes = False
                if path is None or _isinstance(path, _int):  # an open descriptor (or listdir())
                    if event == "os.chdir":
                        why = "changing directory by descriptor is blocked in the sandbox"
                else:
                    p, up = _norm(path, _getcwd())
                    inside = p.startswith(_wd_in)
                    if writes:
                        if not inside or up:
                            why = "writing outside the work directory is blocked in the sandbox"
                        elif event == "os.rename":
                            q, up2 = _norm(args[1], _getcwd())
                            if not q.startswith(_wd_in) or up2:
                                why = "writing outside the work directory is blocked in the sandbox"
                        elif event == "os.mkdir" or (event == "open" and args[2] & _creat):
                            _made[0] += 1
                            if _made[0] > _max:
                                why = "too many files created in the sandbox"
                            elif event == "os.mkdir" and (args[1] & 0o700) != 0o700:
                                why = "directories must stay owner-accessible in the sandbox"
                    elif not inside and p != _wd:
                        if event == "os.chdir":
                            why = "leaving the work directory is blocked in the sandbox"
                        elif not _any([p == r or p.startswith(r + "/") for r in _roots]):
                            why = "reading outside the work directory is blocked in the sandbox"
                        elif event == "open":
                            try:  # a directory descriptor would let dir_fd= writes escape
                                isdir = (_stat(p).st_mode & 0o170000) == 0o040000
                            except _OSError:
                                isdir = False
                            if isdir:
                                why = "opening directories outside the work directory is blocked in the sandbox"
            elif event.startswith(("socket.", "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                                   "nntplib.", "telnetlib.", "webbrowser.", "ssl.")):
                why = "network is disabled in the sandbox"
            elif event in {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                           "subprocess.Popen", "pty.spawn", "os.startfile"}:
                why = "starting processes is disabled in the sandbox"
            elif event in {"os.kill", "os.killpg", "signal.pthread_kill"}:
                if not (event == "os.kill" and args[0] == _pid):
                    why = "signals to other processes are blocked in the sandbox"
            elif event in {"os.link", "os.symlink"}:
                why = "links are blocked in the sandbox"
            elif event in {"os.chmod", "os.chown", "os.lchmod", "os.lchown", "os.chflags", "os.lchflags"}:
                why = "changing file permissions is blocked in the sandbox"
            elif event == "import":
                # every dotted part, and the file an extension module comes from: _imp.create_dynamic
                # (ModuleSpec("x._posixsubprocess", ...)) loads an extension under any package name
                parts = _join((args[0],)).split(".")
                if _isinstance(args[1], _str):
                    parts.append(_basename(_join((args[1],))).split(".")[0])
                for part in parts:
                    if part in _denied:
                        why = _denied[part]
                        break
            elif event.startswith("ctypes."):
                why = "ctypes is disabled in the sandbox"
            elif event in {"sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects",
                           "gc.get_referrers", "gc.get_referents"}:
                why = "tracing and gc introspection are disabled in the sandbox"
            elif event in {"code.__new__", "marshal.loads", "marshal.load"}:
                why = "building code objects is disabled in the sandbox"
            elif event in {"object.__setattr__", "object.__delattr__"}:
                if _join((args[1],)) in {"__code__", "__defaults__", "__kwdefaults__"}:
                    why = "changing function code is blocked in the sandbox"
            elif event == "sys.addaudithook":
                why = "the sandbox's audit hook cannot be changed"
            elif event in {"resource.setrlimit", "resource.prlimit"}:
                why = "resource limits cannot be changed in the sandbox"
            elif event.startswith("syslog."):
                why = "syslog is disabled in the sandbox"
        except _Exception:
            why = "operation blocked by the sandbox"
        if why is not None:
            try:
                _write(_fd, _encode(_key + why + "\n"))
            except _Exception:
                pass
            raise _Error(why)

    return hook


def _fd_above(fd: int, low: int = 16) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)


def _open_fds() -> list[int]:
    """This process's open descriptors (read while /proc is still this process's own)."""
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def _close_except(fds, keep: set[int]) -> None:
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _sql_runner(spec: dict):
    """A read-only SQLite query prepared before the audit hook goes in (sqlite3 is trusted code; the
    query is data): the database deserialised into memory, locked down by the trainer's policy
    (`spec`: db as base64, query, max_rows, limits {sqlite limit id: value}, allowed authoriser
    actions, denied functions, vm_steps). Running it prints one JSON line: {"cols", "rows", "more"}
    (blobs as {"blob": hex}) or {"error", "denied"|"interrupted"}."""
    import base64
    import sqlite3

    con = sqlite3.connect(":memory:")
    con.deserialize(base64.b64decode(spec["db"]))
    con.execute("PRAGMA query_only = ON")
    con.execute("PRAGMA temp_store = MEMORY")
    for limit, value in spec["limits"].items():
        con.setlimit(int(limit), int(value))
    allowed, denied_fns, state = set(spec["allowed"]), set(spec["denied_functions"]), {"why": "", "ticks": 0}

    def authorize(action, arg1, arg2, db_name, trigger):
        if action in allowed and not (action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in denied_fns):
            return sqlite3.SQLITE_OK
        state["why"] = (f"function {arg2}() is not allowed" if action == sqlite3.SQLITE_FUNCTION
                        else "only SELECT queries are allowed")
        return sqlite3.SQLITE_DENY

    def progress():
        state["ticks"] += 1
        return int(state["ticks"] * 1000 > spec["vm_steps"])

    con.set_authorizer(authorize)
    con.set_progress_handler(progress, 1000)

    def run() -> None:
        try:
            cur = con.execute(spec["query"])
            rows = cur.fetchmany(spec["max_rows"] + 1)
            cols = [d[0] for d in cur.description or ()]
            out = {"cols": cols, "rows": [[{"blob": v.hex()} if isinstance(v, bytes) else v for v in r]
                                          for r in rows[:spec["max_rows"]]], "more": len(rows) > spec["max_rows"]}
        except sqlite3.Error as e:
            msg = str(e).rstrip(".")
            out = {"error": msg, "denied": state["why"] if "authoriz" in msg else "",
                   "interrupted": "interrupted" in msg}
        except (ValueError, OverflowError, UnicodeError) as e:  # NUL characters, surrogates, ...
            out = {"error": f"cannot run this query ({type(e).__name__})", "denied": "", "interrupted": False}
        sys.stdout.write(json.dumps(out) + "\n")

    return run


def _exit_status_of(e: BaseException) -> int:
    """The exit status the bootstrap gives an exception the code did not catch."""
    if isinstance(e, MemoryError):
        return EXIT_MEMORY
    if isinstance(e, OSError) and e.errno in _EXIT_FOR_ERRNO:
        return _EXIT_FOR_ERRNO[e.errno]
    return 1


def _tripwires() -> None:
    """Python-level tripwires set with the audit hook (not a boundary: the operating system is).

    No builtin module can be created afresh (every allowed one is preloaded by the server): a fresh
    `posix` from _imp.create_builtin, which is not audited, would have the calls deleted below again.
    Those calls are not audited and could signal processes or make special files (within the call's
    namespaces and tmpfs, where those exist)."""
    import _imp

    if hasattr(_imp, "create_builtin"):
        del _imp.create_builtin
    unaudited = ("pidfd_open", "mkfifo", "mknod")
    for mod, names in ((os, unaudited), (sys.modules["posix"], unaudited), (signal, ("pidfd_send_signal",)),
                       (sys.modules["_signal"], ("pidfd_send_signal",))):
        for n in names:
            if hasattr(mod, n):
                delattr(mod, n)


def _child(job: dict, lim: dict, workdir: str, fds: list[int], out_w: int, err_w: int, note_w: int,
           read_roots: tuple[str, ...], audit_hook: bool):
    """The sandboxed process: lock itself down, run the job's code (or query), _exit. Never returns."""
    os.setsid()  # its own process group: without call namespaces the server kills the whole group
    # fds 0-3 := /dev/null, stdout pipe, stderr pipe, notes pipe; everything else (server sockets) closed
    null = os.open("/dev/null", os.O_RDONLY)
    srcs = [_fd_above(null), _fd_above(out_w), _fd_above(err_w), _fd_above(note_w)]
    for target, src in enumerate(srcs):
        os.dup2(src, target)
    _close_except(set(fds) | set(srcs) | {null, out_w, err_w, note_w}, {0, 1, 2, 3})
    os.chdir(workdir)
    mb = lim["memory_mb"] << 20
    cpu = CPU_BACKSTOP * lim["cpu_s"] + 1  # only a backstop: the limit is CpuWatch's (see there)
    for res, soft, hard in ((resource.RLIMIT_AS, mb, mb), (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, lim["file_size_kb"] << 10, lim["file_size_kb"] << 10),
                            (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
                            (resource.RLIMIT_NPROC, lim["processes"], lim["processes"]), (resource.RLIMIT_CORE, 0, 0)):
        cur = resource.getrlimit(res)[1]  # never above the inherited hard limit (raising it would fail)
        hard = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(res, (min(soft, hard), hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write then fails with EFBIG, which it can report
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.alarm(int(math.ceil(lim["wall_s"])) + 2)  # backstop should the server die before killing it
    os.environ.clear()
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    tempfile.tempdir = workdir
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", line_buffering=True)
    sys.argv = ["<sandbox>"]
    sys.path = [p for p in sys.path if p]
    sys.dont_write_bytecode = True
    sys.pycache_prefix = "/dev/null/pycache"  # never read .pyc files: marshal.loads is denied
    for name in [m for m in sys.modules if m.partition(".")[0] in DENIED_MODULES]:
        del sys.modules[name]
    _kernel.clear()  # the server's libc handle
    if audit_hook:  # Python-level tripwires, with the hook (without, the operating system alone holds)
        _tripwires()
    if "random" in sys.modules:
        sys.modules["random"].seed(0)  # the server's random state is shared by all forks: make it fixed
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    code = job.get("code", "")
    linecache.cache["<sandbox>"] = (len(code), None, code.splitlines(True), "<sandbox>")
    runner = _sql_runner(job["sql"]) if "sql" in job else None
    if audit_hook:  # defence in depth: the boundary is the operating system's (see isolation.py)
        key = os.urandom(16).hex()
        os.write(3, key.encode() + b"\n")  # the first line of the notes pipe, before any code runs
        sys.addaudithook(_hook_factory(workdir, read_roots, 3, os.getpid(), lim["max_files"], key))
        del key  # held only by the hook's defaults from here on
    status = 0
    try:
        if runner is not None:
            runner()
        else:
            exec(compile(code, "<sandbox>", "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        status = _exit_status_of(e)
        try:
            _print_exception(e)
        except BaseException:
            try:
                sys.stderr.write(f"{type(e).__name__}\n")
            except BaseException:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status & 0xFF)


def _print_exception(e: BaseException) -> None:
    """The traceback as `python file.py` would print it, without the sandbox's own frames (this
    bootstrap, the audit hook)."""
    # lookup_lines=False: source lines are read only for the frames kept (reading this file is denied)
    te = traceback.TracebackException(type(e), e, e.__traceback__, lookup_lines=False, compact=True)
    seen, t = set(), te
    while t is not None and id(t) not in seen:
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != __file__])
        t = t.__cause__ or t.__context__
    sys.stderr.write("".join(te.format()))


class CpuWatch:
    """The code's CPU limit, kept by the process that started it. The kernel's RLIMIT_CPU counts CPU
    time in scheduler ticks, and under load a busy process is charged whole ticks it shared with
    processes that woke and slept between them: measured on a 2-core host beside such processes, a
    `while True: pass` was stopped by RLIMIT_CPU = 2 s after 1.16 s of CPU. The limit, and the status
    (the CPU time reported is the scheduler's exact one), would then depend on the host's load. The
    process's CPU clock (clock_getcpuclockid) is the scheduler's exact runtime of all its threads, so
    the limit is checked on it; RLIMIT_CPU stays as a backstop at CPU_BACKSTOP times the limit."""

    def __init__(self, pid: int, cpu_s: float):
        self.clock = (~pid << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED): clock_getcpuclockid(pid)
        self.limit = cpu_s
        self.cores = max(1, len(os.sched_getaffinity(0)))  # its threads can use at most these at once

    def check(self) -> float | None:
        """None once the process has used its CPU time, else the seconds it needs at the least to
        get there (every core busy): when to look again."""
        try:
            used = time.clock_gettime(self.clock)
        except OSError:  # reaped already: its exit is being handled
            return 1.0
        return None if used >= self.limit else max(CPU_POLL_S, (self.limit - used) / self.cores)


_STATUS = struct.Struct("=i?dd")  # the code's wait status, whether CpuWatch stopped it, user and system CPU seconds


def _init(run_child, fds: list[int], status_w: int, cpu_s: float) -> None:
    """PID 1 of the call's PID namespace: start the sandboxed process, keep its CPU limit, reap every
    process of the call, report the sandboxed process's exit status and CPU time on `status_w`, exit.
    The kernel then kills whatever else of the call still runs (PID 1 ending ends its namespace)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the handler gone: the call ends with it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # kept pending, for sigtimedwait below
    code_pid = os.fork()
    if code_pid == 0:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            run_child()
        finally:
            os._exit(EXIT_SETUP)
    _close_except(fds, {status_w})
    watch, over = CpuWatch(code_pid, cpu_s), False
    while True:
        try:
            pid, status, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        if pid == code_pid:
            break
        if pid:
            continue  # an orphan of the call reaped: there may be more
        wait = 1.0 if over else watch.check()
        if wait is None:
            os.kill(code_pid, signal.SIGKILL)
            over = True
            continue
        signal.sigtimedwait({signal.SIGCHLD}, wait)  # a child's exit wakes it at once
    os.write(status_w, _STATUS.pack(status, over, ru.ru_utime, ru.ru_stime))
    os._exit(0)


# ---------------------------------------------------------------------------------------------------
# The handler: one call, decided by the server
# ---------------------------------------------------------------------------------------------------

def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _rmtree(path: str) -> None:
    import shutil

    def fix(func, p, exc):  # a directory made without permissions (root needs none)
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def signed_note(notes: str) -> str:
    """The first reason the audit hook signed (the pipe's first line is the key), or ''. Lines the
    code wrote to the pipe itself carry no key and are ignored."""
    lines = notes.split("\n")
    key = lines[0]
    if len(key) != 32:
        return ""
    for line in lines[1:]:
        if line.startswith(key + " "):
            return line[len(key) + 1:]
    return ""


def classify(lim: dict, reason: str | None, status: int, cpu: float, err: str, note: str) -> tuple[str, str | None]:
    """(status, error) of a call from what the server saw: its own stop reason (wall clock, output
    cap), the kernel's wait status and CPU time, and the hook's signed note. The code's stderr is
    only the text of an `error` (its own last line), never a status."""
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    if reason == "output":
        return "output", f"output truncated at {lim['output_bytes']} bytes"
    if reason == "timeout":
        return "timeout", f"timed out after {lim['wall_s']:g} s (wall)"
    # CpuWatch's stop, or the RLIMIT_CPU backstop's SIGXCPU (soft) or SIGKILL (hard), told from a
    # signal the code sent itself by the CPU time the kernel counted
    if reason == "cpu" or (sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= lim["cpu_s"]):
        return "cpu", f"CPU time limit {lim['cpu_s']} s exceeded"
    if note:
        return "denied", note
    if code == EXIT_MEMORY:
        return "memory", f"memory limit {lim['memory_mb']} MiB exceeded"
    if code == EXIT_FILE_SIZE:
        return "file_size", f"file size limit {lim['file_size_kb']} KiB exceeded"
    if code == EXIT_DISK:
        return "disk", f"disk limit {lim['disk_kb']} KiB or {lim['max_files']} files exceeded"
    if sig == signal.SIGALRM:
        return "timeout", f"timed out after {lim['wall_s']:g} s (wall)"
    if sig is not None:
        return "crash", f"crashed with signal {signal.Signals(sig).name}"
    if code == EXIT_SETUP:
        return "sandbox", "sandbox setup failed"
    if code:
        return "error", last_line(err) or f"exit status {code}"
    return "ok", None


class _Output:
    """The sandboxed process's pipes (stdout, stderr, notes), each kept up to its cap."""

    def __init__(self, fds: list[int], caps: list[int]):
        self.fds, self.caps = fds, dict(zip(fds, caps))
        self.bufs = {fd: bytearray() for fd in fds}
        self.live = set(fds)
        self.overflow = False  # stdout or stderr went past its cap

    def read(self, fd: int) -> None:
        data = os.read(fd, 65536)
        if not data:
            self.live.discard(fd)
            return
        room = self.caps[fd] - len(self.bufs[fd])
        self.bufs[fd] += data[: max(room, 0)]
        if len(data) > room and fd != self.fds[-1]:
            self.overflow = True

    def text(self) -> list[str]:
        return [self.bufs[fd].decode("utf-8", "replace") for fd in self.fds]


def handle(job: dict, cfg: dict, percall: bool) -> dict:
    """One call, in this (disposable) process: run the job under the configuration's limits, collect
    its output, end every process it started, and decide its status."""
    lim, read_roots = cfg["limits"], tuple(cfg["read_roots"])
    fds = _open_fds()
    if percall:
        workdir = cfg["work_root"]
        enter_call_namespaces(workdir, lim)
    else:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="run-", dir=cfg["work_root"]))
    pipes = [os.pipe() for _ in range(4)]  # stdout, stderr, notes, the init's report
    fds += [fd for pair in pipes for fd in pair]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores SIGCHLD; this process must reap

    def run_child():
        _child(job, lim, workdir, fds, pipes[0][1], pipes[1][1], pipes[2][1], read_roots, cfg["hook"])

    t0 = time.monotonic()
    pid = os.fork()  # per call: the call's init; otherwise the sandboxed process itself
    if pid == 0:
        try:
            _init(run_child, fds, pipes[3][1], lim["cpu_s"]) if percall else run_child()
        finally:
            os._exit(EXIT_SETUP)
    for _, w in pipes:
        os.close(w)
    try:
        pidfd = os.pidfd_open(pid)  # readable when the child exits (Linux >= 5.3)
    except (AttributeError, OSError):
        pidfd = None
    out = _Output([r for r, _ in pipes[:3]], [lim["output_bytes"], lim["output_bytes"], NOTES_CAP])
    deadline, reason, exited = t0 + lim["wall_s"], None, False
    cpu_watch = None if percall else CpuWatch(pid, lim["cpu_s"])  # per call, the init keeps the limit
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        wait = left if cpu_watch is None else cpu_watch.check()
        if wait is None:
            reason = "cpu"
            break
        wait = min(left, wait) if pidfd is not None else min(left, wait, 0.01)
        watch = sorted(out.live) + ([pidfd] if pidfd is not None else [])
        ready, _, _ = select.select(watch, [], [], wait)
        for fd in ready:
            if fd == pidfd:
                exited = True
            else:
                out.read(fd)
        if out.overflow:
            reason = "output"
            break
        if pidfd is None:
            exited = _exited(pid)
    # whatever happened, nothing the code started outlives the call: per call, the init's death ends
    # its PID namespace; otherwise the process group goes (a process that left it is not reached)
    os.kill(pid, signal.SIGKILL) if percall else _kill_group(pid)
    drain_until = time.monotonic() + 1.0  # what is still in the pipes (their writers are dead now)
    while out.live and time.monotonic() < drain_until:
        ready, _, _ = select.select(sorted(out.live), [], [], max(0.0, drain_until - time.monotonic()))
        for fd in ready:
            out.read(fd)
    if out.overflow and reason is None:
        reason = "output"
    _, status, ru = os.wait4(pid, 0)
    cpu = ru.ru_utime + ru.ru_stime
    if percall:
        report = os.read(pipes[3][0], _STATUS.size)
        if len(report) == _STATUS.size:  # the init saw the sandboxed process end
            status, over, utime, stime = _STATUS.unpack(report)
            cpu = utime + stime
            reason = reason or ("cpu" if over else None)
    duration = time.monotonic() - t0
    for fd in out.fds + [pipes[3][0]] + ([pidfd] if pidfd is not None else []):
        os.close(fd)
    if not percall:
        _rmtree(workdir)
    stdout, stderr, notes = out.text()
    kind, error = classify(lim, reason, status, cpu, stderr, signed_note(notes) if cfg["hook"] else "")
    return {"ok": kind == "ok", "stdout": stdout, "stderr": stderr, "error": error, "status": kind,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "duration_s": round(duration, 4), "cpu_s": round(cpu, 4)}


def _exited(pid: int) -> bool:
    try:  # WNOWAIT: the child stays a zombie, so its process group id cannot be reused before killpg
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _job(req: bytes, cfg: dict) -> dict:
    """The job a request asks for: only the code (or, for a SQL server, the database and the query);
    limits, the hook and the SQL policy are the server's configuration, whatever the request says."""
    msg = json.loads(req)
    if cfg.get("sql") is not None:
        q = msg["sql"]
        spec = {**cfg["sql"], "db": str(q["db"]), "query": str(q["query"]),
                "max_rows": max(0, min(int(q.get("max_rows", cfg["sql"]["max_rows"])), cfg["sql"]["max_rows"]))}
        return {"sql": spec}
    code = msg["code"]
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    return {"code": code}


def answer(req: bytes, cfg: dict, percall: bool) -> bytes:
    try:
        reply = handle(_job(req, cfg), cfg, percall)
    except Exception as e:  # a server-side failure is reported, never hangs the client
        reply = {"ok": False, "stdout": "", "stderr": "", "error": f"sandbox failed: {type(e).__name__}: {e}",
                 "status": "sandbox"}
    return json.dumps(reply).encode()


# ---------------------------------------------------------------------------------------------------
# The servers
# ---------------------------------------------------------------------------------------------------

def _read_roots() -> tuple[str, ...]:
    """Where sandboxed code may read besides its directory: the standard library and a few devices."""
    roots = set(_EXTRA_READ_ROOTS)
    for p in sys.path:
        if p:
            roots.update({_norm(p, "/")[0], os.path.realpath(p)})
    return tuple(sorted(roots))


def _prepare(cfg: dict) -> bool:
    """Preload modules, make this process non-dumpable, and find whether per-call namespaces work."""
    non_dumpable()
    cfg["read_roots"] = _read_roots()
    for name in PRELOAD:
        __import__(name)
    # every builtin module a sandboxed process may use exists before it runs: it cannot create one
    for name in sys.builtin_module_names:
        if name not in DENIED_IMPORTS:
            __import__(name)
    if cfg["percall"] == "off":
        return False
    why = _percall_self_test(cfg["work_root"], cfg["limits"])
    if why and cfg["percall"] == "require":
        sys.stdout.write(f"no per-call namespaces: {why}\n")
        sys.stdout.flush()
        os._exit(3)
    return not why


def _peer_allowed(conn: socket.socket, trainer_pid: int) -> bool:
    """Only the trainer may ask: a process of the sandbox (visible in this PID namespace, so its pid
    is not 0) is refused, whatever its uid."""
    try:
        pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
    except OSError:
        return False
    return pid == 0 or pid == trainer_pid


def serve(cfg: dict, listen_fd: int) -> None:
    """The zygote: fork one handler per connection; exit when the client's pipe (stdin) closes. The
    listening socket was bound by the client in a directory of its own, outside this view."""
    percall = _prepare(cfg)
    lst = socket.socket(fileno=listen_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers (and orphans, as PID 1) reap themselves
    sys.stdout.write(f"ready percall={int(percall)}\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([lst, 0], [], [])
        if 0 in ready and not os.read(0, 4096):
            break
        if lst not in ready:
            continue
        try:
            conn, _ = lst.accept()
        except OSError:
            continue
        if not _peer_allowed(conn, cfg["trainer_pid"]):
            conn.close()
            continue
        try:
            pid = os.fork()
        except OSError:
            conn.close()
            continue
        if pid == 0:
            rc = 1
            try:
                lst.close()
                conn.settimeout(30.0)
                chunks, size = [], 0
                while size <= MAX_REQUEST and (chunk := conn.recv(1 << 20)):
                    chunks.append(chunk)
                    size += len(chunk)
                conn.sendall(answer(b"".join(chunks), cfg, percall))
                conn.shutdown(socket.SHUT_RDWR)  # the client's EOF now, not after this process's teardown
                rc = 0
            finally:
                os._exit(rc)
        conn.close()


def once(cfg: dict) -> None:
    """Spawn mode: one request on stdin, its reply on stdout."""
    percall = _prepare(cfg)
    req = sys.stdin.buffer.read(MAX_REQUEST + 1)
    reply = answer(req, cfg, percall)
    sys.stdout.buffer.write(reply)
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(json.loads(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "once":
        once(json.loads(sys.argv[2]))
