"""Every DVC stage depends on exactly the code it runs: editing a module marks stale the stages
that import it, and only those.

A stage's code is what its command imports (`python -m flows.<stage>`, and every environment family
where it plays environments: params choose which): every project file among
those modules must be covered by one of the stage's `deps` (a file or a directory), and every code
dep must hold a module the stage imports. Loading params.yaml also imports the task generators (the
synthesize section's knobs are checked by each family's own `check`): that code can refuse params,
never change a stage's outputs, so it is a dep of the synthesize stage only. Likewise the built-in
advantage estimators and policy losses (agentkiln.algos: params name them, and they are looked up in
the registry at load), a dep of the rl stages only. The test pins that it is nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("src/agentkiln/", "flows/", "tasks/")


def stages() -> dict[str, dict]:
    """Stage name -> {module, deps} (a foreach stage counted once: every item runs the same code)."""
    out = {}
    for name, st in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        body = st.get("do", st)
        module = body["cmd"].split("-m", 1)[1].split()[0]
        out[name] = {"module": module, "deps": [d for d in body["deps"] if d.startswith(CODE_ROOTS)]}
    return out


PARAMS_CHECK_ONLY = ("src/agentkiln/synthesis/", "src/agentkiln/algos/")  # see the module docstring


# third-party packages the stages import, loaded once before the per-stage forks (they hold no project
# module, so the project files each fork sees are those its stage module imports)
HEAVY = ("numpy", "pandas", "pyarrow", "torch", "transformers", "tokenizers", "mlflow", "prefect", "pandera",
         "great_expectations", "gymnasium", "textworld", "dvc.api")

PROBE = """
import importlib, json, os, sys
for name in HEAVY:
    try:
        importlib.import_module(name)
    except Exception:
        pass
for module, with_params in QUERIES:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fresh child per stage: it imports the stage module alone
        os.close(r)
        try:
            importlib.import_module(module)
            if 'agentkiln.envs' in sys.modules:  # a stage that plays environments runs whichever families params name
                from agentkiln.envs import FAMILIES, env_class
                [env_class(f) for f in FAMILIES]
            if with_params:
                from agentkiln.config import load_params
                load_params()
            out = json.dumps(sorted({getattr(m, '__file__', None) or '' for m in list(sys.modules.values())}))
            with os.fdopen(w, "w") as pipe:
                pipe.write(out)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe:
        files = json.loads(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert status == 0, (module, status)
    print(json.dumps([module, with_params, files]))
"""


@lru_cache(maxsize=None)
def _all_imports() -> dict[tuple[str, bool], frozenset[str]]:
    """Project files (relative paths) loaded by importing each stage's module (and, for one, loading
    params.yaml): one interpreter imports the heavy third-party packages once, then forks a child per query."""
    queries = sorted({(st["module"], False) for st in stages().values()} | {(stages()["sft"]["module"], True)})
    code = f"HEAVY = {HEAVY!r}\nQUERIES = {queries!r}\n{PROBE}"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("["):
            module, with_params, names = json.loads(line)
            files = set()
            for f in names:
                p = Path(f).resolve() if f else None
                if p is not None and p.is_relative_to(ROOT) and str(p.relative_to(ROOT)).startswith(CODE_ROOTS):
                    files.add(str(p.relative_to(ROOT)))
            found[(module, with_params)] = frozenset(files)
    return found


def imported(module: str, with_params: bool = False) -> frozenset[str]:
    """Project files (relative paths) loaded by importing `module` (and loading params.yaml)."""
    return _all_imports()[(module, with_params)]


def covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.mark.parametrize("stage", sorted(stages()))
def test_stage_depends_on_every_module_it_imports(stage):
    st = stages()[stage]
    files = imported(st["module"])
    assert f"{st['module'].replace('.', '/')}.py" in files
    missing = sorted(f for f in files if not covered(f, st["deps"]))
    assert not missing, f"dvc.yaml stage {stage}: add these to its deps (it imports them): {missing}"


@pytest.mark.parametrize("stage", sorted(stages()))
def test_stage_depends_on_no_code_it_does_not_run(stage):
    st = stages()[stage]
    files = imported(st["module"])
    unused = [d for d in st["deps"] if not any(covered(f, [d]) for f in files)]
    assert not unused, f"dvc.yaml stage {stage}: these deps hold no module it imports: {unused}"


def test_loading_params_imports_only_the_generators_checks():
    st = stages()["sft"]
    extra = imported(st["module"], with_params=True) - imported(st["module"])
    assert extra and all(f.startswith(PARAMS_CHECK_ONLY) for f in extra), sorted(extra)
