"""`agentkiln doctor`: is this machine ready to run the pipeline? Each check reports ok / warn /
FAIL with the fix; nothing is written (the MLflow store is probed, not created)."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from agentkiln.config import PARAMS_FILE, ParamsError, load_params
from agentkiln.paths import repo_root
from agentkiln.tracking import store_dir

PACKAGES = ("torch", "transformers", "prefect", "mlflow", "dvc", "sqlalchemy", "gymnasium", "peft", "deepspeed")


@dataclass
class Check:
    name: str
    status: str  # ok | warn | FAIL
    detail: str
    fix: str = ""


def _reachable(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def run_checks(cwd: Path) -> list[Check]:
    checks = []
    v = sys.version_info
    checks.append(Check("python", "ok" if v[:2] == (3, 11) else "FAIL", sys.version.split()[0],
                        "" if v[:2] == (3, 11) else "agentkiln pins Python 3.11: bash scripts/setup.sh"))
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    missing = [p for p, ver in versions.items() if ver is None]
    checks.append(Check("packages", "FAIL" if missing else "ok",
                        ", ".join(f"{p} {ver}" for p, ver in versions.items() if ver),
                        f"missing {', '.join(missing)}: bash scripts/setup.sh" if missing else ""))
    sa = versions.get("sqlalchemy") or "0"
    if not sa.startswith("2.0."):
        checks.append(Check("sqlalchemy", "FAIL", sa, "Prefect 3.8's scheduler needs SQLAlchemy 2.0: pip install 'sqlalchemy<2.1'"))
    checks.append(_sandbox_check())
    root = repo_root()
    in_project = (root / "dvc.yaml").is_file() and (root / ".git").exists()
    checks.append(Check("project", "ok" if in_project else "FAIL", str(root),
                        "" if in_project else "run from a git clone of agentkiln (DVC needs the git repository)"))
    if (root / PARAMS_FILE).is_file():
        try:
            load_params(root / PARAMS_FILE)
            checks.append(Check("params", "ok", str(root / PARAMS_FILE)))
        except ParamsError as e:
            checks.append(Check("params", "FAIL", str(e).splitlines()[0], "fix params.yaml (docs/pipeline.md: Parameters)"))
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and uri.startswith(("http://", "https://")):
        why = _reachable(uri.rstrip("/") + "/health")
        checks.append(Check("mlflow", "FAIL" if why else "ok", f"server {uri}" + (f": {why}" if why else ""),
                            "start the tracking server (docs/team.md) or unset MLFLOW_TRACKING_URI" if why else ""))
    else:
        store = Path(uri.removeprefix("sqlite:///")) if uri and uri.startswith("sqlite:///") else store_dir() / "mlflow.db"
        where = store if store.exists() else store.parent
        ok = os.access(where, os.W_OK)
        checks.append(Check("mlflow", "ok" if ok else "FAIL",
                            f"SQLite store {store}" + ("" if store.exists() else " (created by the first run)"),
                            "" if ok else f"{where} is not writable"))
    api = os.environ.get("PREFECT_API_URL")
    if api:
        why = _reachable(api.rstrip("/") + "/health")
        checks.append(Check("prefect", "FAIL" if why else "ok", f"API {api}" + (f": {why}" if why else ""),
                            "start it (agentkiln ui / prefect server start) or unset PREFECT_API_URL" if why else ""))
    else:
        checks.append(Check("prefect", "ok", "no PREFECT_API_URL: each run starts a temporary server",
                            "schedules need a long-lived server: agentkiln ui"))
    try:
        import torch

        gpu = torch.cuda.is_available()
        checks.append(Check("gpu", "ok", torch.cuda.get_device_name(0) if gpu else "none: compute.device auto runs on CPU"))
    except ImportError:
        pass
    return checks


def _sandbox_check() -> Check:
    """Run one call in the tool sandbox: the isolation it got, and whether calls get namespaces of their own."""
    from agentkiln.sandbox import Sandbox

    if shutil.which("bwrap") is None:
        return Check("sandbox", "warn", "bubblewrap not found",
                     "model-written code runs with weaker isolation (docs/sandbox.md): apt-get install bubblewrap")
    with Sandbox() as box:
        res = box.run("print(6 * 7)")
    if res.stdout != "42\n":
        return Check("sandbox", "FAIL", res.error or res.status, "see docs/sandbox.md (isolation levels)")
    detail = f"{box.isolation}, {'a namespace per call' if box.per_call else 'calls share namespaces'}"
    if box.isolation == "bwrap" and box.per_call:
        return Check("sandbox", "ok", detail)
    return Check("sandbox", "warn", detail, "allow unprivileged user namespaces for full isolation (docs/sandbox.md)")
