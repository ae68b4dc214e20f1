"""The tool sandbox (agentkiln.sandbox): escape attempts are contained and say why; ordinary code runs.

Timing-robust on a loaded 2-core machine: generous wall limits, and no assertion about how long a
run took beyond "it was stopped".
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from agentkiln.sandbox import Limits, Sandbox, SandboxResult, run_python

SLOW = Limits(wall_s=20.0)  # ordinary code on a loaded machine


@pytest.fixture(scope="module")
def sb():
    with Sandbox() as s:
        yield s


def blocked(res: SandboxResult, *words: str) -> None:
    """Contained, with a clear reason naming one of `words`."""
    assert not res.ok, res
    assert res.error, res
    assert any(w in res.error for w in words), res.error


# -- ordinary code ----------------------------------------------------------------------------------

def test_ordinary_code_runs(sb):
    code = "import json, math\ntotal = 0\nfor i in range(10):\n    total += i * i\n" \
           "print(total, math.sqrt(16))\nprint(json.dumps({'b': 1, 'a': [1, 2]}, sort_keys=True))"
    res = sb.run(code, SLOW)
    assert res.ok and res.status == "ok" and res.error is None and res.exit_code == 0
    assert res.stdout == '285 4.0\n{"a": [1, 2], "b": 1}\n'


def test_exceptions_and_exit_codes_are_reported(sb):
    res = sb.run("x = 1\nprint('before')\n1 / 0", SLOW)
    assert res.status == "error" and res.error == "ZeroDivisionError: division by zero"
    assert res.stdout == "before\n" and "line 3" in res.stderr and "sandbox.py" not in res.stderr
    assert sb.run("import sys; sys.exit(3)", SLOW).exit_code == 3
    res = sb.run("def f(:\n  pass", SLOW)
    assert res.status == "error" and res.error.startswith("SyntaxError")


def test_work_dir_is_private_and_removed(sb):
    res = sb.run("import os\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\nprint(os.getcwd())\n"
                 "print(sorted(os.listdir('.')), open('a.txt').read())", SLOW)
    assert res.ok, res
    cwd, listing = res.stdout.splitlines()
    assert listing == "['a.txt', 'd'] hi"
    assert not os.path.exists(os.path.join(cwd, "a.txt"))  # nothing of the call reached the host's disk
    again = sb.run("import os; print(os.listdir('.'))", SLOW)
    assert again.stdout == "[]\n"  # the next call starts empty


def test_outputs_are_deterministic(sb):
    code = "import random\nprint({'pear', 'apple', 'fig', 'kiwi', 'plum'}, random.random())"
    assert sb.run(code, SLOW).stdout == sb.run(code, SLOW).stdout


def test_run_python_default_sandbox_and_parallel_calls():
    assert run_python("print(6 * 7)", SLOW).stdout == "42\n"
    out: dict[int, str] = {}

    def call(i: int) -> None:
        out[i] = run_python(f"print({i} ** 2)", SLOW).stdout

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: f"{i * i}\n" for i in range(8)}


def test_a_dead_server_is_restarted_and_close_cleans_up():
    with Sandbox() as s:
        assert s.run("print(1)", SLOW).ok
        (first,) = s._servers.values()
        first.proc.kill()
        first.proc.wait()
        assert s.run("print(2)", SLOW).stdout == "2\n"
        (last,) = s._servers.values()
        assert last is not first and not os.path.exists(first.sock_dir) and os.path.isdir(last.sock_dir)
    assert not os.path.exists(last.sock_dir) and not os.path.exists(last.work_root)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb="big")
    with pytest.raises(TypeError):
        run_python(b"print(1)")


# -- network ----------------------------------------------------------------------------------------

def test_no_network_to_localhost(sb):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        res = sb.run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')", SLOW)
        blocked(res, "network")
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected


def test_no_network_to_external_ip(sb):
    blocked(sb.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)", SLOW), "network")


def test_no_dns(sb):
    blocked(sb.run("import socket\nprint(socket.gethostbyname('example.com'))", SLOW), "network")
    blocked(sb.run("import socket\nprint(socket.getaddrinfo('localhost', 80))", SLOW), "network")


def test_no_urllib(sb):
    blocked(sb.run("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=3)", SLOW), "network")


def test_network_blocked_without_namespaces_too():
    with Sandbox(isolation="hook") as s:
        res = s.run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))", SLOW)
        assert s.isolation == "hook"
        blocked(res, "network")


# -- files --------------------------------------------------------------------------------------------

def test_no_write_to_tmp(sb, tmp_path):
    target = tmp_path / "escaped.txt"
    blocked(sb.run(f"open({str(target)!r}, 'w').write('x')", SLOW), "writing outside")
    blocked(sb.run("open('/tmp/agentkiln-escape-test', 'w').write('x')", SLOW), "writing outside")
    assert not target.exists() and not Path("/tmp/agentkiln-escape-test").exists()


def test_no_write_to_home(sb):
    target = Path.home() / "agentkiln-escape-test.txt"
    blocked(sb.run(f"open({str(target)!r}, 'w').write('x')", SLOW), "writing outside")
    assert not target.exists()


def test_no_write_through_dotdot(sb):
    blocked(sb.run("open('../escaped.txt', 'w').write('x')", SLOW), "writing outside")
    blocked(sb.run("import os\nos.mkdir('d')\nopen('d/../../escaped.txt', 'w')", SLOW), "writing outside")


def test_no_chdir_out_and_write(sb, tmp_path):
    blocked(sb.run(f"import os\nos.chdir({str(tmp_path)!r})\nopen('x.txt', 'w').write('x')", SLOW), "leaving")
    assert list(tmp_path.iterdir()) == []


def test_no_deleting_or_renaming_outside(sb, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    blocked(sb.run(f"import os\nos.remove({str(victim)!r})", SLOW), "outside")
    blocked(sb.run(f"import os\nos.rename({str(victim)!r}, 'mine.txt')", SLOW), "outside")
    # shutil.rmtree's first step (lstat) is not audited: in bubblewrap's view the directory does not exist
    blocked(sb.run(f"import shutil\nshutil.rmtree({str(tmp_path)!r})", SLOW), "outside", "No such file")
    assert victim.read_text() == "keep me"


def test_no_shadow_style_files(sb):
    # mode "a" without writing: even if the sandbox failed, nothing would change (this may run as root)
    blocked(sb.run("open('/etc/shadow', 'a').close()", SLOW), "writing outside")
    blocked(sb.run("open('/etc/passwd', 'a').close()", SLOW), "writing outside")
    blocked(sb.run("print(open('/etc/shadow').read())", SLOW), "reading outside", "Permission", "No such file")


def test_no_links_or_directory_descriptors(sb):
    blocked(sb.run("import os\nos.symlink('/etc', 'etc')", SLOW), "links")
    blocked(sb.run("import os\nos.link('/etc/hostname', 'h')", SLOW), "links")
    code = "import os\nfd = os.open('/usr', os.O_RDONLY)\nos.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)"
    blocked(sb.run(code, SLOW), "outside")


def test_no_database_files(sb):
    blocked(sb.run("import sqlite3\nsqlite3.connect('/tmp/agentkiln-escape.db')", SLOW), "database")


# -- environment and other processes ------------------------------------------------------------------

def test_parent_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("AGENTKILN_TEST_SECRET", "hunter2")
    with Sandbox() as s:  # started after the secret was set
        res = s.run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('AGENTKILN_TEST_SECRET'))", SLOW)
        assert res.ok and "hunter2" not in res.stdout and res.stdout.splitlines()[1] == "None"
        assert "AGENTKILN_TEST_SECRET" not in res.stdout
        for path in ("f'/proc/{os.getppid()}/environ'", "'/proc/1/environ'", f"'/proc/{os.getpid()}/environ'"):
            res = s.run(f"import os\nprint(open({path}, 'rb').read())", SLOW)
            assert "hunter2" not in res.stdout
            blocked(res, "reading outside", "No such file", "Permission")


def test_no_os_system_subprocess_or_fork(sb):
    blocked(sb.run("import os\nos.system('echo pwned > /tmp/agentkiln-pwned')", SLOW), "starting processes")
    blocked(sb.run("import subprocess\nsubprocess.run(['ls'])", SLOW), "starting processes")
    blocked(sb.run("import os\nos.fork()", SLOW), "starting processes")
    blocked(sb.run("import os\nos.execv('/bin/sh', ['sh'])", SLOW), "starting processes")
    blocked(sb.run("import os\nos.posix_spawn('/bin/sh', ['sh'], {})", SLOW), "starting processes")
    assert not Path("/tmp/agentkiln-pwned").exists()


def test_fork_bomb(sb):
    blocked(sb.run("import os\nwhile True:\n    os.fork()", SLOW), "starting processes")


def test_no_signal_to_parent(sb):
    blocked(sb.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", SLOW), "signals")
    blocked(sb.run("import os, signal\nos.killpg(0, signal.SIGKILL)", SLOW), "signals")
    assert sb.run("print('still alive')", SLOW).stdout == "still alive\n"


def test_no_ctypes(sb):
    blocked(sb.run("import ctypes\nctypes.CDLL(None).system(b'true')", SLOW), "ctypes")


# -- resource limits ----------------------------------------------------------------------------------

def test_memory_bomb(sb):
    res = sb.run("x = bytearray(1 << 34)", SLOW)
    assert res.status == "memory" and res.error == "memory limit 256 MiB exceeded"
    # touching 256 MiB takes CPU time: a generous CPU limit, so that memory runs out first
    res = sb.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", Limits(wall_s=60.0, cpu_s=30))
    assert res.status == "memory" and "memory limit" in res.error


def test_infinite_loop_is_stopped(sb):
    res = sb.run("while True:\n    pass", Limits(cpu_s=1, wall_s=10.0))
    assert res.status in ("cpu", "timeout") and not res.ok
    assert res.error in ("CPU time limit 1 s exceeded", "timed out after 10 s (wall)")


def test_sleep_is_stopped(sb):
    res = sb.run("import time\ntime.sleep(60)", Limits(wall_s=1.0))
    assert res.status == "timeout" and res.error == "timed out after 1 s (wall)"


def test_huge_output_is_cut(sb):
    res = sb.run("while True:\n    print('x' * 1000)", Limits(output_bytes=4096, wall_s=20.0))
    assert res.status == "output" and res.error == "output truncated at 4096 bytes"
    assert len(res.stdout) == 4096 and set(res.stdout) <= {"x", "\n"}


def test_huge_file_is_cut(sb):
    res = sb.run("open('big', 'wb').write(b'x' * (8 << 20))", SLOW)
    assert res.status == "file_size" and res.error == "file size limit 1024 KiB exceeded"


def test_too_many_open_files(sb):
    res = sb.run("files = [open(f'f{i}', 'w') for i in range(500)]", Limits(max_files=1000, wall_s=20.0))
    assert res.status == "error" and "Too many open files" in res.error


def test_too_many_created_files(sb):
    res = sb.run("for i in range(500):\n    open(f'f{i}', 'w').close()", SLOW)
    blocked(res, "too many files")


def test_recursion_bomb(sb):
    res = sb.run("def f(n):\n    return f(n + 1)\nf(0)", SLOW)
    assert res.status == "error" and res.error.startswith("RecursionError")
    res = sb.run("import sys\nsys.setrecursionlimit(10 ** 7)\ndef f(n):\n    return f(n + 1)\nf(0)",
                 Limits(wall_s=10.0))
    assert not res.ok and res.status in ("cpu", "memory", "crash", "timeout", "error"), res


def test_thread_bomb(sb):
    code = "import threading, time\nfor _ in range(100000):\n" \
           "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
    res = sb.run(code, SLOW)
    assert not res.ok and res.status in ("error", "memory", "cpu", "timeout"), res
    assert res.error


# -- the audit hook itself ----------------------------------------------------------------------------

def test_audit_hook_cannot_be_removed_or_bypassed(sb):
    code = ("import sys, os\ndef is_open(fd):\n    try:\n        return os.fstat(fd) is not None\n"
            "    except OSError:\n        return False\n"
            "print([m for m in ('_posixsubprocess', 'subprocess', '_ctypes', 'ctypes', '_sqlite3') "
            "if m in sys.modules], [fd for fd in range(1000) if is_open(fd)])")
    res = sb.run(code, SLOW)
    assert res.stdout == "[] [0, 1, 2, 3]\n"  # nothing dangerous preloaded, no server descriptor left open
    blocked(sb.run("import sys\nsys.addaudithook(lambda *a: None)", SLOW), "audit hook")
    blocked(sb.run("import gc\nprint(len(gc.get_objects()))", SLOW), "gc introspection")
    blocked(sb.run("import sys\nsys.settrace(lambda *a: None)", SLOW), "tracing")
    blocked(sb.run("import _posixsubprocess", SLOW), "starting processes")
    blocked(sb.run("def f():\n    pass\nf.__code__ = (lambda: 1).__code__", SLOW), "function code")
    blocked(sb.run("import marshal\nmarshal.loads(marshal.dumps(compile('1', 'x', 'eval')))", SLOW), "code objects")
    blocked(sb.run("import sys\ndel sys.modules['posix']\nimport posix", SLOW), "disabled")
    blocked(sb.run("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", SLOW), "resource limits")


def test_spawn_mode_runs_and_contains():
    with Sandbox(mode="spawn") as s:
        assert s.run("print(sum(range(5)))", SLOW).stdout == "10\n"
        blocked(s.run("import os\nos.system('true')", SLOW), "starting processes")


def test_a_long_temporary_directory_path_still_gives_a_socket(tmp_path, monkeypatch):
    """A run's private TMPDIR under a deep directory: the socket's path must still fit a Unix socket
    address (108 bytes), so its directory goes to /tmp."""
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with Sandbox() as s:
        assert s.run("print(6 * 7)", SLOW).stdout == "42\n"
        (srv,) = s._servers.values()
        assert srv.work_root.startswith(str(deep)) and len(srv.path) <= 107


def test_a_forked_process_gets_servers_of_its_own():
    """A pool worker forked from the trainer: its calls go to servers it starts (the parent's would
    refuse it as a peer), and the parent's keep answering the parent."""
    with Sandbox() as s:
        assert s.run("print(1)", SLOW).ok
        (parent_srv,) = s._servers.values()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                res = s.run("print(2)", SLOW)
                (srv,) = s._servers.values()
                os.write(w, f"{res.stdout.strip()} {srv.proc.pid != parent_srv.proc.pid}".encode())
                s.close()
            finally:
                os._exit(0)
        os.close(w)
        out = os.read(r, 100).decode()
        os.close(r)
        os.waitpid(pid, 0)
        assert out == "2 True"
        assert s.run("print(3)", SLOW).stdout == "3\n" and parent_srv.alive()
