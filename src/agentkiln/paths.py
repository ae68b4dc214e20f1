"""Where each stage reads and writes, relative to the repository root (mirrors dvc.yaml)."""

import os
from pathlib import Path

TASKS = Path("data/tasks")
BASE_MODEL = Path("models/base")  # the model every policy starts from (the base stage)
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
    """A model named as in params (`base`, `sft`, `rl/<stage>`, `distilled`) -> its directory."""
    return Path("models") / init


def rl_reports(stage: str) -> Path:
    return REPORTS / "rl" / stage


def rl_curves(params) -> dict[str, Path]:
    """Every RL stage's learning curve, in stage order."""
    return {name: rl_reports(name) / "curve.csv" for name in params.rl.stages}


def model_dirs(params) -> dict[str, Path]:
    """The pipeline's named policies; `rl` is the last RL stage's model."""
    return {"base": BASE_MODEL, "sft": SFT_MODEL, "rl": RL_MODELS / params.rl.final, "distilled": DISTILLED_MODEL}


def stage_writing(name: str, params) -> str:
    """The DVC stage that writes a named policy (`base`, `sft`, `rl`, `distilled`)."""
    return {"base": "base", "sft": "sft", "rl": f"rl@{params.rl.final}", "distilled": "distill"}.get(name, name)


def cache_dir() -> Path:
    """agentkiln's download cache outside the repository (packaged models, vLLM's environment):
    $AGENTKILN_CACHE, else $XDG_CACHE_HOME/agentkiln, else ~/.cache/agentkiln (the scripts use the same rule)."""
    if os.environ.get("AGENTKILN_CACHE"):
        return Path(os.environ["AGENTKILN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentkiln"
