"""Where each stage reads and writes, relative to the repository root (mirrors dvc.yaml)."""

from pathlib import Path

TASKS = Path("data/tasks")
SFT_MODEL = Path("models/sft")
RL_MODELS = Path("models/rl")  # one directory per RL stage: models/rl/<stage>
DISTILLED_MODEL = Path("models/distilled")
CHECKPOINTS = Path("models/checkpoints")  # resumable training state; not a DVC output, never versioned
REPORTS = Path("reports")
DATA_DOCS = REPORTS / "data_docs"  # Great Expectations HTML report of the synthesized data


def model_dir(init: str) -> Path:
    """A model named as in params (`sft`, `rl/<stage>`, `distilled`) -> its directory."""
    return Path("models") / init


def rl_reports(stage: str) -> Path:
    return REPORTS / "rl" / stage


def rl_curves(params) -> dict[str, Path]:
    """Every RL stage's learning curve, in stage order."""
    return {name: rl_reports(name) / "curve.csv" for name in params.rl.stages}


def model_dirs(params) -> dict[str, Path]:
    """The pipeline's named policies; `rl` is the last RL stage's model."""
    return {"sft": SFT_MODEL, "rl": RL_MODELS / params.rl.final, "distilled": DISTILLED_MODEL}
