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


def edit(tmp_path, old: str, new: str) -> Path:
    """params.yaml with one line edited as a person would (the text, not a re-dumped mapping)."""
    text = (ROOT / "params.yaml").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "params.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize(
    "old, new, expected",
    [
        # no coercion: a bool, a string or a float is not an int
        ("  epochs: 16\n", "  epochs: true\n", "sft.epochs = True: Input should be a valid integer (got bool"),
        ("  epochs: 16\n", '  epochs: "3"\n', "sft.epochs = '3': Input should be a valid integer (got str"),
        ("    hidden_size: 128\n", "    hidden_size: 1e6\n", "sft.model.hidden_size = 1000000.0: Input should be a valid integer"),
        ("    main: {init: sft}\n", "    main: {init: sft, ppo_epochs: true}\n", "stages.main.ppo_epochs = True: Input should be a valid integer"),
        ("    temperature: 1.0\n", '    temperature: "1.0"\n', "rl.defaults.temperature = '1.0': Input should be a valid number"),
        # finite, bounded numbers
        ("    temperature: 1.0\n", "    temperature: .inf\n", "rl.defaults.temperature = inf: Input should be a finite number"),
        ("    temperature: 1.0\n", "    temperature: 1000\n", "rl.defaults.temperature = 1000: Input should be less than or equal to 100"),
        ("    clip_high: 0.28\n", "    clip_high: .inf\n", "rl.defaults.clip_high = inf: Input should be a finite number"),
        ("    clip_high: 0.28\n", "    clip_high: .nan\n", "rl.defaults.clip_high = nan: Input should be a finite number"),
        ("    kl_coef: 0.0 ", "    kl_coef: 1e300 ", "rl.defaults.kl_coef = 1e+300: Input should be less than or equal to 100"),
        ("    hidden_size: 128\n", "    hidden_size: 1048576\n", "sft.model.hidden_size = 1048576: Input should be less than or equal to 65536"),
        ("{n_tasks: 320,", "{n_tasks: 1e9,", "synthesize.splits.sft.n_tasks = 1000000000.0: Input should be a valid integer"),
        ("{n_tasks: 320,", "{n_tasks: 1000000000,", "synthesize.splits.sft.n_tasks = 1000000000: Input should be less than"),
        ("{n_tasks: 320,", "{n_tasks: 5000,", "synthesize.splits.sft.n_tasks = 5000: Value error, at most 4761 tasks per split"),
        ("\nseed: 0\n", "\nseed: 99999999999\n", "  - seed = 99999999999: Input should be less than or equal to 4294967295"),
        # duplicate keys: YAML keeps the last one silently
        ("  epochs: 16\n", "  epochs: 16\n  epochs: 3\n", "duplicate key sft.epochs (first at line"),
        ("    main: {init: sft}\n", "    main: {init: sft, init: rl/main}\n", "duplicate key rl.stages.main.init"),
        # a model source that is not there fails at load, not later as a hub id
        ("    source: scratch      #", "    source: /nonexistent      #",
         "sft.model.source = '/nonexistent': Value error, model directory /nonexistent does not exist"),
    ],
)
def test_bad_params_are_refused_as_written(tmp_path, old, new, expected):
    path = edit(tmp_path, old, new)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(e.value).startswith(f"{path}: ")
    assert expected in str(e.value)


def test_model_source_must_be_a_model_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    path = edit(tmp_path, "    source: scratch      #", f"    source: {tmp_path / 'empty'}      #")
    with pytest.raises(ParamsError, match=r"sft\.model\.source = .*empty.*has no config\.json"):
        load_params(path)
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert load_params(path).sft.model.source == str(tmp_path / "empty")


def test_numbers_as_written_still_load(tmp_path):
    """An int is a float; 3e-4 (YAML 1.2) is a number, not the string YAML 1.1 makes of it."""
    path = edit(tmp_path, "    temperature: 1.0\n", "    temperature: 2\n")
    assert load_params(path).rl.defaults.temperature == 2.0
    path = edit(tmp_path, "  lr: 0.003\n", "  lr: 3e-3\n")
    assert load_params(path).sft.lr == 0.003


def test_a_duplicate_key_names_both_lines(tmp_path):
    path = edit(tmp_path, "  epochs: 16\n", "  epochs: 16\n  epochs: 3\n")
    first = path.read_text().split("\n").index("  epochs: 16") + 1
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(e.value) == (f"{path}: line {first + 1}: duplicate key sft.epochs (first at line {first}); "
                            "YAML would silently keep the last one: remove one of them")


def test_params_yaml_writes_every_setting():
    """Every setting is written in params.yaml, none left to a code default: each section (a model,
    not the per-entry overrides of rl.stages or the task types) lists every field of its model."""
    from pydantic import BaseModel

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = load_params(ROOT / "params.yaml")
    missing: list[str] = []

    def walk(model: BaseModel, written: dict, where: str) -> None:
        for name in type(model).model_fields:
            if name not in written:
                missing.append(f"{where}{name}")
                continue
            value = getattr(model, name)
            if isinstance(value, BaseModel) and isinstance(written[name], dict):
                walk(value, written[name], f"{where}{name}.")

    walk(params, raw, "")
    per_stage = {"rl.defaults.init"}  # every rl.stages entry must name its own init (validated)
    assert not set(missing) - per_stage, f"params.yaml leaves these to code defaults: {missing}"
