#!/usr/bin/env python
"""Write one pipeline run's row into the run log (docs/runs.md).

    python scripts/run_log.py                                   # the last finished pipeline run of this repository
    python scripts/run_log.py --repo ../clone --out docs/runs.md --note "fresh clone, 58 min 45 s with setup"

The row comes from the run's MLflow parent run `pipeline` (its date, the commit it logged, the headline
success of each policy on the test panel) and its child runs, one per stage (the wall time of each),
plus dvc.lock (the torch threads the stages ran with). The store is the one the pipeline writes:
MLFLOW_TRACKING_URI, else REPO/mlflow.db. A SQLite store is read from a snapshot, so nothing is written
into the run's repository. The row of a run already in the log is replaced; a new run's row is appended.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

HEADER = ("| date | commit | run | model | CPU | threads | synthesize | base | sft | rl | distill | evaluate "
          "| all stages | test: base | test: sft | test: rl | test: distilled | note |")
STAGES = ("synthesize", "base", "sft", "rl", "distill", "evaluate")
POLICIES = ("base", "sft", "rl", "distilled")
SECTIONS = ("synthesize", "sft", "distill", "evaluate")  # stages whose MLflow params are their params.yaml section
TEMPLATE = f"""# Run log

One row per measured run of the pipeline (`bash scripts/run_pipeline.sh`, or a profile of it): where it
ran, how long each stage took and what each policy scored on the frozen test panel (greedy success).
`python scripts/run_log.py` writes a run's row from its MLflow parent run and `dvc.lock`.

{HEADER}
{"|---" * HEADER.count(" | ")}|---|
"""


class RunLogError(Exception):
    """A missing input, said in one line with the next step."""


def git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def default_repo() -> Path:
    top = git(Path.cwd(), "rev-parse", "--show-toplevel")
    return Path(top) if top else Path.cwd()


def store_uri(repo: Path, given: str | None) -> str:
    """The store the pipeline of `repo` writes (agentkiln.tracking): --tracking-uri, MLFLOW_TRACKING_URI,
    AGENTKILN_MLFLOW_DIR/mlflow.db, else REPO/mlflow.db."""
    if given:
        return given
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    base = Path(os.environ.get("AGENTKILN_MLFLOW_DIR") or repo)
    return "sqlite:///" + str((base / "mlflow.db").resolve())


def readable_store(uri: str, tmp: Path) -> str:
    """A SQLite store is copied (SQLite's backup, from a read-only connection) and the copy opened:
    MLflow's store may write into a database it opens. Other stores are read where they are."""
    if not uri.startswith("sqlite:///"):
        return uri
    db = Path(uri[len("sqlite:///"):])
    if not db.is_file():
        raise RunLogError(f"no MLflow store at {db}: run the pipeline there first (bash scripts/run_pipeline.sh), "
                          "or name the store with --tracking-uri")
    copy = tmp / "mlflow.db"
    try:
        src = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        with sqlite3.connect(copy) as dst:
            src.backup(dst)
        src.close()
    except sqlite3.Error as e:
        raise RunLogError(f"cannot read the MLflow store {db} ({e}): is it a SQLite file the pipeline wrote?") from None
    return "sqlite:///" + str(copy)


def find_runs(uri: str, experiment: str, run_id: str | None):
    """The parent run (the last FINISHED `pipeline` run, or --run-id) and its child runs."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri=uri)
    try:
        exp = client.get_experiment_by_name(experiment)
    except MlflowException as e:
        raise RunLogError(f"cannot open the MLflow store {uri}: {e.message}") from None
    if exp is None:
        raise RunLogError(f"no experiment {experiment!r} in the MLflow store {uri}: the pipeline has not run "
                          "there (bash scripts/run_pipeline.sh), or pass --experiment NAME")
    if run_id:
        try:
            parent = client.get_run(run_id)
        except MlflowException:
            raise RunLogError(f"no run {run_id} in the MLflow store {uri}: leave out --run-id to take the last "
                              "finished pipeline run") from None
        if parent.data.tags.get("agentkiln.stage") != "pipeline":
            raise RunLogError(f"run {run_id} is not a pipeline run (its stage: "
                              f"{parent.data.tags.get('agentkiln.stage', 'none')}): name a `pipeline` parent run")
    else:
        runs = client.search_runs([exp.experiment_id], filter_string="tags.`agentkiln.stage` = 'pipeline'",
                                  order_by=["attributes.start_time DESC"], max_results=200)
        finished = [r for r in runs if r.info.status == "FINISHED"]
        if not finished:
            seen = ", ".join(sorted({r.info.status for r in runs})) or "none"
            raise RunLogError(f"no finished pipeline run in experiment {experiment!r} of {uri} ({len(runs)} "
                              f"pipeline run(s), status: {seen}): run the pipeline to its end "
                              "(bash scripts/run_pipeline.sh), then run this again")
        parent = finished[0]
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                  max_results=1000)
    return parent, children


def clock(ms: float | None) -> str:
    if ms is None:
        return "-"
    s = int(round(ms / 1000))
    h, m, s = s // 3600, s % 3600 // 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def stage_of(run) -> str | None:
    name = run.data.tags.get("agentkiln.stage") or run.info.run_name or ""
    if name.startswith("rl-") or name == "rl":
        return "rl"
    return name if name in STAGES else None


def stage_times(children) -> dict[str, float]:
    """Wall time per stage column in ms (every RL stage summed into `rl`); a stage DVC skipped has no run."""
    out: dict[str, float] = {}
    for r in children:
        col = stage_of(r)
        if col and r.info.end_time and r.info.start_time:
            out[col] = out.get(col, 0.0) + (r.info.end_time - r.info.start_time)
    return out


def flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def disagreement(params_file: dict, children) -> str | None:
    """The first string setting on which a params.yaml-shaped dict and the run's logged params differ
    (e.g. sft.model.source), or None: a dvc.lock or params.yaml of another run is not this run's."""
    for r in children:
        section = r.data.tags.get("agentkiln.stage")
        if section not in SECTIONS or not isinstance(params_file.get(section), dict):
            continue
        for key, value in flat(params_file[section]).items():
            logged = r.data.params.get(key)
            if isinstance(value, str) and logged is not None and logged != value[:len(logged)]:
                return f"{section}.{key}: {value!r} there, {logged!r} in the run"
    return None


def threads_of(repo: Path, children, given: str | None) -> tuple[str, str]:
    """(threads, where from): --threads, dvc.lock's stages' torch_threads, else params.yaml's, whichever
    describes this run."""
    import yaml

    if given:
        return given, "--threads"
    why = []
    lock = repo / "dvc.lock"
    if lock.is_file():
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        per_stage = [s.get("params", {}).get("params.yaml", {}) for s in stages.values() if isinstance(s, dict)]
        merged: dict = {}
        for p in per_stage:
            merged.update({k: v for k, v in p.items() if k not in merged})
        differs = disagreement(merged, children)
        threads = sorted({str(p["torch_threads"]) for p in per_stage if "torch_threads" in p})
        if differs:
            why.append(f"dvc.lock is not this run's ({differs})")
        elif threads:
            return "/".join(threads), "dvc.lock"
        else:
            why.append("dvc.lock names no torch_threads")
    else:
        why.append(f"no dvc.lock in {repo}")
    params = repo / "params.yaml"
    if params.is_file():
        p = yaml.safe_load(params.read_text()) or {}
        differs = disagreement(p, children)
        if not differs and "torch_threads" in p:
            print(f"run_log: {'; '.join(why)}: torch_threads from params.yaml", file=sys.stderr)
            return str(p["torch_threads"]), "params.yaml"
        why.append(f"params.yaml is not this run's ({differs})" if differs else "params.yaml names no torch_threads")
    raise RunLogError(f"cannot tell the run's torch threads: {'; '.join(why)}: pass --threads N")


def cpu_of(parent, given: str | None) -> str:
    if given:
        return given
    host = parent.data.tags.get("agentkiln.host")
    here = socket.gethostname()
    if host and host != here:
        raise RunLogError(f"the run was made on host {host!r}, this is {here!r}: pass --cpu \"<model>, <n> cores\"")
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import platform

    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip() or "-"


def build_row(repo: Path, parent, children, cpu: str | None, threads: str | None, note: str) -> tuple[str, str]:
    """(the run's key in the log, its table row)."""
    info = parent.info
    date = dt.datetime.fromtimestamp(info.start_time / 1000, dt.timezone.utc).strftime("%Y-%m-%d")
    logged = parent.data.tags.get("mlflow.source.git.commit")
    head = git(repo, "rev-parse", "HEAD")
    commit = (logged or head or "-")[:7]
    if logged and head and logged != head:
        print(f"run_log: the run logged commit {logged[:7]}; {repo}'s HEAD is {head[:7]} now (the row names the run's)",
              file=sys.stderr)
    model = next((r.data.params["model.source"] for r in children
                  if r.data.tags.get("agentkiln.stage") in ("base", "sft") and "model.source" in r.data.params), "-")
    n_threads, _ = threads_of(repo, children, threads)
    times = stage_times(children)
    metrics = parent.data.metrics
    success = [f"{100 * metrics[f'{p}/test']:.1f}%" if f"{p}/test" in metrics else "-" for p in POLICIES]
    key = info.run_id[:8]
    total = (info.end_time - info.start_time) if info.end_time else None
    cells = [date, commit, key, model, cpu_of(parent, cpu), n_threads,
             *[clock(times.get(s)) for s in STAGES], clock(total), *success, note]
    return key, "| " + " | ".join(cell(c) for c in cells) + " |"


def write_row(out: Path, key: str, row: str) -> str:
    """Replace the row whose run column is `key`, else append it to the table; returns what was done."""
    text = out.read_text() if out.is_file() else TEMPLATE
    lines = text.splitlines()
    try:
        start = lines.index(HEADER)
    except ValueError:
        raise RunLogError(f"{out} has no run table (its header line: {HEADER}): fix the file, or write to a new "
                          "one with --out") from None
    end = start + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    for i in range(start + 2, end):
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        if len(cells) > 2 and cells[2] == key:
            lines[i] = row
            done = "replaced"
            break
    else:
        lines.insert(end, row)
        done = "appended"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/run_log.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=None, help="the repository the run was made in (default: the current one)")
    ap.add_argument("--out", type=Path, default=None, help="the run log to write (default: docs/runs.md of the current repository)")
    ap.add_argument("--tracking-uri", help="the MLflow store (default: MLFLOW_TRACKING_URI, else REPO/mlflow.db)")
    ap.add_argument("--experiment", default="agentkiln", help="the MLflow experiment (default: agentkiln)")
    ap.add_argument("--run-id", help="the parent run to log (default: the last finished `pipeline` run)")
    ap.add_argument("--cpu", help="the machine's CPU as the row names it (default: /proc/cpuinfo's model name, "
                                  "when the run was made on this host)")
    ap.add_argument("--threads", help="torch threads (default: dvc.lock's torch_threads)")
    ap.add_argument("--note", default="", help="free text for the row's note column")
    args = ap.parse_args(argv)
    repo = (args.repo or default_repo()).resolve()
    out = args.out or default_repo() / "docs" / "runs.md"
    try:
        if not repo.is_dir():
            raise RunLogError(f"no directory {repo}: pass the repository the run was made in with --repo")
        with tempfile.TemporaryDirectory(prefix="run-log-") as tmp:
            uri = readable_store(store_uri(repo, args.tracking_uri), Path(tmp))
            parent, children = find_runs(uri, args.experiment, args.run_id)
            key, row = build_row(repo, parent, children, args.cpu, args.threads, args.note)
        done = write_row(out, key, row)
    except RunLogError as e:
        print(f"run_log: {e}", file=sys.stderr)
        return 2
    print(f"{done} in {out}:\n{HEADER}\n{row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
