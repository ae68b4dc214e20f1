"""The operating-system isolation a sandbox server runs under: bubblewrap, or `unshare`, or none.

`prefixes(isolation, work_root)` gives the command prefixes that start the server (`server.py`),
strongest first. Nothing here runs model-written code; the client starts the server with one of
these prefixes and the server adds per-call namespaces inside (server.enter_call_namespaces).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from agentkiln.sandbox import server

SANDBOX_UID = 65534  # "nobody": the uid sandboxed code runs as (outside the namespaces too, see bwrap_prefix)
ISOLATIONS = ("auto", "bwrap", "namespaces", "network-namespace", "hook")
ISOLATION_ENV = "AGENTKILN_SANDBOX_ISOLATION"  # the machine's choice (a deployment setting, not a param)
SERVER = os.path.abspath(server.__file__)
_NAMESPACES = (
    ("namespaces", ["--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]),
    ("network-namespace", ["--map-root-user", "--net"]),
)
_probe_cache: dict[str, list[str] | None] = {}


def _shared_libraries(paths: list[str]) -> set[str]:
    """The real directories of the shared libraries `paths` load (ldd), the dynamic loader's included."""
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
    load, a fresh /dev (without ptys) and a /proc of the sandbox's own PID namespace; nothing else of
    the host exists, and nothing of the view is writable (the work root is added per server)."""
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
    ancestors = sorted({a for d in kept + [SERVER] for a in _ancestors(d)})
    args = [a for d in ancestors for a in ("--perms", "0755", "--dir", d)]
    args += [a for d in kept for a in ("--ro-bind", d, d)]
    for link in ("/lib", "/lib64"):  # merged-/usr systems: the loader's paths go through these
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
    # installed packages never enter the sandbox: sys.path.append cannot reach them
    hidden = {os.path.join(stdlib, "site-packages")}
    for d in kept:
        hidden.update(glob.glob(os.path.join(d, "python3*", "*-packages")) + glob.glob(os.path.join(d, "*-packages")))
    args += [a for h in sorted(hidden) if os.path.isdir(h) for a in ("--tmpfs", h)]
    if setpriv and os.geteuid() == 0:
        args += ["--ro-bind", os.path.realpath(setpriv), os.path.realpath(setpriv)]
    # /dev without its pty instance (a pty is a channel any process of the uid can open)
    args += ["--ro-bind", SERVER, SERVER, "--dev", "/dev", "--tmpfs", "/dev/pts", "--proc", "/proc"]
    return args


def bwrap_prefix(work_root: str) -> list[str] | None:
    """The bubblewrap command prefix for a server whose calls work under `work_root`, or None where
    bubblewrap is missing or cannot make namespaces here.

    The server runs as uid SANDBOX_UID with no capabilities and no_new_privs, in new user (when not
    root), PID, network, IPC, UTS and mount namespaces, as PID 1 of its PID namespace (no bubblewrap
    init that would outlive it: when the server ends, the kernel ends every process of the sandbox).
    Started by root, bubblewrap sets up the view as root and `setpriv` then switches to the real uid
    65534 (a user namespace would map the sandbox's uid back to root outside); started by anyone
    else, bubblewrap maps uid 65534 inside to the caller's own (unprivileged) uid. Everything in the
    view is read-only except `work_root`, on which each call mounts its own tmpfs."""
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
    # client's process ended, however it ended), and as PID 1 it takes the namespace with it.
    ns = ["--unshare-ipc", "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
          "--new-session", "--hostname", "sandbox"]
    reach = [a for d in _ancestors(work_root) for a in ("--perms", "0755", "--dir", d)]
    ro = ["--remount-ro", "/dev/pts", "--remount-ro", "/dev", "--remount-ro", "/"]
    cmd = [exe, *ns, *view, *reach, "--bind", work_root, work_root, *ro, "--chdir", "/", "--clearenv"]
    for k, v in server_env().items():
        cmd += ["--setenv", k, v]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        return cmd + ["--", os.path.realpath(setpriv), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                      "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return cmd[:1] + ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)] + cmd[1:] + ["--"]


def own_work_root(path: str) -> None:
    """The work root belongs to the sandbox's uid where that uid is a real one (root caller)."""
    if os.geteuid() == 0:
        os.chown(path, SANDBOX_UID, SANDBOX_UID)


def _probe(flags: list[str]) -> list[str] | None:
    """`unshare <flags>` as a command prefix if it works here (user namespaces may be disabled)."""
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


def server_env() -> dict[str, str]:
    # built from nothing: no variable of the caller reaches the server; a fixed hash seed makes set
    # iteration (and so printed output) the same across runs
    return {"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def server_cmd(prefix: list[str], *args: str) -> list[str]:
    # -S -s: no site-packages; -P: not the script's directory on sys.path; -B: no .pyc writes; not -I,
    # which would ignore PYTHONHASHSEED (the environment is ours anyway). The interpreter by its real
    # path: a virtual environment's directory is not in bubblewrap's view (nor needed: -S).
    return [*prefix, os.path.realpath(sys.executable), "-B", "-S", "-s", "-P", "-X", "utf8", SERVER, *args]


def prefixes(isolation: str, work_root: str) -> list[tuple[str, list[str]]]:
    """(level, command prefix) for a server working under `work_root`, strongest first, as far as
    `isolation` allows ("auto": all that work here)."""
    found: list[tuple[str, list[str]]] = []
    if isolation in ("auto", "bwrap"):
        prefix = bwrap_prefix(work_root)
        if prefix is not None:
            found.append(("bwrap", prefix))
        elif isolation == "bwrap":
            raise RuntimeError("sandbox: isolation 'bwrap' is not available here: install bubblewrap "
                               "(Debian: apt-get install bubblewrap) and allow user namespaces")
    for name, flags in _NAMESPACES:
        if isolation in ("auto", name) and (p := _probe(flags)) is not None:
            found.append((name, p))
    if isolation in ("auto", "hook"):
        found.append(("hook", []))
    if not found:
        raise RuntimeError(f"sandbox: isolation {isolation!r} is not available here (unshare failed)")
    return found
