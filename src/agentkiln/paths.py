"""Where each stage reads and writes, relative to the repository root (mirrors dvc.yaml)."""

from pathlib import Path

TASKS = Path("data/tasks")
SFT_MODEL = Path("models/sft")
RL_MODELS = Path("models/rl")  # one directory per RL stage: models/rl/<stage>
DISTILLED_MODEL = Path("models/distilled")
CHECKPOINTS = Path("models/checkpoints")  # resumable training state; not a DVC output, never versioned
REPORTS = Path("reports")
DATA_DOCS = REPORTS / "data_docs"  # Great Expectations HTML report of the synthesized data


def repo_root() -> Path:
    """Nearest ancestor of the working directory holding dvc.yaml or .git (else the cwd)."""
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        if (d / "dvc.yaml").exists() or (d / ".git").exists():
            return d
    return cwd


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


def stage_writing(name: str, params) -> str:
    """The DVC stage that writes a named policy (`sft`, `rl`, `distilled`)."""
    return {"sft": "sft", "rl": f"rl@{params.rl.final}", "distilled": "distill"}.get(name, name)
