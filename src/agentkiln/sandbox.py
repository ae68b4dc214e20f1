"""Run model-written Python code in a sandboxed process: `run_python(code, limits) -> SandboxResult`.

    res = run_python("print(sum(range(10)))")          # SandboxResult(ok=True, stdout="45\\n", ...)
    res = run_python("while True: pass")               # ok=False, status="cpu" or "timeout", error="..."

Every call runs in a fresh process that is a fork of a pre-started server (the "zygote", started on
first use, restarted if it dies), so a call costs a few milliseconds instead of a Python start-up.
The process gets wall-clock, CPU, memory, output, file-size, open-file and process limits, a private
temporary working directory (removed afterwards), an empty environment, no network and an audit hook
that blocks process creation, writes outside its directory, ctypes and interpreter introspection.
Where Linux user namespaces are available the server runs in its own user, network, PID and mount
namespaces (no network interface, no view of other processes). docs/sandbox.md lists precisely what
is and is not guaranteed: the audit hook is a tripwire for ordinary code, not a security boundary.

The file is also the server's program (`python sandbox.py serve|once`), so its top level imports
only light standard modules: anything imported here is inherited by every sandboxed process.
"""

from __future__ import annotations

import fcntl
import io
import json
import linecache
import math
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass

# modules the server imports up front: sandboxed code gets them without an import (forked, warm)
PRELOAD = ("bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools", "heapq",
           "itertools", "json", "math", "numbers", "operator", "random", "re", "statistics", "string", "textwrap",
           "typing")
# never present in a sandboxed process (the hook denies importing them; see _hook_factory)
DENIED_MODULES = ("_ctypes", "ctypes", "_posixsubprocess", "subprocess", "_multiprocessing", "_posixshmem",
                  "_sqlite3", "sqlite3", "_dbm", "_gdbm")
EXIT_MEMORY = 101  # the sandboxed code raised MemoryError
EXIT_SETUP = 102  # the sandbox failed before running the code
GRACE_S = 20.0  # the client waits this much longer than the wall limit (fork + clean-up on a loaded host)
NOTES_CAP = 4096
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_EXTRA_READ_ROOTS = ("/dev/null", "/dev/urandom", "/dev/zero", "/usr/share/zoneinfo")


@dataclass(frozen=True)
class Limits:
    wall_s: float = 2.0  # wall-clock seconds for the whole run
    cpu_s: int = 1  # CPU seconds (RLIMIT_CPU counts whole seconds)
    memory_mb: int = 256  # address space (RLIMIT_AS), MiB
    output_bytes: int = 8192  # per stream (stdout, stderr): more is cut off and the process killed
    file_size_kb: int = 1024  # largest file it may write (RLIMIT_FSIZE), KiB
    max_files: int = 64  # files and directories it may create
    open_files: int = 32  # RLIMIT_NOFILE
    processes: int = 64  # RLIMIT_NPROC: counts every process of the user (see docs/sandbox.md)

    def __post_init__(self) -> None:
        ranges = {"wall_s": (0.05, 600.0), "cpu_s": (1, 600), "memory_mb": (32, 65536), "output_bytes": (64, 1 << 26),
                  "file_size_kb": (1, 1 << 22), "max_files": (0, 1 << 20), "open_files": (8, 1 << 16),
                  "processes": (1, 1 << 22)}
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            kind = (int, float) if name == "wall_s" else int
            if isinstance(v, bool) or not isinstance(v, kind) or not lo <= v <= hi:
                raise ValueError(f"sandbox: limit {name} = {v!r}: must be a number in [{lo}, {hi}]")


@dataclass
class SandboxResult:
    ok: bool  # the code ran to the end (exit status 0), no limit was hit and nothing was blocked
    stdout: str  # at most Limits.output_bytes of it
    stderr: str
    error: str | None  # short reason when not ok: "timed out after 2 s (wall)", "ZeroDivisionError: ..."
    status: str  # ok | error | timeout | cpu | memory | output | file_size | denied | crash | sandbox
    exit_code: int | None = None  # None when killed by a signal
    signal: int | None = None
    duration_s: float = 0.0  # wall time of the sandboxed process, as measured by the server
    cpu_s: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Server side: runs in the zygote (`serve`) or a one-shot server (`once`), never in the caller.
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


def _hook_factory(workdir: str, read_roots: tuple[str, ...], notes_fd: int, pid: int, max_files: int):
    """The audit hook of a sandboxed process. Sys.addaudithook hooks cannot be removed; everything the
    hook uses is a default argument or a constant of its code (immutable from inside), it fails closed
    (an unexpected error blocks the event) and it writes each block's reason to the notes pipe."""

    def hook(event, args, _wd=workdir, _wd_in=workdir + "/", _roots=read_roots, _fd=notes_fd, _pid=pid,
             _made=[0], _max=max_files, _norm=_norm, _write=os.write, _getcwd=os.getcwd, _stat=os.stat,
             _isinstance=isinstance, _int=int, _str=str, _join="".join, _encode=str.encode, _wf=_WRITE_FLAGS,
             _creat=os.O_CREAT, _Error=PermissionError, _Exception=Exception, _OSError=OSError, _any=any):
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
                name = _join((args[0],))
                top = name.partition(".")[0]
                if top in {"ctypes", "_ctypes"}:
                    why = "ctypes is disabled in the sandbox"
                elif top in {"_posixsubprocess", "subprocess", "_multiprocessing", "_posixshmem"}:
                    why = "starting processes is disabled in the sandbox"
                elif top in {"_sqlite3", "sqlite3", "_dbm", "_gdbm"}:
                    why = "database modules are disabled in the sandbox"
                elif top in {"_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testclinic",
                             "_testimportmultiple", "_testsinglephase", "_xxsubinterpreters", "_xxinterpchannels",
                             "_xxtestfuzz", "_ctypes_test", "xxsubtype", "_tkinter", "readline", "posix", "_signal",
                             "_socket", "_io", "builtins", "sys"}:
                    why = "this module is disabled in the sandbox"
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
                _write(_fd, _encode(why + "\n"))
            except _Exception:
                pass
            raise _Error(why)

    return hook


def _fd_above(fd: int, low: int = 16) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)


def _close_from(low: int) -> None:
    """Close every descriptor >= low: the open ones as listed by /proc (closerange up to a huge
    RLIMIT_NOFILE costs a syscall per number where the close_range syscall is missing)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(low, 65536)
    for fd in fds:
        if fd >= low:
            try:
                os.close(fd)
            except OSError:
                pass


def _sql_runner(spec: dict):
    """A read-only SQLite query prepared before the audit hook goes in (sqlite3 is trusted code; the
    query is data): the database deserialised into memory, locked down by the caller's policy
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


def _child(code: str, lim: dict, workdir: str, out_w: int, err_w: int, note_w: int, read_roots: tuple[str, ...],
           audit_hook: bool = True, sql: dict | None = None):
    """The sandboxed process (a fork of the server): lock itself down, run `code`, _exit. Never returns."""
    os.setsid()  # its own process group: the server kills the whole group at the end
    # fds 0-3 := /dev/null, stdout pipe, stderr pipe, notes pipe; everything else (server sockets) closed
    srcs = [_fd_above(os.open("/dev/null", os.O_RDONLY)), _fd_above(out_w), _fd_above(err_w), _fd_above(note_w)]
    for target, src in enumerate(srcs):
        os.dup2(src, target)
    _close_from(4)
    os.chdir(workdir)
    mb = lim["memory_mb"] << 20
    for res, soft, hard in ((resource.RLIMIT_AS, mb, mb), (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),
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
    for name in DENIED_MODULES:
        sys.modules.pop(name, None)
    # tripwires, not a boundary (a fresh posix module has them again): these calls are not audited and
    # could signal other processes or make special files anywhere
    unaudited = ("pidfd_open", "mkfifo", "mknod")
    for mod, names in ((os, unaudited), (sys.modules["posix"], unaudited), (signal, ("pidfd_send_signal",)),
                       (sys.modules["_signal"], ("pidfd_send_signal",))):
        for n in names:
            if hasattr(mod, n):
                delattr(mod, n)
    if "random" in sys.modules:
        sys.modules["random"].seed(0)  # the server's random state is shared by all forks: make it fixed
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    linecache.cache["<sandbox>"] = (len(code), None, code.splitlines(True), "<sandbox>")
    runner = _sql_runner(sql) if sql is not None else None
    if audit_hook:  # defence in depth: the boundary is the operating system's (see _bwrap)
        hook = _hook_factory(workdir, read_roots, 3, os.getpid(), lim["max_files"])
        sys.addaudithook(hook)
        del hook  # held only by the interpreter's hook list from here on
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
    except MemoryError:
        status = EXIT_MEMORY
        try:
            sys.stderr.write("MemoryError\n")
        except BaseException:
            pass
    except BaseException as e:
        status = 1
        try:
            _print_exception(e)
        except BaseException:
            sys.stderr.write(f"{type(e).__name__}\n")
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


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _rmtree(path: str) -> None:
    def fix(func, p, exc):  # a directory made without permissions (root needs none)
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _classify(lim: dict, reason: str | None, status: int, cpu: float, err: str, notes: str) -> tuple[str, str | None]:
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    last = _last_line(err)
    note = notes.splitlines()[0] if notes.strip() else ""
    if reason == "output":
        return "output", f"output truncated at {lim['output_bytes']} bytes"
    if reason == "timeout":
        return "timeout", f"timed out after {lim['wall_s']:g} s (wall)"
    # SIGXCPU comes only from RLIMIT_CPU (whose tick accounting can read a little under the limit in
    # rusage); the hard limit's SIGKILL is told from the wall-clock kill by the CPU time used
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= lim["cpu_s"] - 0.1):
        return "cpu", f"CPU time limit {lim['cpu_s']} s exceeded"
    if code == EXIT_MEMORY or last.startswith("MemoryError") or "Cannot allocate memory" in last:
        return "memory", f"memory limit {lim['memory_mb']} MiB exceeded"
    if note:
        return "denied", note
    if sig == signal.SIGXFSZ or "File too large" in last:
        return "file_size", f"file size limit {lim['file_size_kb']} KiB exceeded"
    if sig == signal.SIGALRM:
        return "timeout", f"timed out after {lim['wall_s']:g} s (wall)"
    if sig is not None:
        return "crash", f"crashed with signal {signal.Signals(sig).name}"
    if code == EXIT_SETUP:
        return "sandbox", "sandbox setup failed"
    if code:
        return "error", last or f"exit status {code}"
    return "ok", None


def _exited(pid: int) -> bool:
    try:  # WNOWAIT: the child stays a zombie, so its process group id cannot be reused before killpg
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


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


def _handle(req: dict, base: str, read_roots: tuple[str, ...]) -> dict:
    """One call: fork the sandboxed process, collect its output under the limits, kill, reap, clean."""
    code, lim = req.get("code", ""), req["limits"]
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="run-", dir=base))
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, notes
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores SIGCHLD; this process must reap
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            for r, _ in pipes:
                os.close(r)
            _child(code, lim, workdir, pipes[0][1], pipes[1][1], pipes[2][1], read_roots, req.get("hook", True) is not False,
                   req.get("sql"))
        finally:
            os._exit(EXIT_SETUP)
    for _, w in pipes:
        os.close(w)
    try:
        pidfd = os.pidfd_open(pid)  # readable when the child exits (Linux >= 5.3)
    except (AttributeError, OSError):
        pidfd = None
    out = _Output([r for r, _ in pipes], [lim["output_bytes"], lim["output_bytes"], NOTES_CAP])
    deadline, reason, exited = t0 + lim["wall_s"], None, False
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        watch = sorted(out.live) + ([pidfd] if pidfd is not None else [])
        ready, _, _ = select.select(watch, [], [], left if pidfd is not None else min(left, 0.01))
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
    _kill_group(pid)  # whatever happened: nothing the code started outlives the call
    drain_until = time.monotonic() + 1.0  # what is still in the pipes (their writers are dead now)
    while out.live and time.monotonic() < drain_until:
        ready, _, _ = select.select(sorted(out.live), [], [], max(0.0, drain_until - time.monotonic()))
        for fd in ready:
            out.read(fd)
    if out.overflow and reason is None:
        reason = "output"
    _, status, ru = os.wait4(pid, 0)
    duration = time.monotonic() - t0
    for fd in out.fds + ([pidfd] if pidfd is not None else []):
        os.close(fd)
    _rmtree(workdir)
    stdout, stderr, notes = out.text()
    cpu = ru.ru_utime + ru.ru_stime
    kind, error = _classify(lim, reason, status, cpu, stderr, notes)
    return {"ok": kind == "ok", "stdout": stdout, "stderr": stderr, "error": error, "status": kind,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "duration_s": round(duration, 4), "cpu_s": round(cpu, 4)}


def _read_roots() -> tuple[str, ...]:
    """Where sandboxed code may read besides its directory: the standard library and a few devices."""
    roots = set(_EXTRA_READ_ROOTS)
    for p in sys.path:
        if p:
            roots.update({_norm(p, "/")[0], os.path.realpath(p)})
    return tuple(sorted(roots))


def _answer(req_bytes: bytes, base: str, roots: tuple[str, ...]) -> bytes:
    try:
        reply = _handle(json.loads(req_bytes), base, roots)
    except Exception as e:  # a server-side failure is reported, never hangs the client
        reply = {"ok": False, "stdout": "", "stderr": "", "error": f"sandbox failed: {type(e).__name__}: {e}",
                 "status": "sandbox"}
    return json.dumps(reply).encode()


def _serve(sock_path: str, base: str) -> None:
    """The zygote: fork one handler per connection; exit when the client's pipe (stdin) closes."""
    for name in PRELOAD:
        __import__(name)
    roots = _read_roots()
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(sock_path)
    lst.listen(128)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers (and orphans, as PID 1) reap themselves
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([lst, 0], [], [])
        if 0 in ready and not os.read(0, 4096):
            break
        if lst in ready:
            conn, _ = lst.accept()
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
                    chunks = []
                    while chunk := conn.recv(1 << 20):
                        chunks.append(chunk)
                    conn.sendall(_answer(b"".join(chunks), base, roots))
                    conn.shutdown(socket.SHUT_RDWR)  # the client's EOF now, not after this process's teardown
                    rc = 0
                finally:
                    os._exit(rc)
            conn.close()
    try:
        os.unlink(sock_path)
    except OSError:
        pass


def _once(base: str) -> None:
    """Spawn mode: one request on stdin, its reply on stdout."""
    for name in PRELOAD:
        __import__(name)
    req = sys.stdin.buffer.read()
    reply = _answer(req, base, _read_roots())
    sys.stdout.buffer.write(reply)
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------
# Client side. subprocess is imported inside functions: the server must never load _posixsubprocess.
# ---------------------------------------------------------------------------------------------------

_NAMESPACES = (
    ("namespaces", ["--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]),
    ("network-namespace", ["--map-root-user", "--net"]),
)
_probe_cache: dict[str, list[str] | None] = {}
SANDBOX_UID = 65534  # "nobody": the uid sandboxed code runs as (outside the namespaces too, see _bwrap)
ISOLATIONS = ("auto", "bwrap", "namespaces", "network-namespace", "hook")
ISOLATION_ENV = "AGENTKILN_SANDBOX_ISOLATION"  # the machine's choice (a deployment setting, not a param)


def _shared_libraries(paths: list[str]) -> set[str]:
    """The real directories of the shared libraries `paths` load (ldd), the dynamic loader's included."""
    import subprocess

    dirs: set[str] = set()
    ldd = shutil.which("ldd")
    if ldd is None:
        return {d for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if os.path.isdir(d)}
    for chunk in range(0, len(paths), 64):
        try:
            out = subprocess.run([ldd, *paths[chunk:chunk + 64]], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            for word in line.split():
                if word.startswith("/") and not word.endswith(":"):  # the file, and the directory named
                    dirs.update({os.path.dirname(os.path.realpath(word)), os.path.realpath(os.path.dirname(word))})
    return dirs


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _bwrap_view() -> list[str]:
    """bubblewrap's arguments for the sandbox's whole filesystem view: read-only the interpreter,
    its standard library (site-packages hidden under an empty tmpfs) and the shared libraries they
    load, a fresh /dev and /proc (of the sandbox's own PID namespace); nothing else of the host
    exists. The work directories are added per server (bind, read-write)."""
    import sysconfig

    exe = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    dynload = os.path.join(stdlib, "lib-dynload")
    objects = [exe] + ([os.path.join(dynload, f) for f in sorted(os.listdir(dynload)) if f.endswith(".so")]
                       if os.path.isdir(dynload) else [])
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv:
        objects.append(os.path.realpath(setpriv))
    roots = _shared_libraries(objects) | {stdlib, os.path.dirname(exe)}
    zoneinfo = "/usr/share/zoneinfo"
    if os.path.isdir(zoneinfo):
        roots.add(os.path.realpath(zoneinfo))
    kept: list[str] = []
    for d in sorted(roots):  # parents first; a directory inside one already bound is covered
        if not any(d == k or d.startswith(k + "/") for k in kept):
            kept.append(d)
    # the directories leading to a bound one exist in the view as empty, traversable (0755) ones: the
    # host's own may be private (/root), and the sandbox's uid must reach the interpreter through them
    ancestors = sorted({a for d in kept + [os.path.abspath(__file__)] for a in _ancestors(d)})
    args = [a for d in ancestors for a in ("--perms", "0755", "--dir", d)]
    args += [a for d in kept for a in ("--ro-bind", d, d)]
    for link in ("/lib", "/lib64"):  # merged-/usr systems: the loader's paths go through these
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
    # installed packages never enter the sandbox: sys.path.append cannot reach them
    import glob

    hidden = {os.path.join(stdlib, "site-packages")}
    for d in kept:
        hidden.update(glob.glob(os.path.join(d, "python3*", "*-packages")) + glob.glob(os.path.join(d, "*-packages")))
    args += [a for h in sorted(hidden) if os.path.isdir(h) for a in ("--tmpfs", h)]
    if setpriv and os.geteuid() == 0:
        args += ["--ro-bind", os.path.realpath(setpriv), os.path.realpath(setpriv)]
    args += ["--ro-bind", os.path.abspath(__file__), os.path.abspath(__file__), "--dev", "/dev", "--proc", "/proc"]
    return args


def _bwrap(base: str) -> list[str] | None:
    """The bubblewrap command prefix for a server whose work directories live under `base`, or None
    where bubblewrap is missing or cannot make namespaces here.

    Sandboxed code runs as uid SANDBOX_UID with no capabilities and no_new_privs, in new user (when
    not root), PID, network, IPC, UTS and mount namespaces. Started by
    root, bubblewrap sets up the view as root and `setpriv` then switches to the real uid 65534
    (a user namespace would map the sandbox's uid back to root outside); started by anyone else,
    bubblewrap maps uid 65534 inside to the caller's own (unprivileged) uid."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None
    key = "bwrap"
    if key not in _probe_cache:
        try:
            _probe_cache[key] = _bwrap_view()
        except OSError:
            _probe_cache[key] = None
    view = _probe_cache[key]
    if view is None:
        return None
    # no --die-with-parent: its signal follows the *thread* that started bubblewrap, and a tool call may
    # start the server from a worker thread. The server exits when the client's pipe closes (the
    # client's process ended, however it ended), and with it the PID namespace and all it holds.
    ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
          "--new-session", "--hostname", "sandbox"]
    reach = [a for d in _ancestors(base) for a in ("--perms", "0755", "--dir", d)]
    cmd = [exe, *ns, *view, *reach, "--bind", base, base, "--chdir", base, "--clearenv"]
    for k, v in _server_env().items():
        cmd += ["--setenv", k, v]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        return cmd + ["--", os.path.realpath(setpriv), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                      "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return cmd[:1] + ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)] + cmd[1:] + ["--"]


BASE_PREFIX = "agentkiln-sandbox-"


def _new_base() -> str:
    """A fresh directory for a server's socket and work directories, named for the owning process;
    those a killed process left behind (its pid gone) are removed first."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        pid = name[len(BASE_PREFIX):].split("-", 1)[0]
        if name.startswith(BASE_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{BASE_PREFIX}{os.getpid()}-")


def _own_base(base: str) -> None:
    """The work-directory root belongs to the sandbox's uid where that uid is a real one (root caller)."""
    if os.geteuid() == 0:
        os.chown(base, SANDBOX_UID, SANDBOX_UID)


def _probe(flags: list[str]) -> list[str] | None:
    """`unshare <flags>` as a command prefix if it works here (user namespaces may be disabled)."""
    import subprocess

    key = " ".join(flags)
    if key not in _probe_cache:
        exe = shutil.which("unshare")
        ok = False
        if exe:
            try:
                ok = subprocess.run([exe, *flags, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
        _probe_cache[key] = [exe, *flags] if ok else None
    return _probe_cache[key]


def _server_env() -> dict[str, str]:
    # built from nothing: no variable of the caller reaches the server; a fixed hash seed makes set
    # iteration (and so printed output) the same across runs
    return {"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _server_cmd(prefix: list[str], *args: str) -> list[str]:
    # -S -s: no site-packages; -P: not the script's directory on sys.path; -B: no .pyc writes; not -I,
    # which would ignore PYTHONHASHSEED (the environment is ours anyway). The interpreter by its real
    # path: a virtual environment's directory is not in bubblewrap's view (nor needed: -S).
    return [*prefix, os.path.realpath(sys.executable), "-B", "-S", "-s", "-P", "-X", "utf8",
            os.path.abspath(__file__), *args]


class Sandbox:
    """A sandbox server and its client. `mode`: "zygote" (a pre-started server forks each run), "spawn"
    (a fresh interpreter per run, ~10x slower) or "auto" (zygote, falling back to spawn). `isolation`:
    "auto" (the strongest namespaces that work here), "namespaces", "network-namespace" or "hook" (no
    namespaces: the audit hook alone keeps the network off). Thread-safe; runs proceed in parallel."""

    def __init__(self, mode: str = "auto", isolation: str | None = None, audit_hook: bool = True):
        if mode not in ("auto", "zygote", "spawn"):
            raise ValueError(f"sandbox: mode = {mode!r}: must be auto, zygote or spawn")
        isolation = isolation or os.environ.get(ISOLATION_ENV) or "auto"
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox: isolation = {isolation!r} (argument or {ISOLATION_ENV}): must be one of "
                             f"{', '.join(ISOLATIONS)}")
        self.mode, self._isolation = mode, isolation
        self.audit_hook = audit_hook  # off only to test that the operating system alone contains the code
        self._lock = threading.Lock()
        self._proc = None
        self._sock_dir: str | None = None  # the zygote's socket and its runs' work directories
        self._path: str | None = None
        self._generation = 0
        self._owner = os.getpid()
        self.isolation = ""  # what the server actually runs with, once started
        self.zygote_failed = False

    # -- isolation ---------------------------------------------------------------------------------
    def _prefixes(self, base: str) -> list[tuple[str, list[str]]]:
        """(isolation, command prefix) for a server whose work directories live under `base`, strongest
        first. `auto` never falls back silently: without bubblewrap a warning says what is lost."""
        found: list[tuple[str, list[str]]] = []
        if self._isolation in ("auto", "bwrap"):
            prefix = _bwrap(base)
            if prefix is not None:
                found.append(("bwrap", prefix))
            elif self._isolation == "bwrap":
                raise RuntimeError("sandbox: isolation 'bwrap' is not available here: install bubblewrap "
                                   "(Debian: apt-get install bubblewrap) and allow user namespaces")
        for name, flags in _NAMESPACES:
            if self._isolation in ("auto", name) and (p := _probe(flags)) is not None:
                found.append((name, p))
        if self._isolation in ("auto", "hook"):
            found.append(("hook", []))
        if not found:
            raise RuntimeError(f"sandbox: isolation {self._isolation!r} is not available here (unshare failed)")
        if self._isolation == "auto" and found[0][0] != "bwrap" and not _warned:
            _warned.append(True)
            sys.stderr.write(
                f"agentkiln sandbox: bubblewrap is not usable here, so model-written code runs with "
                f"'{found[0][0]}' isolation only (no private filesystem view, no separate uid; see "
                f"docs/sandbox.md). Install bubblewrap (apt-get install bubblewrap), or set "
                f"{ISOLATION_ENV}=bwrap to refuse to run without it.\n")
        return found

    # -- the zygote --------------------------------------------------------------------------------
    def _start(self) -> bool:
        """Start the zygote with the strongest isolation that works; False if none starts."""
        import subprocess

        self._stop()
        base = _new_base()
        for name, prefix in self._prefixes(base):  # only bwrap's prefix names `base`, and it comes first
            self._sock_dir = base
            if name == "bwrap":
                _own_base(base)
            path = os.path.join(self._sock_dir, "s")
            # work directories go under the socket's directory too: removing it at close() also removes
            # any a killed handler left behind
            proc = subprocess.Popen(_server_cmd(prefix, "serve", path, self._sock_dir), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_server_env(),
                                    start_new_session=True, close_fds=True)
            poll = select.poll()  # not select(): the caller may hold more than 1024 descriptors
            poll.register(proc.stdout, select.POLLIN)
            if poll.poll(30_000) and proc.stdout.readline() == b"ready\n":
                self._proc, self._path, self.isolation = proc, path, name
                self._generation += 1
                return True
            proc.kill()
            proc.wait()
            shutil.rmtree(base, ignore_errors=True)
            os.mkdir(base, 0o700)  # empty again for the next (weaker) isolation
        shutil.rmtree(base, ignore_errors=True)
        self._sock_dir = None
        return False

    def _stop(self) -> None:
        proc, self._proc, self._path = self._proc, None, None
        if proc is not None and os.getpid() == self._owner:
            try:
                proc.stdin.close()  # the zygote exits on EOF
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def _zygote(self, generation: int) -> tuple[str | None, int]:
        """The live zygote's socket path (restarting it when `generation` is the one that failed)."""
        with self._lock:
            alive = self._proc is not None and self._proc.poll() is None
            if not alive or generation == self._generation:
                if self.zygote_failed or not self._start():
                    self.zygote_failed = True
                    return None, self._generation
            return self._path, self._generation

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running code ------------------------------------------------------------------------------
    def run(self, code: str, limits: Limits | None = None) -> SandboxResult:
        if not isinstance(code, str):
            raise TypeError(f"sandbox: code must be a str, got {type(code).__name__}")
        limits = limits or Limits()
        return self._run(json.dumps({"code": code, "limits": asdict(limits), "hook": self.audit_hook}).encode(),
                         limits)

    def run_sql(self, spec: dict, limits: Limits | None = None) -> SandboxResult:
        """Run one read-only SQLite query in the sandbox (see _sql_runner for `spec`); its answer is
        the JSON line on stdout, or the result says which limit stopped it."""
        limits = limits or Limits()
        return self._run(json.dumps({"sql": spec, "limits": asdict(limits), "hook": self.audit_hook}).encode(),
                         limits)

    def _run(self, req: bytes, limits: Limits) -> SandboxResult:
        if self.mode != "spawn":
            failed = -1
            for _ in range(2):  # a dead zygote is restarted once per call
                path, gen = self._zygote(failed)
                if path is None:
                    break
                try:
                    return self._call(path, req, limits)
                except _Gone:
                    failed = gen
            if self.mode == "zygote":
                return _failure("sandbox server unavailable")
        return self._spawn(req, limits)

    def _call(self, path: str, req: bytes, limits: Limits) -> SandboxResult:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(limits.wall_s + GRACE_S)
            try:
                s.connect(path)
                s.sendall(req)
                s.shutdown(socket.SHUT_WR)
            except (ConnectionRefusedError, FileNotFoundError, BrokenPipeError, ConnectionResetError) as e:
                raise _Gone from e  # the zygote died: restart it and try again
            except OSError as e:
                return _failure(f"sandbox server unreachable: {e}")
            chunks = []
            try:
                while chunk := s.recv(1 << 20):
                    chunks.append(chunk)
            except OSError:
                return _failure("sandbox server did not answer in time")
        if not chunks:
            return _failure("sandbox server failed without an answer")
        return SandboxResult(**json.loads(b"".join(chunks)))

    def _spawn(self, req: bytes, limits: Limits) -> SandboxResult:
        import subprocess

        base = _new_base()
        name, prefix = self._prefixes(base)[0]
        self.isolation = self.isolation or name
        if name == "bwrap":
            _own_base(base)
        try:
            proc = subprocess.run(_server_cmd(prefix, "once", base), input=req, capture_output=True,
                                  env=_server_env(), timeout=limits.wall_s + GRACE_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            return _failure("sandbox server did not answer in time")
        finally:
            shutil.rmtree(base, ignore_errors=True)
        if not proc.stdout:
            return _failure("sandbox server failed without an answer")
        return SandboxResult(**json.loads(proc.stdout))


class _Gone(Exception):
    pass


def _failure(why: str) -> SandboxResult:
    return SandboxResult(ok=False, stdout="", stderr="", error=why, status="sandbox")


_warned: list[bool] = []
_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox that run_python uses (started on first use, closed at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            import atexit

            _default = Sandbox()
            atexit.register(_default.close)
    return _default


def run_python(code: str, limits: Limits | None = None) -> SandboxResult:
    """Run `code` in the process-wide sandbox under `limits` (default Limits())."""
    return default_sandbox().run(code, limits)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "once":
        _once(sys.argv[2])
