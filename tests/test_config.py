"""params.yaml is validated at load: bad params stop with a message naming the field."""

from pathlib import Path

import pytest
import yaml

from agentkiln.config import ParamsError, load_params

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, mutate):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))  # the order of rl.stages matters
    return path


def test_repository_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.synthesize.splits["test"].n_tasks >= 100  # the frozen panel is at least 100 tasks
    assert len(p.synthesize.families(("sft", "rl", "test"))) >= 3  # a mixture of families
    assert "ood" in p.synthesize.splits


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["rl"]["defaults"].update(learning_rate=1e-4), "rl.defaults.learning_rate: unknown key"),
        (lambda r: r["sft"].update(epochs="many"), "sft.epochs = 'many'"),
        (lambda r: r["rl"]["defaults"].update(group_size=1), "rl.defaults.group_size = 1"),
        (lambda r: r["rl"]["defaults"].update(algorithm="a2c"), "rl.defaults.algorithm = 'a2c'"),
        (lambda r: r["rl"]["stages"].update(late={"init": "sft", "lr": 2}), "stages.late.lr = 2: Input should be less than 1"),
        (lambda r: r["rl"]["stages"].update(late={"init": "rl/nowhere"}), "stages.late.init = 'rl/nowhere': must be one of sft, rl/main"),
        (lambda r: r["rl"]["stages"].update(late={"max_turns": 5}), "stages.late: a mapping with at least `init`"),
        (lambda r: r["rl"]["stages"].update(late={"init": "sft", "policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"}),
         "policy_loss gspo has its own"),
        (lambda r: r["synthesize"]["splits"]["rl"].update(seed=1), "seeds must differ"),
        (lambda r: r["synthesize"]["splits"]["test"]["mix"].update(mystery=0.5), "splits.test.mix.mystery: unknown task type"),
        (lambda r: r["synthesize"]["splits"]["rl"]["mix"].update(frozenlake_medium=0.5), "splits.ood.mix: ['frozenlake_medium'] also in sft/rl"),
        (lambda r: r["synthesize"]["task_types"].update(x={"family": "chess"}), "task_types.x: Value error, unknown environment family 'chess'"),
        (lambda r: r["synthesize"]["task_types"].update(x={"family": "sokoban", "level": "epic"}), "sokoban: unknown level 'epic'"),
        (lambda r: r["synthesize"]["task_types"].update(x={"family": "sokoban", "knobs": {"colour": 1}}), "unknown difficulty knob(s) ['colour']"),
        (lambda r: r["synthesize"]["task_types"].update(x={"family": "textworld", "knobs": {"go": 7}}), "textworld: knob go = 7"),
        (lambda r: r["rl"]["defaults"].update(max_turns=0), "rl.defaults.max_turns = 0"),
        (lambda r: r["sft"]["model"].update(hidden_size=130), "divisible by num_heads"),
        (lambda r: r.update(extra_section={}), "extra_section: unknown key"),
        (lambda r: r["evaluate"].update(policies=["random", "teacher"]), "evaluate.policies.1 = 'teacher'"),
    ],
)
def test_bad_params_name_the_field(tmp_path, mutate, expected):
    path = write(tmp_path, mutate)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(path) in str(e.value)
    assert expected in str(e.value)


def test_unparsable_and_missing_files(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("seed: [1, 2\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")


def test_cli_refuses_bad_params_before_any_work(tmp_path):
    import subprocess
    import sys

    write(tmp_path, lambda r: r["rl"]["defaults"].update(lr=-1))
    for pkg in ("flows", "tasks"):
        (tmp_path / pkg).symlink_to(ROOT / pkg)
    out = subprocess.run([sys.executable, "-m", "flows.rl"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "rl.defaults.lr = -1" in out.stderr
    assert not (tmp_path / "models").exists()
