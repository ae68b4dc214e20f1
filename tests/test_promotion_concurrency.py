"""Concurrent promotions on one real MLflow SQLite store: two processes register and promote at the
same moment, 50 rounds. No crash, and no promoted champion lost from the rollback chain.

Each round both processes wait at a barrier, then each registers a new version (`register_version`,
the same call as the promote stage after logging its model) and challenges the champion with it
(`stages.promote.challenge`: read champion, gate, move aliases). Version i wins the first 5(i+1)
tasks of the panel, so either order within a round is a legal outcome: the later version beats the
earlier, the earlier loses to the later. What must hold is consistency: the `promoted_over` chain
from the final champion visits exactly the versions whose run reported `promoted`, in promotion
order, and `previous` is its second link."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

ROUNDS = 50
STEP = 5  # tasks each new version wins over the one before (the paired CI is then above zero)
N_TASKS = STEP * (2 * ROUNDS + 1)
NAME = "agentkiln-policy-race"


def outcomes(i: int) -> str:
    return "1" * (STEP * (i + 1)) + "0" * (N_TASKS - STEP * (i + 1))


def _use_store(uri: str) -> None:
    os.environ["MLFLOW_TRACKING_URI"] = uri
    # an earlier test's mlflow.set_experiment leaves MLFLOW_EXPERIMENT_ID in the environment a spawned
    # process inherits: here it would name an experiment of another store
    for var in ("MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        os.environ.pop(var, None)
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)


def _log_model() -> str:
    """The model every version is registered from (logged once: racing registration needs no model logging)."""
    import mlflow

    with mlflow.start_run(run_name="race"):  # a model record without weights: the race is in the registry
        return f"models:/{mlflow.create_external_model(name='policy').model_id}"


def _promoter(w: int, uri: str, policy_dir: str, uris, barrier, q) -> None:
    """Promoter 0 logs the model and hands its URI to promoter 1 (which imports meanwhile); then
    both race through the rounds."""
    results = []
    try:
        _use_store(uri)
        from agentkiln.config import EvaluateParams, PromoteParams
        from agentkiln.registry.model_registry import register_version
        from agentkiln.stages.promote import challenge

        if w == 0:
            model_uri = None
            try:
                model_uri = _log_model()
            finally:
                uris.put(model_uri)
        else:
            model_uri = uris.get(timeout=240)
            if model_uri is None:
                raise RuntimeError("promoter 0 could not log the model")
        p, ev = PromoteParams(model_name=NAME), EvaluateParams()
        for r in range(ROUNDS):
            i = 2 * r + w
            tags = {"eval.panel": "race-panel", "eval.outcomes": outcomes(i), "race.index": str(i)}
            barrier.wait(timeout=120)
            version = register_version(model_uri, NAME, tags, {"success": STEP * (i + 1) / N_TASKS})
            res = challenge(p, ev, version, tags)
            results.append((i, version, res["promoted"], res.get("champion_version")))
        q.put(("ok", w, results))
    except BaseException:
        barrier.abort()  # the other promoter stops waiting for this one
        q.put(("error", w, traceback.format_exc()))


def test_two_processes_promoting_at_once_lose_no_champion(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    ctx = mp.get_context("spawn")  # no fork of a process holding torch / MLflow threads
    q, uris = ctx.Queue(), ctx.Queue()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) for a user-set tracking URI
    try:
        barrier = ctx.Barrier(2)
        workers = [ctx.Process(target=_promoter, args=(w, uri, str(policy), uris, barrier, q)) for w in range(2)]
        for p in workers:
            p.start()
        replies = [q.get(timeout=240) for _ in workers]
        for p in workers:
            p.join(timeout=60)
    finally:
        os.chdir(cwd)
    errors = [r for r in replies if r[0] != "ok"]
    assert not errors, "\n".join(r[2] for r in errors)  # no crash (UNIQUE constraint, lost update, ...)
    assert [p.exitcode for p in workers] == [0, 0]
    rows = sorted(row for r in replies for row in r[2])  # by index: rounds run one after the other
    assert len(rows) == 2 * ROUNDS and len({v for _, v, _, _ in rows}) == 2 * ROUNDS  # every version distinct

    from mlflow import MlflowClient

    client = MlflowClient(uri, uri)
    versions = {str(mv.version): mv for mv in client.search_model_versions(f"name='{NAME}'")}
    assert len(versions) == 2 * ROUNDS
    aliases = {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}
    # promotion order is index order: a promotion beats the champion before it, and rounds follow each other
    promoted = [v for _, v, ok, _ in rows if ok]
    assert len(promoted) >= ROUNDS  # every round promotes at least its later-registered version
    # the chain from the champion back through `promoted_over`: every promoted version, once, in order
    chain, v = [], aliases["champion"]
    while v is not None:
        assert v not in chain, f"cycle in the promoted_over chain: {chain + [v]}"
        chain.append(v)
        v = versions[v].tags.get("promoted_over")
    assert chain[::-1] == promoted, (chain[::-1], promoted)
    assert aliases["previous"] == chain[1]
    # each promotion beat the champion it replaced, and that champion is the one it links to
    index = {str(mv.version): int(mv.tags["race.index"]) for mv in versions.values()}
    for i, v, ok, champ in rows:
        assert index[v] == i
        if ok and champ is not None:
            assert versions[v].tags["promoted_over"] == champ and index[champ] < i
        if not ok:
            assert champ is not None and index[champ] > i  # refused only against a better champion
    assert aliases["challenger"] == max(versions, key=int)  # the last registered version


def test_the_lock_file_sits_beside_the_store(tmp_path, monkeypatch):
    import tempfile
    from pathlib import Path

    from agentkiln.registry.lock import LOCK_ENV, lock_path

    tmp = tmp_path.resolve()
    monkeypatch.delenv(LOCK_ENV, raising=False)
    assert lock_path(f"sqlite:///{tmp}/mlflow.db") == tmp / "mlflow.db.registry.lock"
    monkeypatch.chdir(tmp)
    assert lock_path("sqlite:///rel.db") == tmp / "rel.db.registry.lock"  # relative to the cwd, as for MLflow
    assert lock_path(f"{tmp.as_uri()}/mlruns") == lock_path("mlruns") == tmp / "mlruns.registry.lock"
    remote = lock_path("http://mlflow.example:5000")
    assert remote.parent == Path(tempfile.gettempdir()) and remote != lock_path("http://other:5000")
    monkeypatch.setenv(LOCK_ENV, str(tmp / "mine.lock"))
    assert lock_path(f"sqlite:///{tmp}/mlflow.db") == tmp / "mine.lock"


def test_the_lock_is_reentrant_and_another_process_waits_for_it(tmp_path):
    import subprocess
    import sys

    from agentkiln.registry.lock import registry_lock

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("import sys\nfrom agentkiln.registry.lock import registry_lock\n"
            "try:\n    with registry_lock(sys.argv[1], timeout=0.5): pass\n"
            "except TimeoutError as e:\n    print(e); sys.exit(3)\n")
    with registry_lock(uri) as path:
        with registry_lock(uri):  # the same thread again: no deadlock
            pass
        busy = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=60)
        assert busy.returncode == 3 and f"held by process {os.getpid()}" in busy.stdout and str(path) in busy.stdout
    free = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=60)
    assert free.returncode == 0, free.stdout + free.stderr
