"""A training stage SIGKILLed mid-way resumes from its last checkpoint and ends exactly where an
uninterrupted run ends: the same weights (bytes) and the same metrics. For SFT, every RL stage and
distillation, on tiny params.

The killed run is a real process (the stage function with its checkpoint directory, as the flow calls
it), SIGKILLed as soon as its first checkpoint is on disk: nothing of it runs after the signal. The
resumed run and the uninterrupted reference run in this process, each from the same seeds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, merge, params_with, tiny_dataset

MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vocab_size": 400,
         "max_context": 1024}
TINY = {
    "torch_threads": 1,
    "sft": {"epochs": 8, "batch_size": 2, "warmup_steps": 2, "model": MODEL},
    "rl": {"defaults": {"iterations": 5, "episode_budget": None, "tasks_per_iter": 2, "group_size": 2,
                        "max_turns": 6, "minibatch_size": 4, "micro_batch_size": 4, "checkpoint_every": 1,
                        "select": {"panel": "val", "every": 2}},  # its looks and kept weights survive the kill too
           "stages": {"s1": {"init": "sft"}}},
    "distill": {"mode": "trajectory", "epochs": 8, "samples_per_task": 2, "temperature": 1.0, "max_turns": 6,
                "batch_size": 2, "warmup_steps": 2,
                "student": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}},
}

# The killed process: the stage function, as flows/<stage>.py calls it, with its checkpoint directory.
RUNNER = """
import json, sys
from pathlib import Path
from agentkiln.config import load_params
from agentkiln.seeding import seed_everything
stage, root, params_file = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
params = load_params(params_file)
seed_everything(params.seed, params.torch_threads)
if stage == "sft":
    from agentkiln.stages.sft import run_sft
    m = run_sft(params, root / "tasks", root / "killed" / "model", ckpt_dir=root / "killed" / "ckpt")
elif stage == "rl":
    from agentkiln.stages.rl import run_rl
    m = run_rl(params, "s1", root / "tasks", root / "ref" / "sft", root / "killed" / "model", root / "killed" / "reports",
               ckpt_dir=root / "killed" / "ckpt")
else:
    from agentkiln.stages.distill import run_distill
    m = run_distill(params, root / "tasks", root / "ref" / "sft", root / "killed" / "model",
                    ckpt_dir=root / "killed" / "ckpt")
print("FINISHED", json.dumps(m))
"""


def run_stage(stage: str, root: Path, out: Path, ckpt: Path | None, params_file: Path | None = None) -> dict:
    """The stage in this process (seeded as the flow seeds it), writing its model to `out`."""
    from agentkiln.config import load_params
    from agentkiln.seeding import seed_everything

    params = load_params(params_file or root / "params.yaml")
    seed_everything(params.seed, params.torch_threads)
    if stage == "sft":
        from agentkiln.stages.sft import run_sft

        return run_sft(params, root / "tasks", out / "model", ckpt_dir=ckpt)
    if stage == "rl":
        from agentkiln.stages.rl import run_rl

        return run_rl(params, "s1", root / "tasks", root / "ref" / "sft", out / "model", out / "reports", ckpt_dir=ckpt)
    from agentkiln.stages.distill import run_distill

    return run_distill(params, root / "tasks", root / "ref" / "sft", out / "model", ckpt_dir=ckpt)


def weights(model_dir: Path) -> str:
    """sha256 of the saved weights (every *.safetensors / *.bin file, by name)."""
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    assert files, f"no weights in {model_dir}"
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Tiny frozenlake splits, tiny params, and the uninterrupted SFT model (the RL stage's start and
    the distillation teacher)."""
    root = tmp_path_factory.mktemp("resume")
    tiny_dataset(root / "tasks", {"sft": {"frozenlake_easy": 1.0}, "rl": {"frozenlake_easy": 1.0},
                                  "test": {"frozenlake_easy": 1.0}, "val": {"frozenlake_easy": 1.0}},
                 n={"sft": 8, "rl": 4, "test": 2, "val": 2})
    params = params_with(TINY)
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    run_stage("sft", root, root / "ref" / "sft_run", None)
    (root / "ref" / "sft_run" / "model").rename(root / "ref" / "sft")
    return root


# (stage, params over TINY, the checkpoint whose first appearance triggers the kill, its unit, units in all)
CASES = {
    "sft": ("sft", {}, "", "epoch", TINY["sft"]["epochs"]),
    "rl": ("rl", {}, "", "iteration", TINY["rl"]["defaults"]["iterations"]),
    "distill-trajectory": ("distill", {}, "distill", "epoch", TINY["distill"]["epochs"]),
    "distill-forward-kl": ("distill", {"distill": {"mode": "forward-kl"}}, "forward-kl", "epoch", TINY["distill"]["epochs"]),
    # killed in the rounds, after the (finished) warm start: both phases resume
    "distill-on-policy": ("distill", {"distill": {"mode": "on-policy", "warmup_epochs": 2, "iterations": 5,
                                                  "tasks_per_iter": 2}}, "on-policy", "round", 5),
}


def checkpoint_in(ckpt: Path, phase: str) -> bool:
    return (ckpt / phase / "state.pt").is_file()


@pytest.mark.parametrize("case", list(CASES))
def test_a_sigkilled_stage_resumes_to_identical_weights_and_metrics(root, case, tmp_path, capsys):
    stage, over, phase, unit, total = CASES[case]
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(merge(yaml.safe_load((root / "params.yaml").read_text()), over), sort_keys=False))
    want = run_stage(stage, root, tmp_path / "ref", None, params_file)  # uninterrupted
    want_weights = weights(tmp_path / "ref" / "model")

    log = tmp_path / "killed.log"
    killed = root / "killed"
    shutil.rmtree(killed, ignore_errors=True)
    env = os.environ | {"TQDM_DISABLE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, stage, str(root), str(params_file)], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    ckpt = killed / "ckpt"
    deadline = time.monotonic() + 180
    while not checkpoint_in(ckpt, phase) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = log.read_text()
    assert proc.returncode == -signal.SIGKILL and "FINISHED" not in out, out[-3000:]
    assert checkpoint_in(ckpt, phase) and not (killed / "model").exists()  # stopped mid-way

    got = run_stage(stage, root, killed, ckpt, params_file)  # run again: resumes
    printed = capsys.readouterr().out
    resumed = [line for line in printed.splitlines() if f"resumed from {ckpt / phase}" in line]
    assert len(resumed) == 1 and f"after {unit} " in resumed[0], printed[-2000:]
    done = int(resumed[0].split(f"after {unit} ")[1].split()[0])
    assert 1 <= done < total  # it resumed mid-way, not from the start nor from the end
    if case == "distill-on-policy":  # the finished warm start was taken from its checkpoint, not trained again
        assert any(f"resumed from {ckpt / 'distill-warmup'} after epoch 2" in line for line in printed.splitlines())
    assert weights(killed / "model") == want_weights
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    if stage == "rl":
        assert (killed / "reports" / "curve.csv").read_bytes() == (tmp_path / "ref" / "reports" / "curve.csv").read_bytes()
    assert not ckpt.exists()  # removed once the stage finished
