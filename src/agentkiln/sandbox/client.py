"""The trainer's side of the tool sandbox: `Sandbox.run(code, limits)`, `Sandbox.run_sql(...)`.

A `Sandbox` keeps one server per configuration (limits, audit hook, SQL policy): the configuration
is fixed when that server starts, so a request carries only the code or the query and can set
nothing else. Each server listens on a socket the client binds in a directory of its own (0700,
outside the sandbox's view) and hands over as an open descriptor; it refuses any peer but the
client. A server that dies is restarted once per call; `close()` (and the client's exit, however it
ends) ends every server and, with it, every process a call started.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass

from agentkiln.sandbox import isolation as iso

GRACE_S = 20.0  # the client waits this much longer than the wall limit (fork + clean-up on a loaded host)
MAX_SERVERS = 8  # servers (distinct configurations) kept per Sandbox; the least recently used stops
BASE_PREFIX = "agentkiln-sandbox-"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 2.0  # wall-clock seconds for the whole run
    cpu_s: int = 1  # CPU seconds of the code's process, all threads (whole: the RLIMIT_CPU backstop counts whole seconds)
    memory_mb: int = 256  # address space (RLIMIT_AS), MiB, per process
    output_bytes: int = 8192  # per stream (stdout, stderr): more is cut off and the process killed
    file_size_kb: int = 1024  # largest file it may write (RLIMIT_FSIZE), KiB
    max_files: int = 64  # files and directories it may create (the call's tmpfs has this many inodes)
    disk_kb: int = 4096  # every byte it may keep on disk: the size of the call's tmpfs, KiB
    open_files: int = 32  # RLIMIT_NOFILE
    processes: int = 64  # RLIMIT_NPROC: counts every process of the user (see docs/sandbox.md)

    def __post_init__(self) -> None:
        ranges = {"wall_s": (0.05, 600.0), "cpu_s": (1, 600), "memory_mb": (32, 65536), "output_bytes": (64, 1 << 26),
                  "file_size_kb": (1, 1 << 22), "max_files": (0, 1 << 20), "disk_kb": (4, 1 << 22),
                  "open_files": (8, 1 << 16), "processes": (1, 1 << 22)}
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
    status: str  # ok | error | timeout | cpu | memory | output | file_size | disk | denied | crash | sandbox
    exit_code: int | None = None  # None when killed by a signal
    signal: int | None = None
    duration_s: float = 0.0  # wall time of the sandboxed process, as measured by the server
    cpu_s: float = 0.0


def _failure(why: str) -> SandboxResult:
    return SandboxResult(ok=False, stdout="", stderr="", error=why, status="sandbox")


class _Gone(Exception):
    """The server is not there (any more): restart it and try again."""


SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def _new_dir(kind: str) -> str:
    """A fresh directory in the system temp dir named for the owning process (`kind`: sock or work);
    those a killed process left behind (its pid gone) are removed first. A socket's directory goes to
    /tmp instead when the temp dir's path is so long that the socket's would not fit a Unix socket
    address (a run's private TMPDIR under a deep test directory)."""
    tmp = tempfile.gettempdir()
    if kind == "sock" and len(os.path.join(tmp, f"{BASE_PREFIX}{os.getpid()}-sock-xxxxxxxx", "s")) > SOCKET_PATH_MAX:
        tmp = "/tmp"
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        pid = name[len(BASE_PREFIX):].split("-", 1)[0]
        if name.startswith(BASE_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{BASE_PREFIX}{os.getpid()}-{kind}-", dir=tmp)


class _Server:
    """One running server (the zygote) for one configuration."""

    def __init__(self, proc: subprocess.Popen, sock_dir: str, work_root: str, level: str, per_call: bool):
        self.proc, self.sock_dir, self.work_root, self.level, self.per_call = proc, sock_dir, work_root, level, per_call
        self.path = os.path.join(sock_dir, "s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the server exits on EOF, and as PID 1 takes every call with it
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        for d in (self.sock_dir, self.work_root):
            shutil.rmtree(d, ignore_errors=True)


class Sandbox:
    """Sandbox servers and their client. `mode`: "zygote" (a pre-started server forks each run), "spawn"
    (a fresh interpreter per run, ~10x slower) or "auto" (zygote, falling back to spawn). `isolation`:
    "auto" (the strongest that works here), "bwrap", "namespaces", "network-namespace" or "hook" (no
    namespaces: the audit hook alone keeps the network off). `audit_hook`: off only to test that the
    operating system alone contains the code; `per_call`: off only to test the shared-namespace
    fallback of machines that refuse nested user namespaces. Thread-safe; runs proceed in parallel."""

    def __init__(self, mode: str = "auto", isolation: str | None = None, audit_hook: bool = True,
                 per_call: bool = True):
        if mode not in ("auto", "zygote", "spawn"):
            raise ValueError(f"sandbox: mode = {mode!r}: must be auto, zygote or spawn")
        isolation = isolation or os.environ.get(iso.ISOLATION_ENV) or "auto"
        if isolation not in iso.ISOLATIONS:
            raise ValueError(f"sandbox: isolation = {isolation!r} (argument or {iso.ISOLATION_ENV}): must be one of "
                             f"{', '.join(iso.ISOLATIONS)}")
        self.mode, self._isolation, self.audit_hook, self._per_call = mode, isolation, audit_hook, per_call
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}  # by configuration, least recently used first
        self._owner = os.getpid()
        self.isolation = ""  # what the servers actually run with, once one started
        self.per_call = False  # whether each call gets its own namespaces (see docs/sandbox.md)
        self.zygote_failed = False

    # -- configuration and isolation ---------------------------------------------------------------
    def _config(self, limits: Limits, sql_policy: dict | None) -> dict:
        # percall "require" where the machine asks for the full boundary (CI: bwrap), else best effort
        percall = "off" if not self._per_call else "require" if self._isolation == "bwrap" else "try"
        return {"limits": asdict(limits), "hook": self.audit_hook, "sql": sql_policy, "trainer_pid": os.getpid(),
                "percall": percall}

    def _prefixes(self, work_root: str) -> list[tuple[str, list[str]]]:
        found = iso.prefixes(self._isolation, work_root)
        if self._isolation == "auto" and found[0][0] != "bwrap":
            _warn(f"agentkiln sandbox: bubblewrap is not usable here, so model-written code runs with "
                  f"'{found[0][0]}' isolation only (no private filesystem view, no separate uid; see "
                  f"docs/sandbox.md). Install bubblewrap (apt-get install bubblewrap), or set "
                  f"{iso.ISOLATION_ENV}=bwrap to refuse to run without it.")
        return found

    def _started(self, level: str, per_call: bool) -> None:
        self.isolation, self.per_call = self.isolation or level, per_call
        if not per_call and self._per_call and level in ("bwrap", "namespaces"):
            _warn(f"agentkiln sandbox: calls cannot get namespaces of their own here (user namespaces are not "
                  f"allowed inside '{level}'), so a process a call starts may outlive it and concurrent calls "
                  f"may see each other (docs/sandbox.md). Set {iso.ISOLATION_ENV}=bwrap to refuse to run so.")

    # -- servers -----------------------------------------------------------------------------------
    def _start(self, cfg: dict) -> _Server | None:
        """Start a server for `cfg` with the strongest isolation that works; None if none starts."""
        sock_dir, work_root = _new_dir("sock"), _new_dir("work")
        path = os.path.join(sock_dir, "s")
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(path)
            lst.listen(128)
            for level, prefix in self._prefixes(work_root):  # only bwrap's prefix names work_root, and it is first
                if level == "bwrap":
                    iso.own_work_root(work_root)
                cmd = iso.server_cmd(prefix, "serve", json.dumps({**cfg, "work_root": work_root}), str(lst.fileno()))
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=iso.server_env(), start_new_session=True, pass_fds=(lst.fileno(),))
                poll = select.poll()  # not select(): the caller may hold more than 1024 descriptors
                poll.register(proc.stdout, select.POLLIN)
                line = proc.stdout.readline() if poll.poll(30_000) else b""
                if line.startswith(b"ready percall="):
                    per_call = line.strip().endswith(b"=1")
                    self._started(level, per_call)
                    return _Server(proc, sock_dir, work_root, level, per_call)
                proc.kill()
                proc.wait()
                proc.stdout.close()
                if line.startswith(b"no per-call namespaces"):
                    raise RuntimeError(f"sandbox: {iso.ISOLATION_ENV}=bwrap asks for per-call namespaces, which "
                                       f"this machine refuses ({line.decode().strip()}): allow unprivileged user "
                                       f"namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
                                       f"kernel.apparmor_restrict_unprivileged_userns=0)")
                shutil.rmtree(work_root, ignore_errors=True)
                os.mkdir(work_root, 0o700)  # empty again for the next (weaker) isolation
        finally:
            lst.close()  # the server holds its own copy
        shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(work_root, ignore_errors=True)
        return None

    def _server(self, cfg: dict, failed: _Server | None) -> _Server | None:
        """The live server for `cfg` (restarting it when it is the one that failed)."""
        key = json.dumps(cfg, sort_keys=True)
        with self._lock:
            if os.getpid() != self._owner:  # a forked copy of this object: its servers are the parent's
                self._servers, self._owner, self.zygote_failed = {}, os.getpid(), False
            srv = self._servers.pop(key, None)
            if srv is not None and (srv is failed or not srv.alive()):
                srv.stop()
                srv = None
            if srv is None:
                if self.zygote_failed:
                    return None
                srv = self._start(cfg)
                if srv is None:
                    self.zygote_failed = True
                    return None
            self._servers[key] = srv  # most recently used last
            while len(self._servers) > MAX_SERVERS:
                self._servers.pop(next(iter(self._servers))).stop()
            return srv

    def close(self) -> None:
        with self._lock:
            servers, self._servers = self._servers, {}
            if os.getpid() == self._owner:
                for srv in servers.values():
                    srv.stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running code ------------------------------------------------------------------------------
    def run(self, code: str, limits: Limits | None = None) -> SandboxResult:
        if not isinstance(code, str):
            raise TypeError(f"sandbox: code must be a str, got {type(code).__name__}")
        limits = limits or Limits()
        return self._run(self._config(limits, None), json.dumps({"code": code}).encode(), limits)

    def run_sql(self, policy: dict, db_b64: str, query: str, max_rows: int, limits: Limits | None = None) -> SandboxResult:
        """Run one read-only SQLite query in the sandbox on a copy of the database (base64), under the
        trainer's `policy` (server._sql_runner: sqlite limits, allowed authoriser actions, denied
        functions, vm_steps, max_rows); its answer is the JSON line on stdout, or the result says which
        limit stopped it."""
        limits = limits or Limits()
        req = json.dumps({"sql": {"db": db_b64, "query": query, "max_rows": max_rows}}).encode()
        return self._run(self._config(limits, policy), req, limits)

    def _run(self, cfg: dict, req: bytes, limits: Limits) -> SandboxResult:
        if self.mode != "spawn":
            failed = None
            for _ in range(2):  # a dead server is restarted once per call
                srv = self._server(cfg, failed)
                if srv is None:
                    break
                try:
                    return self._call(srv.path, req, limits)
                except _Gone:
                    failed = srv
            if self.mode == "zygote":
                return _failure("sandbox server unavailable")
        return self._spawn(cfg, req, limits)

    def _call(self, path: str, req: bytes, limits: Limits) -> SandboxResult:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(limits.wall_s + GRACE_S)
            try:
                s.connect(path)
                s.sendall(req)
                s.shutdown(socket.SHUT_WR)
            except (ConnectionRefusedError, FileNotFoundError, BrokenPipeError, ConnectionResetError) as e:
                raise _Gone from e
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

    def _spawn(self, cfg: dict, req: bytes, limits: Limits) -> SandboxResult:
        work_root = _new_dir("work")
        try:
            level, prefix = self._prefixes(work_root)[0]
            if level == "bwrap":
                iso.own_work_root(work_root)
            proc = subprocess.run(iso.server_cmd(prefix, "once", json.dumps({**cfg, "work_root": work_root})), input=req, capture_output=True,
                                  env=iso.server_env(), timeout=limits.wall_s + GRACE_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            return _failure("sandbox server did not answer in time")
        finally:
            shutil.rmtree(work_root, ignore_errors=True)
        self.isolation = self.isolation or level
        if not proc.stdout.startswith(b"{"):
            return _failure("sandbox server failed without an answer" if not proc.stdout
                            else f"sandbox server failed: {proc.stdout.decode(errors='replace').strip()[:200]}")
        return SandboxResult(**json.loads(proc.stdout))


_warned: set[str] = set()


def _warn(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        sys.stderr.write(text + "\n")


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
