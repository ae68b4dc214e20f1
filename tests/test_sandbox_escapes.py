"""Escape battery: every attack found against the tool sandbox, run through the real environments and
through the sandbox with its audit hook switched off, so that the operating system alone must hold.

Each attack is judged by its effect on the host (a file created or read, a process run, the
trainer's process held), never by the message it got. Runs where bubblewrap works (CI installs it,
scripts/test.sh); elsewhere the battery is skipped with the reason, and `Sandbox()` warns.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import threading
import uuid
from pathlib import Path

import pytest

from agentkiln.envs import TaskSpec, make
from agentkiln.sandbox import ISOLATION_ENV, SANDBOX_UID, Limits, Sandbox, _bwrap

SLOW = Limits(wall_s=20.0, cpu_s=5)
SITE = sysconfig.get_paths()["purelib"]  # the (virtual) environment's packages: torch, cffi, ...
BASE_SITE = os.path.join(sysconfig.get_paths()["stdlib"], "site-packages")  # the base interpreter's

# skipped where bubblewrap cannot run, unless the machine requires it (CI: .ci/run), where that fails
pytestmark = pytest.mark.skipif(_bwrap("/tmp") is None and os.environ.get(ISOLATION_ENV) != "bwrap",
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
    assert not os.path.exists(cwd)


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
