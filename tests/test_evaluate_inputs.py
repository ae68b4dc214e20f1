"""The evaluate stage reads and checks every input before any of its work: a garbage RL curve, a curve
missing a column or holding a non-number, or a damaged model is refused at once (no episode played,
nothing written), in one line naming the file, what is wrong and the stage to re-run; the curves the
RL stage writes (a column absent from some rows included) pass and are plotted."""

from __future__ import annotations

import json
import time

import pytest

from agentkiln.artifacts import ArtifactError
from tests.conftest import merge, params_with, scratch_policy, tiny_dataset

EVAL = {"evaluate": {"policies": ["random", "oracle", "sft"], "compare": [["sft", "random"]],
                     "pass_k": {"samples": 2, "policies": ["sft"]}, "n_boot": 200},
        "promote": {"candidates": ["sft"]}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny test panel, a saved (untrained) sft policy, and an RL curve as the RL stage writes it."""
    from agentkiln.panels import load_panel
    from agentkiln.policy import save_policy
    from agentkiln.stages.rl import write_curve

    root = tmp_path_factory.mktemp("eval-inputs")
    lake = {"frozenlake_easy": 1.0}
    tasks_dir = tiny_dataset(root / "tasks", {"sft": lake, "rl": lake, "test": lake}, n={"sft": 2, "rl": 2, "test": 4})
    save_policy(scratch_policy(load_panel(tasks_dir, "sft"), tasks_dir), root / "models" / "sft")
    # rows as train_rl logs them: no kl without a reference, no entropy in an iteration with nothing to train
    write_curve([{"iteration": 1, "episodes": 4, "success": 0.25, "entropy": 1.5},
                 {"iteration": 2, "episodes": 8, "success": 0.5, "kl": 0.01}], root / "reports" / "rl" / "main" / "curve.csv")
    return root


def curves(root):
    return {"main": root / "reports" / "rl" / "main" / "curve.csv"}


def test_the_curve_the_rl_stage_writes_is_accepted_and_plotted(world, tmp_path):
    from agentkiln.stages.evaluate import run_evaluate

    metrics = run_evaluate(params_with(EVAL), world / "tasks", {"sft": world / "models" / "sft"}, tmp_path / "reports",
                           curves(world))
    assert set(metrics) == {"random", "oracle", "sft"} and metrics["oracle"]["success"] == 1.0
    assert (tmp_path / "reports" / "curves.png").stat().st_size > 10_000  # a plot, not the "no curve" note


BAD_CURVES = {  # content -> what the refusal says
    "garbage text": (b"Traceback (most recent call last):\n  File x, line 1\nKeyError: 'boom'\n",
                     "missing column 'iteration'"),
    "garbage bytes": (bytes(range(256)) * 4, "cannot be read (UnicodeDecodeError"),
    "missing column": (b"iteration,episodes,kl,entropy\n1,4,0.0,1.5\n2,8,0.01,1.4\n", "missing column 'success'"),
    "not a number": (b"iteration,success,kl\n1,0.25,0.0\n2,n/a,0.01\n", "line 3: column 'success' is not a number"),
    "not a rate": (b"iteration,success\n1,0.25\n2,25\n", "line 3: success 25.0 is not a rate in [0, 1]"),
    "ragged row": (b"iteration,success\n1,0.25,7\n", "line 2 has 3 values for 2 columns"),
    "empty": (b"", "empty: no header row"),
}


@pytest.mark.parametrize("case", list(BAD_CURVES))
def test_a_bad_rl_curve_is_refused_before_any_episode_is_played(world, case, tmp_path):
    from agentkiln.stages.evaluate import check_inputs, run_evaluate

    content, problem = BAD_CURVES[case]
    curve = tmp_path / "reports" / "rl" / "main" / "curve.csv"
    curve.parent.mkdir(parents=True)
    curve.write_bytes(content)
    params, models = params_with(EVAL), {"sft": world / "models" / "sft"}
    check_inputs(params, world / "tasks", models, curves(world))  # the same inputs with the good curve pass
    with pytest.raises(ArtifactError) as checked:
        check_inputs(params, world / "tasks", models, {"main": curve})
    start = time.monotonic()
    with pytest.raises(ArtifactError) as stage:
        run_evaluate(params, world / "tasks", models, tmp_path / "out", {"main": curve})
    assert time.monotonic() - start < 1.0  # at once: the evaluation itself takes seconds
    assert not (tmp_path / "out").exists()  # nothing played nor written (it used to write outcomes.json first)
    msg = str(stage.value)
    assert msg == str(checked.value) and "\n" not in msg
    assert msg.startswith(f"{curve}: ") and problem in msg, msg
    assert msg.endswith("re-run the stage that writes it: `agentkiln stage rl@main` (or `dvc repro rl@main`)"), msg


def test_a_damaged_model_is_refused_before_the_other_policies_are_played(world, tmp_path):
    import shutil

    from agentkiln.stages.evaluate import run_evaluate

    model = tmp_path / "models" / "distilled"  # evaluated last: the old stage played sft (seconds) first
    shutil.copytree(world / "models" / "sft", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated
    params = params_with(merge(json.loads(json.dumps(EVAL)), {"evaluate": {"policies": ["random", "oracle", "sft",
                                                                                         "distilled"]}}))
    start = time.monotonic()
    with pytest.raises(ArtifactError, match=rf"^{weights}: content changed since it was saved"):
        run_evaluate(params, world / "tasks", {"sft": world / "models" / "sft", "distilled": model}, tmp_path / "out",
                     curves(world))
    assert time.monotonic() - start < 1.0 and not (tmp_path / "out").exists()


def test_an_unknown_panel_is_named_with_the_splits_there_are(world, tmp_path):
    from agentkiln.panels import load_panel

    with pytest.raises(FileNotFoundError, match=r"no split 'nope' under .*: its splits are rl, sft, test \(params.yaml"):
        load_panel(world / "tasks", "nope")  # synthesis ran: the name is wrong, nothing to re-synthesize
    with pytest.raises(FileNotFoundError, match="missing; run the synthesize stage first"):
        load_panel(tmp_path / "tasks", "test")  # nothing synthesized yet
