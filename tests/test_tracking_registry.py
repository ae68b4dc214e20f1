"""MLflow tracking and registry against a real SQLite store in a temporary directory:
parent/child runs across processes, candidate registration, aliases, lineage tags, serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import mlflow
from agentkiln import tracking
from agentkiln.registry import lineage
from agentkiln.registry import model_registry as mr

SRC = Path(__file__).resolve().parents[1] / "src"


# --------------------------------------------------------------------------- helpers
def _tiny_policy(out: Path, seed: int) -> Path:
    """A 1-layer random Llama + word-level tokenizer, saved like a real policy (no hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "go", "north", "south", "take", "coin", ">"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", tracking.PARENT_ENV)


@contextmanager
def _isolated_mlflow_env():
    """mlflow.set_tracking_uri / set_registry_uri export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI
    themselves (for subprocesses), which monkeypatch.delenv of an unset variable does not undo:
    restore them exactly, then point MLflow's globals back at the restored environment."""
    saved = {k: os.environ.get(k) for k in _MLFLOW_ENV}
    try:
        yield
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        tracking._setup_state = None
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating its tables takes a few seconds)."""
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with _isolated_mlflow_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        os.environ.pop("MLFLOW_REGISTRY_URI", None)
        os.environ.pop(tracking.PARENT_ENV, None)
        mp.chdir(tmp)  # a user-set tracking URI keeps artifacts in ./mlruns: here, in tmp
        tracking._setup_state = None
        exp_id = tracking.setup()
        yield {"tmp": tmp, "uri": uri, "experiment_id": exp_id}


# --------------------------------------------------------------------------- pure helpers
def test_flatten_params():
    flat = tracking.flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": "x" * 7000, "f": {}, "g": None})
    assert flat["a.b"] == "1"
    assert flat["a.c.d"] == "[1, 2]"
    assert len(flat["e"]) == 6000
    assert flat["f"] == "{}" and flat["g"] == "None"


def test_repo_root_and_default_uri_are_absolute(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.repo_root() == tmp_path.resolve()
    assert tracking.tracking_uri() == "sqlite:///" + str(tmp_path.resolve() / "mlflow.db")
    assert tracking.artifact_location() == (tmp_path.resolve() / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert tracking.tracking_uri() == "sqlite:///elsewhere.db"
    assert tracking.artifact_location() is None


def test_log_metrics_without_a_run_is_a_no_op():
    assert mlflow.active_run() is None
    tracking.log_metrics({"x": 1.0})  # must not start a run behind our back
    assert mlflow.active_run() is None


# --------------------------------------------------------------------------- lineage
def test_lineage_outside_git(tmp_path):
    assert lineage.git_commit(tmp_path) == "unknown"
    assert lineage.params_hash(tmp_path / "params.yaml") == "missing"
    assert lineage.dvc_lock_hashes(tmp_path) == {}


def test_lineage_in_a_git_repo(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\n"
        "stages:\n"
        "  synthesize:\n"
        "    cmd: python -m flows.synthesize\n"
        "    deps:\n"
        "    - path: src\n      hash: md5\n      md5: 0000.dir\n"
        "    outs:\n"
        "    - path: data/tasks\n      hash: md5\n      md5: aaaa.dir\n      size: 10\n      nfiles: 2\n"
        "  sft:\n"
        "    cmd: python -m flows.sft\n"
        "    outs:\n"
        "    - path: models/sft\n      hash: md5\n      md5: bbbb.dir\n"
        "    - path: reports/sft.json\n      hash: md5\n      md5: cccc\n"
    )
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert lineage.git_commit(tmp_path) == sha
    (tmp_path / "untracked.txt").write_text("u")  # untracked files do not make it dirty
    assert lineage.git_commit(tmp_path) == sha
    with (tmp_path / "dvc.lock").open("a") as f:  # every repro rewrites dvc.lock: not dirty code
        f.write("# rewritten\n")
    assert lineage.git_commit(tmp_path) == sha
    (tmp_path / "params.yaml").write_text("seed: 1\n")
    assert lineage.git_commit(tmp_path) == sha + "-dirty"

    import hashlib

    assert lineage.params_hash(tmp_path / "params.yaml") == hashlib.sha256(b"seed: 1\n").hexdigest()[:16]
    assert lineage.dvc_lock_hashes(tmp_path) == {
        "data/tasks": "aaaa.dir", "models/sft": "bbbb.dir", "reports/sft.json": "cccc"
    }
    tags = lineage.lineage_tags(tmp_path, {"candidate": "rl", "eval.success": 0.5})
    assert tags["lineage.git_commit"] == sha + "-dirty"
    assert tags["lineage.data.models/sft"] == "bbbb.dir"
    assert tags["candidate"] == "rl" and tags["eval.success"] == "0.5"
    assert all(isinstance(v, str) for v in tags.values())


# --------------------------------------------------------------------------- tracking
def test_default_store_is_the_repo_sqlite_with_mlartifacts(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with _isolated_mlflow_env(), pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.environ.pop("MLFLOW_REGISTRY_URI", None)
        tracking._setup_state = None
        exp_id = tracking.setup("agentkiln")
        # MLflow exported the URI for subprocesses; it is still "ours", not a user choice.
        assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///" + str(tmp_path.resolve() / "mlflow.db")
        exp = mlflow.MlflowClient().get_experiment(exp_id)
        assert exp.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()
        assert tracking.artifact_location() == exp.artifact_location
        assert (tmp_path / "mlflow.db").is_file()
        assert tracking.setup("agentkiln") == exp_id  # get, not create


def test_pipeline_run_children_in_process_and_in_a_subprocess(store):
    assert tracking.PARENT_ENV not in os.environ
    with tracking.pipeline_run(tags={"seed": "0"}) as parent:
        parent_id = parent.info.run_id
        assert os.environ[tracking.PARENT_ENV] == parent_id
        with tracking.stage_run("sft", params={"lr": 0.1, "model": {"hidden_size": 16}}, tags={"seed": "0"}):
            tracking.log_metrics({"loss": 1.5, "name": "not a number", "n": 3, "none": None}, step=1)
        # A stage process as DVC starts it: no active run there, only the environment variable.
        code = (
            "from agentkiln import tracking\n"
            "import mlflow\n"
            "with tracking.stage_run('evaluate', params={'max_turns': 5}):\n"
            "    assert mlflow.active_run() is not None\n"
            "    tracking.log_metrics({'success': 0.25})\n"
        )
        env = dict(os.environ, PYTHONPATH=str(SRC))
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=store["tmp"], timeout=120)
    assert tracking.PARENT_ENV not in os.environ  # restored after the block

    runs = mlflow.search_runs(experiment_ids=[store["experiment_id"]], output_format="list")
    by_name = {r.info.run_name: r for r in runs}
    assert by_name["pipeline"].info.run_id == parent_id
    assert by_name["pipeline"].data.tags[tracking.STAGE_TAG] == "pipeline"
    for name in ("sft", "evaluate"):
        r = by_name[name]
        assert r.data.tags["mlflow.parentRunId"] == parent_id, name
        assert r.data.tags[tracking.STAGE_TAG] == name
        assert r.info.status == "FINISHED"
    sft = by_name["sft"].data
    assert sft.params == {"lr": "0.1", "model.hidden_size": "16"}
    assert sft.metrics == {"loss": 1.5, "n": 3.0}
    assert sft.tags["seed"] == "0"
    assert by_name["evaluate"].data.metrics == {"success": 0.25}
    assert by_name["evaluate"].data.params == {"max_turns": "5"}


def test_rl_episodes_are_logged_as_one_artifact_per_iteration(store, tmp_path):
    sample = [{"task_id": "t", "won": True, "policy_version": 2, "turns": [{"reply": "down", "advantage": 0.5}]}]
    tracking.log_episodes(3, sample)  # no active run: nothing, no error
    with tracking.stage_run("rl-main") as run:
        tracking.log_episodes(3, sample)
        tracking.log_episodes(4, [])  # an iteration without episodes writes nothing
    got = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="episodes", dst_path=str(tmp_path))
    assert sorted(os.listdir(got)) == ["iteration_0003.json"]
    assert json.loads((Path(got) / "iteration_0003.json").read_text()) == {"iteration": 3, "episodes": sample}


def test_parent_env_restored_to_previous_value(store, monkeypatch):
    monkeypatch.setenv(tracking.PARENT_ENV, "outer")
    with tracking.pipeline_run() as run:  # no active run: a top-level run despite the variable
        assert os.environ[tracking.PARENT_ENV] == run.info.run_id
        assert "mlflow.parentRunId" not in mlflow.get_run(run.info.run_id).data.tags
    assert os.environ[tracking.PARENT_ENV] == "outer"


def test_stale_parent_id_warns_and_runs_top_level(store, monkeypatch):
    monkeypatch.setenv(tracking.PARENT_ENV, "0" * 32)
    with pytest.warns(UserWarning, match="top-level"):
        with tracking.stage_run("orphan") as run:
            pass
    assert "mlflow.parentRunId" not in mlflow.get_run(run.info.run_id).data.tags


def test_failing_stage_marks_the_run_failed(store):
    with pytest.raises(RuntimeError):
        with tracking.stage_run("broken") as run:
            raise RuntimeError("boom")
    assert mlflow.get_run(run.info.run_id).info.status == "FAILED"
    assert mlflow.active_run() is None


def test_a_killed_stages_run_is_marked_failed_by_the_next_start(store):
    """A SIGKILLed stage cannot end its MLflow run: the next run started on this host (any stage's
    tracking.setup()) ends it FAILED, saying why; a run whose process lives stays RUNNING."""
    code = ("import time\nfrom agentkiln import tracking\nwith tracking.stage_run('rl-main'):\n"
            "    print('running', flush=True)\n    time.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=store["tmp"], stdout=subprocess.PIPE)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline() == b"running\n"
        procs[0].kill()
        procs[0].wait()
        runs = {int(r.data.tags[tracking.PID_TAG]): r for r in mlflow.search_runs(
            experiment_ids=[store["experiment_id"]], filter_string="attributes.status = 'RUNNING'", output_format="list")}
        killed, alive = runs[procs[0].pid].info.run_id, runs[procs[1].pid].info.run_id
        tracking.setup()  # what the next stage does first
        assert mlflow.get_run(killed).info.status == "FAILED"
        assert "killed" in mlflow.get_run(killed).data.tags["agentkiln.ended"]
        assert mlflow.get_run(alive).info.status == "RUNNING"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    tracking.setup()
    assert mlflow.get_run(alive).info.status == "FAILED"


# --------------------------------------------------------------------------- registry
def test_register_promote_and_serve(store):
    name = "agentkiln-policy-test"
    tmp = store["tmp"]
    m1, m2 = _tiny_policy(tmp / "m1", 0), _tiny_policy(tmp / "m2", 1)
    assert mr.champion(name) is None  # no such model yet

    with tracking.pipeline_run():
        with tracking.stage_run("promote") as run:
            tags = {"candidate": "sft", "eval.success": "0.5000", "lineage.params_hash": "abc"}
            v1 = mr.register_candidate(m1, name, tags, {"success": 0.5})
            assert mr.champion(name) is None  # registered, but the alias is not set yet
            mr.promote(name, v1)
            v2 = mr.register_candidate(m2, name, {**tags, "candidate": "rl", "eval.success": "0.7500"}, {"success": 0.75})
            assert mr.aliases(name) == {"champion": v1, "challenger": v2}
            mr.promote(name, v2)
            mr.promote(name, v2)  # idempotent: does not make v2 its own `previous`

    assert (v1, v2) == ("1", "2")
    assert mr.aliases(name) == {"champion": "2", "challenger": "2", "previous": "1"}
    version, champ_tags = mr.champion(name)
    assert version == "2"
    assert champ_tags["candidate"] == "rl" and champ_tags["eval.success"] == "0.7500"
    assert champ_tags["lineage.params_hash"] == "abc"
    assert champ_tags["metric.success"] == "0.75"

    client = mlflow.MlflowClient()
    assert "agentkiln" in client.get_registered_model(name).description
    mv = client.get_model_version(name, "1")
    assert mv.run_id == run.info.run_id and mv.tags["candidate"] == "sft"

    # its pyfunc is the agent (tests/test_endpoint.py serves one); the transformers flavour stays: raw
    # text generation from the same weights (prompt + continuation)
    from mlflow.models import Model

    flavors = Model.load(f"models:/{name}@champion").flavors
    assert flavors["python_function"]["loader_module"] == mr.PYFUNC_LOADER
    assert flavors["transformers"]["task"] == "text-generation"
    pipe = mlflow.transformers.load_model(f"models:/{name}@champion")
    out = pipe(["go north >", "take coin"], max_new_tokens=2)
    assert len(out) == 2 and out[0][0]["generated_text"].startswith("go north")
    assert any(r.startswith("mlflow") for r in mr.pip_requirements())


def test_registered_version_points_at_the_training_run_with_inputs_and_lineage(store):
    import json

    name = "agentkiln-policy-trained"
    tmp = store["tmp"]
    model = _tiny_policy(tmp / "trained", 3)
    split = tmp / "tasks" / "sft"
    split.mkdir(parents=True)
    (split / "manifest.json").write_text(json.dumps({"sha256": "ab" * 32, "tasks": []}))
    with tracking.pipeline_run():
        with tracking.stage_run("sft") as train:
            tracking.log_split(split)
            uri = mr.log_policy(model)
        with tracking.stage_run("promote") as promote_run:
            tags = {"candidate": "sft", "stage": "sft", "lineage.git_commit": "c0ffee", "lineage.params_hash": "p1",
                    "lineage.data.data/tasks": "d1", "eval.success": "0.5", "eval.vs_random": "beats it"}
            version = mr.register_candidate(model, name, tags, {"success": 0.5})
    client = mlflow.MlflowClient()
    mv = client.get_model_version(name, version)
    assert mv.run_id == train.info.run_id != promote_run.info.run_id  # the run that trained it
    assert mv.tags["model_source"] == "training run" and uri.startswith("models:/")
    assert "c0ffee" in mv.description and "`data/tasks`: `d1`" in mv.description and train.info.run_id in mv.description
    run = client.get_run(train.info.run_id)
    assert run.data.tags[mr.MODEL_DIGEST_TAG] == mr.model_digest(model)
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "tasks/sft" and inp.dataset.digest == "ab" * 8
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"  # MLflow 3's training view
    # the version comes back as the very directory that was trained, byte for byte
    assert mr.model_digest(mr.download_policy(f"models:/{name}/{version}")) == mr.model_digest(model)
    # a directory no training run logged is registered from the active run, and says so
    other = _tiny_policy(tmp / "copied", 4)
    with tracking.stage_run("promote") as promote_run:
        v2 = mr.register_candidate(other, name, {"candidate": "sft"}, {"success": 0.1})
    mv2 = client.get_model_version(name, v2)
    assert mv2.run_id == promote_run.info.run_id and mv2.tags["model_source"].startswith("logged at registration")


def test_a_logged_policy_is_the_transformers_flavour_and_comes_back_checked(store):
    """A real saved policy (scratch model, BPE tokenizer, agent.json, manifest): the logged model is the
    transformers flavour plus the policy's other files; download_policy rebuilds the directory, which
    loads; weights overwritten in the artifact store are refused at load, naming the file."""
    from safetensors.torch import load_file, save_file

    from agentkiln.artifacts import ArtifactError
    from agentkiln.config import ModelParams
    from agentkiln.policy import AgentFormat, build_scratch_policy
    from agentkiln.policy.model import load_policy, save_policy

    tmp = store["tmp"]
    sizes = ModelParams(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=300, max_context=256)
    pol = build_scratch_policy(sizes, ["go north > take coin", "look around"] * 8, AgentFormat(system_prompt="Play."), seed=0)
    saved = save_policy(pol, tmp / "scratch" / "sft")
    with tracking.stage_run("sft"):
        uri = mr.log_policy(saved)
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp / "logged")))
    assert "transformers" in (local / "MLmodel").read_text()
    assert sorted(p.name for p in (local / mr.POLICY_FILES).iterdir()) == sorted(
        p.name for p in saved.iterdir() if not p.name.endswith(mr.WEIGHTS_SUFFIX))
    version = mr.register_version(uri, "agentkiln-policy-flavour", {"candidate": "sft"}, {"success": 0.5})
    back = mr.download_policy(f"models:/agentkiln-policy-flavour/{version}", tmp / "back")
    assert mr.model_digest(back) == mr.model_digest(saved)
    assert load_policy(back).fmt.system_prompt == "Play."  # agent.json came back with the weights
    # overwrite the weights in the artifact store
    overwritten = tmp / "overwritten" / "model.safetensors"
    overwritten.parent.mkdir()
    save_file({k: v * 0 + 0.5 for k, v in load_file(local / "model" / "model.safetensors").items()}, overwritten)
    mlflow.MlflowClient().log_model_artifact(uri.removeprefix("models:/"), str(overwritten), "model")
    damaged = mr.download_policy(f"models:/agentkiln-policy-flavour/{version}", tmp / "damaged")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: content changed since it was saved"):
        load_policy(damaged)


def test_register_candidate_refuses_a_missing_dir(store, tmp_path):
    with pytest.raises(FileNotFoundError):
        mr.register_candidate(tmp_path / "nope", "x", {}, {})


def test_rollback_restores_the_previous_champion_and_walks_back_the_chain(store):
    name = "agentkiln-policy-rollback"
    tmp = store["tmp"]
    dirs = [_tiny_policy(tmp / f"r{i}", i) for i in range(3)]
    with tracking.pipeline_run():
        with tracking.stage_run("promote"):
            vs = [mr.register_candidate(d, name, {"candidate": f"c{i}"}, {"success": 0.1 * i}) for i, d in enumerate(dirs)]
            with pytest.raises(RuntimeError, match="has no champion: nothing to roll back"):
                mr.rollback(name)  # nothing promoted yet: refused, nothing changed
            for v in vs:
                mr.promote(name, v)
    assert mr.aliases(name) == {"champion": "3", "previous": "2", "challenger": "3"}
    assert mr.rollback(name) == ("3", "2")
    assert mr.aliases(name) == {"champion": "2", "previous": "1", "challenger": "3"}
    client = mlflow.MlflowClient()
    assert client.get_model_version(name, "3").tags["rolled_back"] == "true"
    assert mr.rollback(name) == ("2", "1")
    assert mr.aliases(name) == {"champion": "1", "challenger": "3"}  # start of the chain: no previous left
    with pytest.raises(RuntimeError, match="version 1, was the first one promoted: there is no earlier champion"):
        mr.rollback(name)  # one champion, nothing before it: said so, not "no champion"
    # the restored champion is what `models:/<name>@champion` now loads: v1's weights
    import torch
    from transformers import AutoModelForCausalLM

    local = mr.download_policy(f"models:/{name}@champion", tmp / "dl")
    a = AutoModelForCausalLM.from_pretrained(local).state_dict()
    b = AutoModelForCausalLM.from_pretrained(dirs[0]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    with pytest.raises(FileNotFoundError, match="not found in the registry"):
        mr.download_policy("models:/no-such-model@champion", tmp / "dl2")
    # evaluation and the endpoint load a registry URI from a temporary download, removed after
    import glob
    import tempfile

    before = set(glob.glob(f"{tempfile.gettempdir()}/agentkiln-model-*"))
    with mr.downloaded_policy(f"models:/{name}@champion") as path:
        a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b) and not path.exists()
    assert set(glob.glob(f"{tempfile.gettempdir()}/agentkiln-model-*")) == before
