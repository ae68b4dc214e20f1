"""Every `python -m flows.X` answers `--help` and stops there: no stage runs, no promotion, no MLflow
store, no Prefect server, no file written (`flows.promote --help` used to promote). A stray argument
is refused the same way, before any work. One interpreter runs every module (runpy), in a copy of the
repository, so the check costs one import of the stack."""

import subprocess
import sys

from tests.conftest import copy_worktree

FLOWS = ["synthesize", "sft", "rl", "distill", "evaluate", "promote", "ablation", "findings", "pipeline"]

SCRIPT = """
import runpy, sys, os
out = {}
for name, arg in [(n, a) for n in %r for a in ("--help", "--no-such-option")]:
    sys.argv = [os.path.join("flows", name + ".py"), arg]
    try:
        runpy.run_module("flows." + name, run_name="__main__")
        out[name, arg] = "returned"
    except SystemExit as e:
        out[name, arg] = e.code
print("RESULT", out)
"""


def test_every_flow_answers_help_and_refuses_stray_arguments_without_side_effects(tmp_path):
    repo = copy_worktree(tmp_path / "repo")
    before = {p.relative_to(repo) for p in repo.rglob("*")}
    res = subprocess.run([sys.executable, "-c", SCRIPT % FLOWS], cwd=repo, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = eval(res.stdout.split("RESULT", 1)[1])  # noqa: S307  (our own dict literal)
    for name in FLOWS:
        assert result[name, "--help"] == 0, (name, res.stdout[-2000:])
        assert result[name, "--no-such-option"] == 2, (name, res.stderr[-2000:])
        assert f"python -m flows.{name}" in res.stdout or name in ("rl", "pipeline")
    assert res.stdout.count("usage:") == len(FLOWS)
    created = {p for p in ({p.relative_to(repo) for p in repo.rglob("*")} - before) if "__pycache__" not in p.parts}
    assert not created, f"--help wrote files: {sorted(map(str, created))[:10]}"
