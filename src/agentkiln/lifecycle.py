"""A run stops cleanly on SIGTERM, SIGHUP or Ctrl-C, and no process it started outlives it.

- `handle_signals()`: SIGTERM and SIGHUP raise `Terminated` (a SystemExit with status 128 + signal)
  in the main thread, as Ctrl-C raises KeyboardInterrupt: `finally` blocks, context managers and
  atexit handlers run (the MLflow run ends FAILED, Prefect's temporary server stops, the sandbox's
  temporary directories go). The signal goes on at once to the children in this process's group
  (pool workers), as a signal to the whole group would. A timer ends the process `FORCE_AFTER_S`
  seconds after the first signal should the cleanup hang; at exit, children still running get SIGTERM.
- `die_with_parent()`: the kernel sends SIGTERM to this process when its parent dies, even by
  SIGKILL (Linux `PR_SET_PDEATHSIG`). A stage run by DVC sets it: a killed `dvc repro` (or the
  pipeline above it) takes its stage with it.
- `child_argv(module, args)`: `python -m module args` for a child that gets SIGTERM when this
  process dies. Started with `start_new_session=True`, a signal sent to this process's group does
  not reach it: its owner stops it in order (`stop_group`).
- `start_prefect_server()`: Prefect's temporary API server as such a child, started from the main
  thread before the flow (Prefect otherwise starts it as a plain child: a SIGKILLed stage left a
  uvicorn listening with init as its parent).
- `run_forwarding(argv)`: a front end's child (the `agentkiln` command's flow process): it dies with
  this process (even by SIGKILL: the kernel sends it SIGTERM), SIGTERM / SIGHUP / Ctrl-C reach it
  once, and this process waits until it has stopped in order, then exits with its status.
- `run_group(argv)`: run a command in its own process group; on any exception in the caller
  (Terminated, KeyboardInterrupt, ...) the whole group gets SIGTERM, then SIGKILL after a grace period.
- `start_watchdog()`: a small process that outlives this one by a moment only: it records this
  process's descendants every half second and, once this process is gone (SIGKILL included),
  stops those still running (pool workers blocked on a dead parent's queue would wait forever).
- `private_tmpdir()`: a temporary directory for this run and every process it starts (TMPDIR),
  removed at exit whatever the children left there (a sandbox server ended by a signal, a pool
  worker); one left by a SIGKILLed run is removed by the next run.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1
RUN_TMP_PREFIX = "agentkiln-run-"
FORCE_AFTER_S = 30.0  # after the first signal, the cleanup gets this long before the process is ended
GROUP_GRACE_S = 15.0  # a child process group gets this long after SIGTERM before SIGKILL

_watchdog: list[int] = []  # its pid: not one of the children to stop at exit (it ends by itself)
_prefect_stopping: list[int] = []  # a SIGTERM Prefect's handler has turned into its crash handling
_received: list[int] = []  # the termination signals received (or 0: a KeyboardInterrupt noted), in order


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM / SIGHUP; exits with status 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def _on_signal(signum: int, frame) -> None:
    first = not _received
    _received.append(signum)
    if not first:
        return  # already stopping: a second signal must not interrupt the cleanup it started
    timer = threading.Timer(FORCE_AFTER_S, _force_exit, args=(signum,))
    timer.daemon = True
    timer.start()
    _forward(signum)
    raise Terminated(signum)


def _forward(signum: int) -> None:
    """As a signal to the whole process group would: the children sharing this process's group (pool
    workers, ...) get it now, not once their current work is done; those in a session of their own
    (Prefect's server, which the flow still reports its end to, the sandbox server) stop in order."""
    _signal_all([p for p in children(group=os.getpgrp()) if p not in _watchdog], signum)


def _chain_prefect_handler() -> None:
    """While a flow runs, Prefect's SIGTERM handler replaces ours (it raises its TerminationSignal to
    record the crash, then re-sends the signal to our handler): make it forward the signal first."""
    try:
        from prefect.utilities import engine
    except ImportError:
        return
    original = getattr(engine, "_prefect_sigterm_handler", None)
    if original is None or getattr(original, "agentkiln_forwards", False):
        return

    def forwarding(signum, *args):
        # A second SIGTERM (a stage under DVC gets one from its group and one when DVC dies) must not
        # interrupt Prefect recording the crash: the flow run would stay RUNNING.
        if _prefect_stopping:
            return
        _prefect_stopping.append(signum)
        if not _received:
            _forward(signum)
        return original(signum, *args)

    forwarding.agentkiln_forwards = True
    engine._prefect_sigterm_handler = forwarding  # looked up by name when Prefect installs and checks it


def _force_exit(signum: int) -> None:
    sys.stderr.write(f"agentkiln: cleanup after {signal.Signals(signum).name} took more than {FORCE_AFTER_S:.0f} s; "
                     "ending now\n")
    sys.stderr.flush()
    stop_children(grace=2.0)
    os._exit(128 + signum)


def terminated() -> bool:
    """Whether this process is stopping on a signal (or a noted Ctrl-C)."""
    return bool(_received)


def note_interrupt() -> None:
    """Ctrl-C reached the top: sweep leftover children at exit as after SIGTERM."""
    _received.append(0)


def handle_signals() -> None:
    """Install the SIGTERM / SIGHUP handlers (main thread only; an ignored SIGHUP stays ignored, as
    under nohup) and the exit-time sweep of leftover child processes."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_signal)
    _chain_prefect_handler()
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _on_signal)
    # registered before anything that starts children registers its own cleanup: atexit runs last
    # in, first out, so this sweep comes after Prefect's server and the sandbox stopped themselves
    atexit.register(_sweep_at_exit)


def _sweep_at_exit() -> None:
    """SIGTERM to any child left at exit (no waiting: some exit only once this process has, e.g.
    multiprocessing's resource tracker; the watchdog SIGKILLs whatever is still there after that)."""
    if _received:
        _signal_all([p for p in children() if p not in _watchdog], signal.SIGTERM)


# --------------------------------------------------------------------------- the process table (Linux /proc)
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    return rest[0], int(rest[1]), int(rest[2])


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def children(pid: int | None = None, group: int | None = None) -> list[int]:
    """Live (not zombie) descendants of `pid` (default: this process), parents before children;
    with `group`, only those in that process group."""
    root = os.getpid() if pid is None else pid
    table = {p: s for p in _pids() if (s := _stat(p)) is not None}
    out, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for p, (state, ppid, pgrp) in table.items():
            if ppid == parent and p not in out:
                frontier.append(p)
                if state != "Z" and (group is None or pgrp == group):
                    out.append(p)
    return out


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    return [p for p in _pids() if (s := _stat(p)) is not None and s[2] == pgid and s[0] != "Z"]


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_children(grace: float = 3.0) -> None:
    """SIGTERM every live descendant of this process, SIGKILL those still there after `grace` s."""
    pids = [p for p in children() if p not in _watchdog]
    if not pids:
        return
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (alive := [p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(alive, signal.SIGKILL)


# --------------------------------------------------------------------------- children that die with us
def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere nothing).
    `parent`: the pid the parent had at start; if it is already gone, `sig` comes now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)  # the parent died before the request took effect


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, as text): with its pid, it names the very
    process (a pid alone may be reused); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()[19]  # field 22: start time since boot


def _is_dvc(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return "dvc" in (os.path.basename(a) for a in args)


def die_with_dvc(started_by: int, poll_s: float = 0.5) -> None:
    """For a stage run by `dvc repro`: SIGTERM this process when DVC dies, even by SIGKILL. DVC runs
    the command through $SHELL; bash hands the process over to the command (so DVC is the parent:
    the parent-death signal suffices), dash stays in between: then a daemon thread watches every
    process from the parent up to DVC. `started_by`: the parent's pid when this process started."""
    die_with_parent(parent=started_by)
    chain, pid = [], started_by
    for _ in range(3):
        st = start_time(pid)
        if st is None:
            break
        chain.append((pid, st))
        if _is_dvc(pid) or (info := _stat(pid)) is None:
            break
        pid = info[1]
    if len(chain) < 2 or not _is_dvc(chain[-1][0]):
        return  # DVC is the parent (or not found above it): the parent-death signal is the whole story

    def watch() -> None:
        while all(start_time(p) == st for p, st in chain):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="agentkiln-watch-dvc", daemon=True).start()


# Runs in the child before the module: the parent-death signal, then `python -m module args`.
_BOOT = (
    "import ctypes, os, runpy, sys\n"
    "parent, sig, module = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)\n"
    "    if os.getppid() != parent:\n"
    "        sys.exit(128 + sig)\n"
    "sys.argv = [module] + sys.argv[4:]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def child_argv(module: str, args: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """argv of `python -m module *args` for a child of this process (this thread: start it from the
    thread that lives as long as the process, the main one) that gets `sig` when this process dies."""
    return [sys.executable, "-c", _BOOT, str(os.getpid()), str(int(sig)), module, *args]


def run_group(argv: list[str], grace: float = GROUP_GRACE_S, on_line: Callable[[str], object] | None = None,
              **popen) -> int:
    """Run `argv` in a new session (its own process group) and wait for it. If the wait is
    interrupted by any exception (Terminated, KeyboardInterrupt), the whole group gets SIGTERM, then
    SIGKILL after `grace` s; the exception then propagates. Returns the exit status. With `on_line`,
    its stdout and stderr are read line by line and handed to `on_line` (e.g. a flow's logger)."""
    if on_line is not None:
        popen |= {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "errors": "replace"}
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    try:
        if on_line is not None:
            for line in proc.stdout:
                on_line(line.rstrip("\n"))
        return proc.wait()
    except BaseException:
        stop_group(proc.pid, grace)
        proc.wait()
        raise


def run_forwarding(argv: list[str], **popen) -> int:
    """Run `argv` (from `child_argv`: it gets SIGTERM when this process dies, however it dies) in a
    process group of its own, so that a terminal's Ctrl-C reaches it once, through this process; the
    first SIGINT, SIGTERM and SIGHUP this process gets go on to it (later ones are dropped: the child
    is already stopping, and a second signal would interrupt its cleanup), then this waits for it.
    Returns its exit status, 128 + signal when a signal ended it."""
    proc = subprocess.Popen(argv, process_group=0, **popen)
    sent: set[int] = set()

    def forward(signum: int, frame) -> None:
        if signum in sent:
            return
        sent.add(signum)
        sys.stderr.write(f"agentkiln: {signal.Signals(signum).name}: stopping the run (it ends its stages and "
                         "marks their runs failed; this takes a few seconds)\n")
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
                                              else [])
    previous = {s: signal.signal(s, forward) for s in sigs} if threading.current_thread() is threading.main_thread() else {}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc


def stop_group(pgid: int, grace: float = GROUP_GRACE_S) -> None:
    """SIGTERM process group `pgid`, wait until none of it is alive, SIGKILL what is left after `grace` s."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except BaseException:  # a second signal: stop waiting politely
            break
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- the watchdog
# Started with `python -I -S -c`: a few milliseconds, no import beyond the standard library's core.
_WATCHDOG = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # only the watched process's end ends the watchdog
root, interval, grace = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
me = os.getpid()

def stat(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    return rest[0], int(rest[1]), rest[19]

def alive(pid, start):
    s = stat(pid)
    return s is not None and s[2] == start and s[0] != "Z"

root_start = stat(root)[2] if stat(root) else None
seen = {}
while root_start is not None and alive(root, root_start):
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := stat(int(name))) is not None:
            table[int(name)] = s
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (state, ppid, start) in table.items():
            if ppid == parent and pid != me and seen.get(pid) != start:
                seen[pid] = start
                frontier.append(pid)
    time.sleep(interval)
left = [(p, st) for p, st in seen.items() if alive(p, st)]
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
    for p, st in left:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while (left := [(p, st) for p, st in left if alive(p, st)]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def start_watchdog(interval: float = 0.5, grace: float = 3.0) -> subprocess.Popen | None:
    """Start the watchdog of this process (Linux; elsewhere nothing): see the module docstring."""
    if not sys.platform.startswith("linux"):
        return None
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(interval), str(grace)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    _watchdog.append(proc.pid)
    return proc


# --------------------------------------------------------------------------- temporary files
def private_tmpdir() -> Path:
    """Make a fresh directory this process's (and its children's) temporary directory: TMPDIR and
    Python's tempfile. It is removed at exit, after the children are stopped (call this before
    `handle_signals`: exit handlers run last registered, first run). Directories of earlier runs
    whose process is gone (SIGKILLed) are removed first."""
    base = Path(tempfile.gettempdir())
    for d in base.glob(f"{RUN_TMP_PREFIX}*"):
        parts = d.name[len(RUN_TMP_PREFIX):].split("-")
        if len(parts) >= 2 and parts[0].isdigit() and start_time(int(parts[0])) != parts[1]:
            shutil.rmtree(d, ignore_errors=True)
    me = os.getpid()
    d = Path(tempfile.mkdtemp(prefix=f"{RUN_TMP_PREFIX}{me}-{start_time(me)}-", dir=base))
    d.chmod(0o711)  # others may reach (not list) what is shared with them, e.g. a sandbox's directory
    os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = str(d)
    atexit.register(shutil.rmtree, d, True)
    return d


# --------------------------------------------------------------------------- Prefect's temporary server
def start_prefect_server() -> str | None:
    """Start Prefect's temporary API server now, as a child that dies with this process and sits in
    its own session; the flow and every Prefect client of this process then use it. Nothing when
    PREFECT_API_URL names a server or temporary servers are disabled. Returns the API URL."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    import prefect
    from prefect.server.api import server as api
    from prefect.settings.context import get_current_settings

    srv = api.SubprocessASGIServer()  # the instance every Prefect client of this process uses
    if not srv.running:
        def launch() -> subprocess.Popen:  # prefect's own command and environment (3.8), our process placement
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            args = ["--app-dir", str(prefect.__module_path__.parent), "--factory", "prefect.server.api.server:create_app",
                    "--host", "127.0.0.1", "--port", str(srv.port), "--log-level", "error", "--lifespan", "on"]
            return subprocess.Popen(child_argv("uvicorn", args), env=env, start_new_session=True)

        if hasattr(srv, "_run_uvicorn_command"):
            srv._run_uvicorn_command = launch
        srv.start()
    return srv.api_url
