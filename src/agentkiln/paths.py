"""Where each stage reads and writes, relative to the repository root (mirrors dvc.yaml)."""

from pathlib import Path

TASKS = Path("data/tasks")
SFT_MODEL = Path("models/sft")
RL_MODEL = Path("models/rl")
DISTILLED_MODEL = Path("models/distilled")
REPORTS = Path("reports")
DATA_DOCS = REPORTS / "data_docs"  # Great Expectations HTML report of the synthesized data
MODEL_DIRS = {"sft": SFT_MODEL, "rl": RL_MODEL, "distilled": DISTILLED_MODEL}
