"""A full disk never costs a training stage its progress, and says what happened.

- Logging the model to MLflow fails (the artifact store on a full, size-limited filesystem): the SFT
  stage's checkpoint survives, and the rerun with space resumes from it (after its last epoch, not from
  epoch 1) and ends with the weights and metrics of an uninterrupted run. The RL and distillation
  stages keep theirs when writing their reports fails.
- A checkpoint that does not fit: one line naming the checkpoint, the full disk and the next step; the
  previous checkpoint stays loadable and nothing half-written is left for a rerun to trust.

The small filesystems are real tmpfs mounts (root or CAP_SYS_ADMIN needed; elsewhere these tests skip,
saying why), unmounted when each test ends."""

from __future__ import annotations

import errno
import json
import subprocess
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from tests.conftest import params_with, tiny_dataset
from tests.test_kill_resume import TINY, weights


@contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` mounted at `where` for the block."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True)
    except FileNotFoundError as e:
        pytest.skip(f"no `mount` command ({e}): cannot make a size-limited filesystem")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs at {where} (needs root or CAP_SYS_ADMIN): "
                    f"{(r.stderr or r.stdout).strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # a file still open: detach it anyway


def fill(where: Path) -> None:
    """Write zeros under `where` until its filesystem is full."""
    with open(where / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Tiny frozenlake splits, the tiny params of the kill/resume tests, and an uninterrupted SFT run
    (its model, metrics and weights: what the interrupted run must end with)."""
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.sft import run_sft

    root = tmp_path_factory.mktemp("faults")
    tiny_dataset(root / "tasks", {"sft": {"frozenlake_easy": 1.0}, "rl": {"frozenlake_easy": 1.0},
                                  "test": {"frozenlake_easy": 1.0}, "val": {"frozenlake_easy": 1.0}},
                 n={"sft": 8, "rl": 4, "test": 2, "val": 2})
    params = params_with(TINY)
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    seed_everything(params.seed, params.torch_threads)
    metrics = run_sft(params, root / "tasks", root / "ref" / "sft")
    (root / "ref" / "sft_metrics.json").write_text(json.dumps(metrics, sort_keys=True))
    return root


def load(root: Path):
    from agentkiln.config import load_params
    from agentkiln.seeding import seed_everything

    params = load_params(root / "params.yaml")
    seed_everything(params.seed, params.torch_threads)  # as the flow seeds a stage
    return params


def experiment(name: str, artifacts: Path) -> str:
    """An MLflow experiment (the test session's store) keeping its artifacts in `artifacts`."""
    from agentkiln import tracking

    tracking.setup()
    return mlflow.MlflowClient().create_experiment(name, artifact_location=artifacts.resolve().as_uri())


def test_a_full_disk_while_logging_the_model_keeps_the_sft_checkpoint_and_the_rerun_resumes(root, tmp_path, capsys):
    from agentkiln.registry.model_registry import MODEL_DIGEST_TAG, log_policy, model_digest
    from agentkiln.stages.sft import run_sft

    model, ckpt, epochs = tmp_path / "sft", tmp_path / "ckpt" / "sft", TINY["sft"]["epochs"]

    def outputs(metrics: dict) -> None:  # what flows/sft.py writes after the model: the report, the logged model
        (tmp_path / "sft_metrics.json").write_text(json.dumps(metrics, sort_keys=True))
        log_policy(model)

    with small_disk(tmp_path / "small", "64k") as small:
        with mlflow.start_run(experiment_id=experiment("full-disk", small)):
            with pytest.raises(OSError) as failed:
                run_sft(load(root), root / "tasks", model, ckpt_dir=ckpt, outputs=outputs)
        assert failed.value.errno == errno.ENOSPC, failed.value
    state = torch.load(ckpt / "state.pt", weights_only=False)  # the checkpoint survived the failure
    assert state["done"] == epochs

    capsys.readouterr()
    with mlflow.start_run(experiment_id=experiment("with-space", tmp_path / "artifacts")) as run:
        got = run_sft(load(root), root / "tasks", model, ckpt_dir=ckpt, outputs=outputs)
    printed = capsys.readouterr().out
    assert f"sft: resumed from {ckpt} after epoch {epochs}" in printed, printed[-2000:]  # not from epoch 1
    assert weights(model) == weights(root / "ref" / "sft")
    assert json.dumps(got, sort_keys=True) == (root / "ref" / "sft_metrics.json").read_text()
    assert json.loads((tmp_path / "sft_metrics.json").read_text()) == got
    tags = mlflow.MlflowClient().get_run(run.info.run_id).data.tags
    assert tags[MODEL_DIGEST_TAG] == model_digest(model)  # the model is logged this time
    assert not ckpt.exists() and not list(ckpt.parent.iterdir())  # removed once every output is written


@pytest.mark.parametrize("stage", ["rl", "distill"])
def test_rl_and_distill_keep_their_checkpoint_when_an_output_cannot_be_written(root, stage, tmp_path):
    from agentkiln.stages.distill import run_distill
    from agentkiln.stages.rl import run_rl

    ckpt = tmp_path / "ckpt"
    with small_disk(tmp_path / "reports", "16k") as reports:
        fill(reports)

        def outputs(metrics: dict) -> None:  # the flow's metrics.json, on a full disk
            (reports / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))

        with pytest.raises(OSError) as failed:
            if stage == "rl":
                run_rl(load(root), "s1", root / "tasks", root / "ref" / "sft", tmp_path / "model", tmp_path / "curve",
                       ckpt_dir=ckpt, outputs=outputs)
            else:
                run_distill(load(root), root / "tasks", root / "ref" / "sft", tmp_path / "model", ckpt_dir=ckpt,
                            outputs=outputs)
        assert failed.value.errno == errno.ENOSPC
    state_file = ckpt / "state.pt" if stage == "rl" else ckpt / "distill" / "state.pt"
    state = torch.load(state_file, weights_only=False)  # the last checkpoint survived the failure
    done = state["iteration"] if stage == "rl" else state["done"]
    assert done == (TINY["rl"]["defaults"]["iterations"] if stage == "rl" else TINY["distill"]["epochs"])


def test_a_checkpoint_that_does_not_fit_says_so_and_keeps_the_previous_one(tmp_path):
    from agentkiln.trainers import checkpoint

    with small_disk(tmp_path / "small", "256k") as small:
        ckpt = small / "ckpt" / "sft"
        with pytest.raises(checkpoint.CheckpointWriteError) as first:  # the very first one does not fit
            checkpoint.save(ckpt, "k", {"done": 1, "w": torch.zeros(200_000)})
        assert checkpoint.load(ckpt, "k") is None and sorted(p.name for p in ckpt.parent.iterdir()) == []

        checkpoint.save(ckpt, "k", {"done": 1, "w": torch.arange(1000.0)})
        with pytest.raises(checkpoint.CheckpointWriteError) as later:
            checkpoint.save(ckpt, "k", {"done": 2, "w": torch.zeros(200_000)})
        prev = checkpoint.load(ckpt, "k")  # the previous checkpoint, whole
        assert prev["done"] == 1 and torch.equal(prev["w"], torch.arange(1000.0))
        assert sorted(p.name for p in ckpt.parent.iterdir()) == ["sft"]  # no half-written state left to trust
    for e, kept in ((first.value, "no earlier checkpoint exists"), (later.value, "the previous checkpoint is kept")):
        msg = str(e)
        assert e.errno == errno.ENOSPC and "\n" not in msg and "basic_ios" not in msg
        assert msg.startswith(f"{ckpt}: cannot write the checkpoint: the disk holding it is full"), msg
        assert "free space on it" in msg and kept in msg, msg


def test_a_stage_whose_checkpoint_does_not_fit_stops_with_that_error(root, tmp_path):
    from agentkiln.stages.sft import run_sft
    from agentkiln.trainers.checkpoint import CheckpointWriteError

    with small_disk(tmp_path / "small", "64k") as small:
        with pytest.raises(CheckpointWriteError, match=f"^{small / 'sft'}: cannot write the checkpoint: the disk "
                                                       "holding it is full"):
            run_sft(load(root), root / "tasks", tmp_path / "model", ckpt_dir=small / "sft")
        assert list(small.iterdir()) == []


def test_a_save_stopped_between_its_renames_leaves_the_previous_checkpoint_loadable(tmp_path):
    from agentkiln.trainers import checkpoint

    ckpt = tmp_path / "ckpt" / "rl"
    checkpoint.save(ckpt, "k", {"done": 1})
    ckpt.rename(tmp_path / "ckpt" / "rl.old")  # where save sets the previous one aside before renaming the new one
    (tmp_path / "ckpt" / "rl.tmp").mkdir()  # and the new one, not yet renamed (possibly incomplete)
    assert checkpoint.load(ckpt, "k")["done"] == 1
    checkpoint.save(ckpt, "k", {"done": 2})
    assert checkpoint.load(ckpt, "k")["done"] == 2 and sorted(p.name for p in ckpt.parent.iterdir()) == ["rl"]
    checkpoint.clear(ckpt)
    assert list(ckpt.parent.iterdir()) == []
