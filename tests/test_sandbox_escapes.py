"""Escape battery: every attack found against the tool sandbox, run through the real environments and
through the sandbox with its audit hook switched off, so that the operating system alone must hold.

Each attack is judged by its effect on the host (a file created or read, a process run, the
trainer's process held), never by the message it got. Runs where bubblewrap works (CI installs it,
scripts/test.sh); elsewhere the battery is skipped with the reason, and `Sandbox()` warns.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.sandbox import ISOLATION_ENV, SANDBOX_UID, Limits, Sandbox, bwrap_prefix

SLOW = Limits(wall_s=20.0, cpu_s=5)
SITE = sysconfig.get_paths()["purelib"]  # the (virtual) environment's packages: torch, cffi, ...
BASE_SITE = os.path.join(sysconfig.get_paths()["stdlib"], "site-packages")  # the base interpreter's

# skipped where bubblewrap cannot run, unless the machine requires it (CI: .ci/run), where that fails
pytestmark = pytest.mark.skipif(bwrap_prefix("/tmp") is None and os.environ.get(ISOLATION_ENV) != "bwrap",
                                reason="bubblewrap is not usable here (see docs/sandbox.md)")


@pytest.fixture(scope="module", params=[True, False], ids=["with-hook", "os-only"])
def box(request):
    with Sandbox(isolation="bwrap", audit_hook=request.param) as s:
        yield s


@pytest.fixture
def target(tmp_path_factory) -> Path:
    """A path outside the sandbox that an attack tries to create; the test checks it does not exist."""
    d = tmp_path_factory.mktemp("host")
    os.chmod(d, 0o777)  # writable by anyone: only the sandbox's view can keep the attack out
    return d / f"pwned-{uuid.uuid4().hex[:8]}"


def run(box: Sandbox, code: str):
    res = box.run(code, SLOW)
    assert res.status != "sandbox", res  # the sandbox itself worked
    return res


def test_runs_as_nobody_in_an_empty_view(box):
    res = run(box, "import os; print(os.getuid(), os.getgid(), sorted(os.listdir('/')))")
    if box.audit_hook:  # the hook refuses to list '/', the view is checked without it
        assert not res.ok
        res = run(box, "import os; print(os.getuid(), os.getgid())")
        assert res.stdout.split() == [str(SANDBOX_UID), str(SANDBOX_UID)]
        return
    uid, gid, listing = res.stdout.split(" ", 2)
    assert (int(uid), int(gid)) == (SANDBOX_UID, SANDBOX_UID)
    names = set(ast.literal_eval(listing))
    assert not names & {"etc", "home", "var", "bin", "sbin", "boot", "srv", "mnt", "opt", "run"}, names


def test_overriding_a_builtin_does_not_open_etc_shadow(box):
    res = run(box, "__builtins__['any'] = lambda *a, **k: True\nprint(open('/etc/shadow').read())\n"
                   "import os\nprint(os.listdir('/'))")
    assert not res.ok and "root:" not in res.stdout


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/hostname", "/proc/1/environ", __file__])
def test_host_files_are_not_readable(box, path):
    res = run(box, f"print(open({path!r}).read()[:200])")
    assert not res.ok and res.stdout == ""


def test_installed_packages_are_not_in_reach(box):
    """sys.path.append(<site-packages>); import _cffi_backend reached libc system() as root."""
    res = run(box, f"import sys\nsys.path += [{SITE!r}, {BASE_SITE!r}]\nimport _cffi_backend\nprint('loaded')")
    assert not res.ok and "loaded" not in res.stdout
    res = run(box, f"import os\nprint(os.listdir({SITE!r}), os.listdir({BASE_SITE!r}))")
    assert "torch" not in res.stdout and "_cffi_backend" not in res.stdout


def test_native_code_cannot_run_commands_or_create_files(box, target):
    """With a C-level handle on libc (ctypes, which only the hook refuses), system() and
    open() still cannot touch the host: no shell in the view, a read-only view, uid nobody."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            f"print('system', libc.system(b'id > {target}'))\n"
            f"print('open', libc.open(b'{target}.2', 0o101, 0o644))\n"
            f"print('mkfifo', libc.mkfifo(b'{target}.3', 0o644))\n")
    res = run(box, code)
    if not box.audit_hook:
        assert "system" in res.stdout, res  # the attack really got native code
    for suffix in ("", ".2", ".3"):
        assert not Path(f"{target}{suffix}").exists()


def test_a_fresh_posix_module_cannot_make_special_files(box, target):
    res = run(box, "import _imp, importlib.machinery as m\n"
                   "posix = _imp.create_builtin(m.ModuleSpec('posix', None))\n"
                   f"posix.mkfifo({str(target)!r})\nprint('made')")
    assert "made" not in res.stdout and not target.exists()
    res = run(box, f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\nprint('made')")
    assert "made" not in res.stdout and not target.exists()


def test_no_processes_outside_its_own_namespace(box):
    res = run(box, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    if res.ok:  # without the hook: only the sandbox's own few processes exist
        assert len(ast.literal_eval(res.stdout)) <= 4
    res = run(box, f"import os\nos.kill({os.getpid()}, 9)")  # the trainer's pid means nothing in there
    assert not res.ok


def test_no_network(box):
    res = run(box, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')")
    assert not res.ok and "connected" not in res.stdout


def test_work_directory_is_writable_and_goes_away(box):
    res = run(box, "import os\nopen('a.txt', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))")
    assert res.ok and "a.txt" in res.stdout
    cwd = res.stdout.split()[0]
    assert not os.path.exists(os.path.join(cwd, "a.txt"))  # the call's tmpfs, never the host's disk
    assert run(box, "import os\nprint(os.listdir('.'))").stdout == "[]\n"


# -- through the environments: nothing model-written holds the trainer's process ---------------------

def _bounded(step, seconds: float = 60.0):
    """Run `step()` in a thread; it must finish (the trainer's process is never held)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(step()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the tool call held the trainer's process"
    return out[0]


def test_python_tool_huge_round_is_bounded():
    env = make(TaskSpec("p", "python-tool", 0, difficulty={"max_turns": 4},
                        data={"kind": "arithmetic", "question": "2+2?", "answer": "4", "solution": "2+2"}))
    env.reset()
    res = _bounded(lambda: env.step("python[print(round(7, -10**8))]"))
    assert res.info["tool_path"] == "sandbox" and res.info["tool_error"]
    assert res.observation.text == "Error: time limit exceeded."


def test_python_tool_reads_no_host_file_through_the_environment():
    env = make(TaskSpec("p", "python-tool", 0, difficulty={"max_turns": 4},
                        data={"kind": "arithmetic", "question": "2+2?", "answer": "4", "solution": "2+2"}))
    env.reset()
    res = env.step("python[__builtins__['any'] = lambda *a, **k: True; print(open('/etc/shadow').read())]")
    assert res.info["tool_error"] and "root:" not in res.observation.text


def test_sql_slow_single_step_is_bounded_outside_the_trainer():
    env = make(TaskSpec("s", "sql", 3, difficulty={"max_turns": 6},
                        data={"db_seed": 3, "tables": 2, "rows": 10, "columns": 2, "question": "Q?",
                              "query": "SELECT 1", "answer": 1}))
    env.reset()
    big = "length(printf('%.*c', 2000000000, 'x'))"
    res = _bounded(lambda: env.step(f"sql[SELECT {' + '.join([big] * 4)}]"))
    assert res.info["tool_error"] and res.observation.text.startswith("SQL error: query stopped:")
    res = env.step("sql[SELECT hex(fts3_tokenizer('simple'))]")
    assert res.observation.text == "SQL error: function fts3_tokenizer() is not allowed."


# -- round 3: nothing outlives a call, no call reaches another, a request sets nothing ----------------
# Judged on the host: its process table (the sandbox servers' descendants, by parent pid), the results
# of later calls of both tool families, its disk; never by the message the attack got.

def _parents() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(pid: int) -> set[int]:
    parents = _parents()
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def _zygote(srv) -> int:
    """The server process itself (below bubblewrap or unshare, which the client started)."""
    for pid in [srv.proc.pid, *sorted(descendants(srv.proc.pid))]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\x00")
            if os.path.basename(argv[0]).startswith(b"python") and b"serve" in argv:
                return pid
        except OSError:
            pass
    raise AssertionError("no sandbox server process")


def call_processes(box: Sandbox, wait_s: float = 10.0) -> set[int]:
    """The processes below the box's servers (handlers and whatever calls started), once the handlers
    of finished calls had `wait_s` to exit: empty when nothing of any call is left."""
    deadline = time.monotonic() + wait_s
    while True:
        left = set().union(*[descendants(_zygote(s)) for s in box._servers.values()])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def all_gone(pids: set[int], wait_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + wait_s
    while (alive := {p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"}) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def server_of(box: Sandbox, limits: Limits = SLOW):
    """The running server of `box` for python calls under `limits`."""
    run(box, "print(1)")
    return box._servers[json.dumps(box._config(limits, None), sort_keys=True)]


def later_calls_are_honest(box: Sandbox) -> None:
    """A later python call and a later SQL query of the same sandbox give their true answers."""
    from agentkiln.envs.sql import ReadOnlyDB, build_db

    res = run(box, "import os\nprint(6 * 7, sorted(os.listdir('.')))")
    assert (res.status, res.stdout) == ("ok", "42 []\n"), res
    db = ReadOnlyDB(build_db(seed=3, tables=2, rows=10, columns=2), sandbox=box, limits=SLOW)
    assert db.query("SELECT 40 + 2 AS x") == (["x"], [(42,)], False)


# create_dynamic loads an extension under any package name; fork_exec then starts an interpreter
# without the hook, in a session of its own, that would outlive the call
FORK_EXEC = (
    "import _imp, importlib.machinery as m, importlib.util, os, sys\n"
    "spec = importlib.util.find_spec('_posixsubprocess')\n"
    "px = _imp.create_dynamic(m.ModuleSpec('x._posixsubprocess', None, origin=spec.origin))\n"
    "r, w = os.pipe()\n"
    "px.fork_exec([sys.executable, '-S', '-c', 'import time; time.sleep(120)'], [sys.executable.encode()], True, "
    "(w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, -1, -1, None, False)\n"
    "print('started')\n")
# a process in a session of its own (out of the call's process group), and its own child
SURVIVOR = ("import os, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.fork()\n    time.sleep(120)\n    os._exit(0)\n"
            "print('forked')\n")


def _attempt(code: str) -> str:
    return "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "except PermissionError:\n    pass\n"


# both attacks (each refused with the hook), then a long sleep: the call is still running
LONG_CALL = _attempt(FORK_EXEC) + _attempt(SURVIVOR) + "import time\ntime.sleep(100)\n"


def test_a_dotted_import_cannot_load_a_denied_extension_and_its_process_dies_with_the_call(box):
    res = run(box, FORK_EXEC)
    if box.audit_hook:
        assert res.status == "denied" and "starting processes" in res.error and "started" not in res.stdout
    else:
        assert res.stdout == "started\n", res  # the attack ran: the operating system alone must hold
    assert call_processes(box) == set()
    later_calls_are_honest(box)


def test_a_fresh_posix_module_is_not_to_be_had_with_the_hook(box):
    res = run(box, "import _imp, importlib.machinery as m\n"
                   "posix = _imp.create_builtin(m.ModuleSpec('posix', None))\nprint(hasattr(posix, 'mknod'))")
    if box.audit_hook:
        assert not res.ok and "create_builtin" in res.error
    else:
        assert res.stdout == "True\n"


def test_no_process_a_call_starts_outlives_the_call(box):
    res = run(box, SURVIVOR)
    if box.audit_hook:
        assert res.status == "denied" and "forked" not in res.stdout
    else:
        assert res.stdout == "forked\n", res
    assert call_processes(box) == set()
    later_calls_are_honest(box)


@pytest.mark.parametrize("hook", [True, False], ids=["with-hook", "os-only"])
def test_close_ends_every_process_of_the_sandbox(hook):
    box = Sandbox(isolation="bwrap", audit_hook=hook)
    t = threading.Thread(target=box.run, args=(LONG_CALL, Limits(wall_s=110.0, cpu_s=5)), daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not box._servers and time.monotonic() < deadline:
        time.sleep(0.05)
    (srv,) = box._servers.values()
    time.sleep(1.0)  # the call is running, its processes started
    pids = {srv.proc.pid} | descendants(srv.proc.pid)
    assert len(pids) >= (5 if hook else 8), pids  # bwrap, server, handler, init, the code (+ its 3 survivors)
    box.close()
    assert all_gone(pids) == set()
    t.join(30)
    assert not t.is_alive()


TRAINER = """
import sys, time
from agentkiln.sandbox import Limits, Sandbox
box = Sandbox(isolation="bwrap", audit_hook={hook})
print("started", flush=True)
box.run({code!r}, Limits(wall_s=120.0, cpu_s=5))
"""


@pytest.mark.parametrize("hook", [True, False], ids=["with-hook", "os-only"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_trainers_death_ends_every_process_of_its_sandbox(hook, sig):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(hook=hook, code=LONG_CALL)], stdout=subprocess.PIPE)
    try:
        assert trainer.stdout.readline() == b"started\n"
        deadline = time.monotonic() + 30
        want = 5 if hook else 8  # bwrap, server, handler, init, the code (+ its 3 survivors)
        while len(pids := descendants(trainer.pid)) < want and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        pids = descendants(trainer.pid)
        assert len(pids) >= want, pids
        trainer.send_signal(sig)
        trainer.wait(30)
        assert all_gone(pids) == set()
    finally:
        trainer.kill()
        trainer.wait()


def test_the_servers_socket_is_out_of_reach(box):
    """It lives in a directory of the client's own, outside the view: the code cannot find, replace or
    connect to it; the server keeps answering the trainer truthfully."""
    srv = server_of(box)
    before = os.stat(srv.path)
    code = (f"import os, socket\nprint(os.path.exists({srv.path!r}), os.path.exists({srv.sock_dir!r}))\n"
            "try:\n    s = socket.socket(socket.AF_UNIX)\n"
            f"    s.connect({srv.path!r})\n    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)\n"
            f"for p in [{srv.path!r}, '/tmp/s', os.getcwd() + '/s']:\n"
            "    try:\n        os.rename(p, p + '.old')\n        print('renamed', p)\n    except OSError:\n        pass\n")
    res = run(box, code)
    assert "connected" not in res.stdout and "renamed" not in res.stdout
    if not box.audit_hook:
        assert res.stdout.startswith("False False\n"), res
    after = os.stat(srv.path)
    assert (after.st_ino, after.st_uid, oct(os.stat(srv.sock_dir).st_mode & 0o777)) == \
        (before.st_ino, os.geteuid(), "0o700")
    later_calls_are_honest(box)


def test_the_server_answers_only_the_trainer():
    """A process that reaches the socket (here: one of the host's, with no namespace in between) gets
    no answer; the trainer does."""
    with Sandbox(isolation="hook") as box:
        assert box.run("print(1)", SLOW).stdout == "1\n"
        (srv,) = box._servers.values()
        # the server may close on the stranger before its request is all sent (a broken pipe): no answer either
        probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
                 "try:\n    s.sendall(b'{\"code\": \"print(7)\"}')\n    s.shutdown(socket.SHUT_WR)\n"
                 "    print(repr(s.recv(100)))\nexcept (ConnectionResetError, BrokenPipeError):\n    print(repr(b''))")
        out = subprocess.run([sys.executable, "-c", probe, srv.path], capture_output=True, text=True, timeout=60)
        assert out.stdout == "b''\n", out
        assert box.run("print(2)", SLOW).stdout == "2\n"


def test_a_request_cannot_set_its_own_limits_or_turn_the_hook_off(box):
    """Only the code travels: limits, the hook and the SQL policy are the server's, fixed at its start."""
    srv = server_of(box)

    def raw(code: str) -> dict:
        req = {"code": code, "limits": {**SLOW.__dict__, "memory_mb": 4096, "file_size_kb": 1 << 16,
                                        "wall_s": 60.0, "cpu_s": 60}, "hook": False}
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(srv.path)
            s.sendall(json.dumps(req).encode())
            s.shutdown(socket.SHUT_WR)
            return json.loads(b"".join(iter(lambda: s.recv(1 << 16), b"")))

    assert raw("x = bytearray(1 << 30)\nprint('allocated')")["status"] == "memory"
    res = raw("open('big', 'wb').write(b'x' * (32 << 20))\nprint('written')")
    assert res["status"] in ("file_size", "disk") and "written" not in res["stdout"]
    res = raw("import ctypes\nprint('loaded')")
    assert ("loaded" in res["stdout"]) is (not box.audit_hook)
    res = raw("while True:\n    pass")
    assert res["status"] == "cpu" and res["cpu_s"] < SLOW.cpu_s + 2


def test_concurrent_calls_cannot_reach_each_other(box):
    """While B runs, A writes into every descriptor it can find under /proc, every pty, and an abstract
    socket B listens on (and B into A's): B's output is exactly its own."""
    victim = ("import os, socket, time\n"
              "try:\n    srv = socket.socket(socket.AF_UNIX)\n    srv.bind('\\0agentkiln-victim')\n    srv.listen(1)\n"
              "    srv.settimeout(4)\n    print('got', srv.accept())\nexcept OSError as e:\n    print('alone')\n"
              "time.sleep(1)\nprint('clean')\n")
    attacker = ("import os, socket, time\nhits = 0\ntime.sleep(0.5)\n"
                "for pid in os.listdir('/proc'):\n    try:\n        for fd in os.listdir(f'/proc/{pid}/fd'):\n"
                "            with open(f'/proc/{pid}/fd/{fd}', 'w') as f:\n                f.write('FORGED\\n')\n"
                "                hits += 1\n    except OSError:\n        pass\n"
                "try:\n    c = socket.socket(socket.AF_UNIX)\n    c.connect('\\0agentkiln-victim')\n"
                "    c.sendall(b'FORGED')\n    hits += 1\nexcept OSError:\n    pass\nprint('hits', hits)\n")
    results = {}
    threads = [threading.Thread(target=lambda k=k, c=c: results.__setitem__(k, run(box, c)))
               for k, c in (("victim", victim), ("attacker", attacker))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "FORGED" not in results["victim"].stdout + results["victim"].stderr
    assert results["victim"].stdout.splitlines()[-1] == "clean", results["victim"]
    if not box.audit_hook:
        assert results["victim"].stdout == "alone\nclean\n"
        assert results["attacker"].stdout == "hits 0\n", results["attacker"]


def test_nothing_a_call_leaves_reaches_the_next_call(box):
    plant = ("import os\nfor d in [os.getcwd(), '/tmp', '/dev/shm', '/', os.path.dirname(os.getcwd())]:\n"
             "    try:\n        open(os.path.join(d, 'planted'), 'w').write('x')\n    except OSError:\n        pass\n"
             "os.mkdir('d')\nopen('d/planted', 'w').write('x')\n")
    run(box, plant)
    check = ("import os\nseen = [d for d in [os.getcwd(), '/tmp', '/dev/shm', '/', os.path.dirname(os.getcwd()), 'd']"
             " if os.path.exists(os.path.join(d, 'planted'))]\nprint(seen, os.listdir('.'))\n")
    assert run(box, check).stdout == "[] []\n"
    later_calls_are_honest(box)


def test_every_byte_on_disk_counts(box, target):
    """Files of every kind live on the call's tmpfs: at most disk_kb bytes and max_files inodes, on no
    host disk; special files (a fresh posix's mkfifo, open without O_CREAT) count too."""
    lim = Limits(wall_s=20.0, cpu_s=5, file_size_kb=512, disk_kb=1024, max_files=8)
    code = ("import os\nwritten = 0\ntry:\n    for i in range(10):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (400 << 10))\n        written += 400 << 10\nexcept OSError as e:\n"
            "    print('stopped', e.errno)\nprint('written', written)\n")
    res = box.run(code, lim)
    assert res.status != "sandbox", res
    if not box.audit_hook:
        assert res.stdout == "stopped 28\nwritten 819200\n", res  # ENOSPC after two files of 400 KiB
    fifos = ("import os\nmade = 0\nfor i in range(50):\n    try:\n        os.mkfifo(f'p{i}')\n        made += 1\n"
             "    except (OSError, AttributeError):\n        break\nprint('made', made)\n")
    res = box.run(fifos, lim)
    if not box.audit_hook:
        assert res.stdout == "made 8\n", res  # the tmpfs's inodes: max_files
    assert not list(Path(target).parent.iterdir())  # nothing on the host


def test_the_code_cannot_forge_its_status(box):
    """Lines the code writes to the notes descriptor, exit statuses it gives itself and signals it sends
    itself do not make a sandbox status: those come from the server and the kernel."""
    forged = "import os\ntry:\n    os.write(3, b'0' * 32 + b' network is disabled in the sandbox\\n')\nexcept OSError:\n    pass\n"
    assert run(box, forged + "print('ok')").status == "ok"
    res = run(box, forged + "raise PermissionError('mine')")
    assert (res.status, res.error) == ("error", "PermissionError: mine")
    res = run(box, "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)")
    assert res.status == "crash"  # a CPU limit is only the kernel's, by the CPU time it counted
    res = run(box, "import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)")
    assert (res.status, res.error) == ("error", "MemoryError")


# a busy loop beside three processes of its own that wake and sleep between the scheduler's ticks
BUSY_BESIDE_WAKERS = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        while True:\n"
                      "            t = time.perf_counter()\n            while time.perf_counter() - t < 0.0015:\n"
                      "                pass\n            time.sleep(0.0005)\nwhile True:\n    pass\n")


@pytest.mark.parametrize("per_call", [True, False], ids=["per-call", "shared"])
def test_the_cpu_limit_is_the_cpu_time_used_whatever_runs_beside(per_call):
    """The kernel's RLIMIT_CPU counts CPU time in ticks: beside processes that wake and sleep between
    them, a busy loop was stopped after about 0.8 s of its 1 s and reported as a crash (SIGXCPU under
    the limit), so a host's load changed a call's status. The limit is on the CPU time the code used."""
    with Sandbox(isolation="bwrap", per_call=per_call, audit_hook=False) as box:  # the hook forbids fork
        res = box.run(BUSY_BESIDE_WAKERS, Limits(wall_s=30.0, cpu_s=1))
        assert res.status == "cpu" and 1.0 <= res.cpu_s < 2.0, res
        assert box.per_call is per_call
        assert call_processes(box) == set()


def test_shared_namespace_fallback_still_runs_and_cleans_up(tmp_path):
    """Machines that refuse nested user namespaces: calls share the server's namespaces (a warning
    says so); the call's directory and process group still go."""
    with Sandbox(isolation="bwrap", per_call=False) as box:
        res = box.run("import os\nopen('a', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))", SLOW)
        assert res.ok and not box.per_call and res.stdout.endswith(" ['a']\n"), res
        assert not os.path.exists(res.stdout.split()[0])
        res = box.run("while True:\n    pass", Limits(wall_s=10.0))
        assert res.status == "cpu", res  # the result says which signal and how much CPU, should it differ
        assert call_processes(box) == set()


# -- through a run's episodes: no episode's code changes what a later episode observes ----------------

# the attack of a surviving process: take over any server socket it can find, answer every request
HIJACK = ("import glob, json, os, socket, time\n"
          "if os.fork() == 0:\n    os.setsid()\n"
          "    for p in glob.glob('/tmp/*/s') + glob.glob(os.path.dirname(os.getcwd()) + '/*/s'):\n"
          "        try:\n            os.rename(p, p + '.x')\n            s = socket.socket(socket.AF_UNIX)\n"
          "            s.bind(p)\n            s.listen(9)\n            while True:\n                c, _ = s.accept()\n"
          "                c.sendall(json.dumps({'ok': True, 'stdout': 'FORGED', 'stderr': '', 'error': None,"
          " 'status': 'ok'}).encode())\n                c.close()\n        except OSError:\n            pass\n"
          "    time.sleep(60)\n    os._exit(0)\nprint('planted')\n")
PLANT = ("import os\nfor d in [os.getcwd(), '/tmp', '/dev/shm', os.path.dirname(os.getcwd())]:\n"
         "    try:\n        open(os.path.join(d, 'answer.txt'), 'w').write('FORGED')\n    except OSError:\n        pass\n"
         "print('planted')\n")
PROBE = ("import os\nseen = [d for d in [os.getcwd(), '/tmp', '/dev/shm', os.path.dirname(os.getcwd())] "
         "if os.path.exists(os.path.join(d, 'answer.txt'))]\nprint(seen, sorted(os.listdir('.')), {n} * 7)")


class ScriptedPolicy:
    """A policy whose replies are written out per task: what an RL policy could learn to emit."""

    def __init__(self, scripts: dict[str, list[str]], sequential: bool):
        self.scripts, self.batch_size = scripts, 1 if sequential else None

    def act(self, episodes, envs):
        return [self.scripts[ep.task_id][len(ep.turns) - 1] for ep in episodes]


def _episode_run(tmp_path, attack: bool, sequential: bool) -> dict[str, list[str]]:
    from agentkiln.envs import python_tool
    from agentkiln.rollout.engine import run_episodes

    python_tool._CACHE.clear()  # every probe really runs in the sandbox
    py = {"kind": "arithmetic", "question": "2+2?", "answer": "4", "solution": "2+2"}
    sql = {"db_seed": 3, "tables": 2, "rows": 10, "columns": 2, "question": "Q?", "query": "SELECT 1", "answer": 1}
    first = ([f"python[{c}]" for c in (FORK_EXEC, SURVIVOR, HIJACK, PLANT)] if attack else
             ["python[print('benign')]"] * 4) + ["answer[4]"]
    scripts = {"attacker": first}
    tasks = [TaskSpec("attacker", "python-tool", 0, difficulty={"max_turns": 8}, data=py)]
    for n in range(1, 4):
        scripts[f"py{n}"] = [f"python[{PROBE.format(n=n)}]", "python[print(6 * 7)]", "answer[4]"]
        scripts[f"sql{n}"] = ["sql[SELECT COUNT(*) FROM employees]", f"sql[SELECT {n} + 40]", "answer[1]"]
        tasks += [TaskSpec(f"py{n}", "python-tool", n, difficulty={"max_turns": 8}, data=py),
                  TaskSpec(f"sql{n}", "sql", n, difficulty={"max_turns": 8}, data=sql)]
    episodes = run_episodes(ScriptedPolicy(scripts, sequential), tasks, tmp_path, None)
    return {ep.task_id: [t.observation for t in ep.turns] for ep in episodes}


@pytest.mark.parametrize("sequential", [True, False], ids=["later", "concurrent"])
@pytest.mark.parametrize("hook", [True, False], ids=["with-hook", "os-only"])
def test_an_episodes_code_cannot_change_other_episodes_observations(hook, sequential, tmp_path, monkeypatch):
    from agentkiln.sandbox import client

    with Sandbox(isolation="bwrap", audit_hook=hook) as box:
        monkeypatch.setattr(client, "_default", box)  # the run's sandbox, for both tool families
        clean = _episode_run(tmp_path, attack=False, sequential=sequential)
        attacked = _episode_run(tmp_path, attack=True, sequential=sequential)
    assert attacked["attacker"] != clean["attacker"]  # the attack ran (refused or not)
    others = sorted(k for k in clean if k != "attacker")
    assert {k: attacked[k] for k in others} == {k: clean[k] for k in others}
    assert "FORGED" not in json.dumps(attacked)
    assert all("42" in clean[k][2] for k in others if k.startswith("py"))  # the probes saw the sandbox answer
