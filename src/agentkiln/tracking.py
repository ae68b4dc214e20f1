"""MLflow tracking for the pipeline: one parent run per pipeline, one child run per stage.

Stages run in separate processes (DVC starts each one), so the parent run id travels in the
environment variable AGENTKILN_PARENT_RUN_ID. The store is a SQLite file at the repository root
(absolute path, so that a stage run from a copy of the repository reports to the same database)
unless MLFLOW_TRACKING_URI says otherwise (AGENTKILN_MLFLOW_DIR moves the default store's directory).
"""

from __future__ import annotations

import json
import numbers
import os
import socket
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset

from agentkiln.paths import repo_root

PARENT_ENV = "AGENTKILN_PARENT_RUN_ID"
# who runs a run: a run still RUNNING whose process is gone (SIGKILLed, the machine's power cut) is
# marked FAILED by the next run on the same host (MLflow itself would show it RUNNING for ever)
HOST_TAG, PID_TAG, PID_START_TAG = "agentkiln.host", "agentkiln.pid", "agentkiln.pid_start"
DEFAULT_EXPERIMENT = "agentkiln"
STAGE_TAG = "agentkiln.stage"
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_PARAM_KEY = 250
# The experiment's type for MLflow 3's UI: model training (runs, metrics, models), not GenAI (traces).
# The UI's mode is also a per-browser setting (GenAI by default): TRAINING_VIEW, appended to the
# server's URL, opens the experiments in the model-training mode, and the browser keeps it.
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
TRAINING_VIEW = "#/experiments?workflowType=machine_learning"

# What setup() last did in this process: (tracking URI, experiment name, experiment id).
_setup_state: tuple[str, str, str] | None = None




def store_dir() -> Path:
    """Where the default store lives (mlflow.db + mlartifacts/): the repository root, or
    AGENTKILN_MLFLOW_DIR (a volume in the Docker image)."""
    return Path(os.environ.get("AGENTKILN_MLFLOW_DIR") or repo_root())


def _default_uri() -> str:
    return "sqlite:///" + str((store_dir() / "mlflow.db").resolve())


def default_store_path() -> Path | None:
    """The SQLite file of the store in use when it is this project's default one, else None."""
    return None if os.environ.get("MLFLOW_TRACKING_URI") else store_dir() / "mlflow.db"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or _default_uri()


def artifact_location() -> str | None:
    """Where new experiments keep artifacts: <repo>/mlartifacts, unless the user chose another
    tracking URI (then the tracking store's own default applies). Note mlflow.set_tracking_uri
    exports MLFLOW_TRACKING_URI itself: our own default URI there does not count as a choice."""
    user = os.environ.get("MLFLOW_TRACKING_URI")
    if user and user != _default_uri():
        return None
    return (store_dir() / "mlartifacts").resolve().as_uri()


def setup(experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Point MLflow (tracking and registry) at the store, get or create `experiment`, make it the
    active experiment; return its id."""
    global _setup_state
    uri = tracking_uri()
    location = artifact_location()  # before set_tracking_uri, which exports MLFLOW_TRACKING_URI
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        try:
            exp_id = client.create_experiment(experiment, artifact_location=location)
        except mlflow.exceptions.MlflowException:
            # Another stage process created it between our lookup and our create.
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise
            exp_id = exp.experiment_id
    else:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        exp_id = exp.experiment_id
    if (exp is None or exp.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND):
        # MLflow 3 opens an experiment without this tag in its GenAI view (traces, evaluations)
        client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    mlflow.set_experiment(experiment_id=exp_id)
    _setup_state = (uri, experiment, exp_id)
    fail_orphaned_runs(client, exp_id)
    return exp_id


def _start_time(pid: int) -> str | None:
    from agentkiln.lifecycle import start_time  # how runs stop, not what they compute: not a stage dependency

    return start_time(pid)


def _owner_tags() -> dict[str, str]:
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PID_START_TAG: str(_start_time(os.getpid()))}


def fail_orphaned_runs(client: mlflow.MlflowClient, exp_id: str) -> list[str]:
    """End as FAILED the runs of `exp_id` still RUNNING whose process, on this host, is gone (a
    SIGKILLed stage cannot end its own run); returns their ids. Runs of other hosts are left alone."""
    gone = []
    for run in client.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=1000):
        tags = run.data.tags
        if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
            continue
        if _start_time(int(tags[PID_TAG])) == tags.get(PID_START_TAG):
            continue  # its process is alive
        client.set_tag(run.info.run_id, "agentkiln.ended", "its process ended without ending the run (killed); "
                       "marked FAILED by the next run")
        client.set_terminated(run.info.run_id, status="FAILED")
        gone.append(run.info.run_id)
    return gone


def _experiment_id() -> str:
    """The experiment setup() chose, set up again if the tracking URI changed since."""
    if _setup_state is None:
        return setup()
    uri, name, exp_id = _setup_state
    return exp_id if uri == tracking_uri() else setup(name)


def flatten(d: Mapping, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; values as strings cut to MLflow's 6000-char limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key[:MAX_PARAM_KEY]] = str(v)[:MAX_PARAM_VALUE]
    return out


def _start(run_name: str, tags: dict[str, str], parent_run_id: str | None):
    exp_id = _experiment_id()
    common = dict(run_name=run_name, tags={**tags, **_owner_tags()}, log_system_metrics=False)
    active = mlflow.active_run()
    if active is not None:
        # Same process as the parent (e.g. promotion inside the pipeline flow): plain nesting.
        return mlflow.start_run(nested=True, experiment_id=active.info.experiment_id, **common)
    if parent_run_id:
        # Another process opened the parent (DVC starts each stage): MLflow needs only its id.
        try:
            parent = mlflow.MlflowClient().get_run(parent_run_id)
        except mlflow.exceptions.MlflowException as e:
            warnings.warn(
                f"{PARENT_ENV}={parent_run_id} is not a run in {tracking_uri()} ({e.message}); "
                f"starting '{run_name}' as a top-level run",
                stacklevel=3,
            )
        else:
            return mlflow.start_run(
                parent_run_id=parent_run_id, experiment_id=parent.info.experiment_id, **common
            )
    return mlflow.start_run(experiment_id=exp_id, **common)


@contextmanager
def stage_run(stage: str, params: dict | None = None, tags: dict | None = None) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run named after `stage`: a child of the active run, else of the run named by
    AGENTKILN_PARENT_RUN_ID, else top-level. Logs `params` flattened and tags the stage. A failing
    block ends the run as FAILED (mlflow.start_run's context manager does that)."""
    all_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    all_tags[STAGE_TAG] = stage
    with _start(stage, all_tags, os.environ.get(PARENT_ENV)) as run:
        if params:
            flat = list(flatten(params).items())
            for i in range(0, len(flat), 100):  # log_batch takes at most 100 params at a time
                mlflow.log_params(dict(flat[i : i + 100]))
        yield run


def _as_number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch 0-d values
        try:
            return _as_number(v.item())
        except (TypeError, ValueError):
            return None
    return None


def log_metrics(metrics: Mapping, step: int | None = None) -> None:
    """Log the numeric entries of `metrics` to the active run (others, e.g. strings or None, are
    skipped); does nothing when no run is active, so stage code also runs untracked."""
    if mlflow.active_run() is None:
        return
    numeric = {str(k): x for k, v in metrics.items() if (x := _as_number(v)) is not None}
    if numeric:
        mlflow.log_metrics(numeric, step=step)


def log_episodes(iteration: int, episodes: list[dict]) -> None:
    """An RL iteration's sample of episodes (trainers.episode_log) as the run's artifact
    episodes/iteration_NNNN.json; nothing when no run is active."""
    if mlflow.active_run() is not None and episodes:
        mlflow.log_dict({"iteration": iteration, "episodes": episodes}, f"episodes/iteration_{iteration:04d}.json")


def log_artifact(path: str | Path) -> None:
    """Attach a file (a curve, a report) to the active run; nothing when no run is active."""
    if mlflow.active_run() is not None and Path(path).is_file():
        mlflow.log_artifact(str(path))


@contextmanager
def pipeline_run(tags: dict | None = None) -> Iterator[mlflow.ActiveRun]:
    """The parent run "pipeline". Its id is exported in AGENTKILN_PARENT_RUN_ID for the stage
    processes started inside the block; the previous value is restored afterwards."""
    all_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    all_tags[STAGE_TAG] = "pipeline"
    previous = os.environ.get(PARENT_ENV)
    with _start("pipeline", all_tags, None) as run:
        os.environ[PARENT_ENV] = run.info.run_id
        try:
            yield run
        finally:
            if previous is None:
                os.environ.pop(PARENT_ENV, None)
            else:
                os.environ[PARENT_ENV] = previous


def log_split(split_dir: str | Path, context: str = "training") -> None:
    """Record a task split the active run read as an MLflow dataset input (the run's Inputs): named
    `tasks/<split>`, its source the split's directory, its digest the split manifest's sha256 (the
    same hash the frozen panels and dvc.lock lineage use). Nothing when no run is active."""
    if mlflow.active_run() is None:
        return
    split_dir = Path(split_dir)
    manifest = json.loads((split_dir / "manifest.json").read_text())
    _log_input(split_dir, f"tasks/{split_dir.name}", manifest["sha256"][:16], context)


def log_collected(split_dir: str | Path, digest: str, context: str = "training") -> None:
    """Record a collected split (agentkiln collect) the active run trained on as a dataset input named
    `collected/<name>`, with its digest (collected.split_digest: what the registry's lineage tag names)."""
    if mlflow.active_run() is None:
        return
    _log_input(Path(split_dir), f"collected/{Path(split_dir).name}", digest, context)


def _log_input(split_dir: Path, name: str, digest: str, context: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow warns that a local path source is inferred
        source = resolve_dataset_source(str(split_dir.resolve()))
    mlflow.log_input(MetaDataset(source, name=name, digest=digest), context=context)
