"""Data contracts (pandera): what every stage may assume about the tables it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors


def _action_is_admissible(df: pd.DataFrame) -> pd.Series:
    return pd.Series([a in json.loads(adm) for a, adm in zip(df["action"], df["admissible"])], index=df.index)


def _steps_are_consecutive(df: pd.DataFrame) -> pd.Series:
    expected = df.groupby("task_id").cumcount()
    return df["step"] == expected


def _admissible_is_json_list(s: pd.Series) -> pd.Series:
    def ok(x: str) -> bool:
        try:
            v = json.loads(x)
        except (TypeError, ValueError):
            return False
        return isinstance(v, list) and all(isinstance(a, str) for a in v)

    return s.map(ok)


ExpertTrajectorySchema = pa.DataFrameSchema(
    {
        "task_id": pa.Column(str, nullable=False),
        "split": pa.Column(str, pa.Check.isin(["sft", "rl"])),
        "game_type": pa.Column(str),
        "step": pa.Column(int, pa.Check.ge(0)),
        "goal": pa.Column(str),
        "observation": pa.Column(str, pa.Check.str_length(min_value=1)),
        "action": pa.Column(str, pa.Check.str_length(min_value=1)),
        "admissible": pa.Column(str, pa.Check(_admissible_is_json_list, error="admissible must be a JSON list of strings")),
        "reward": pa.Column(float, pa.Check.isin([0.0, 1.0])),
        "done": pa.Column(bool),
    },
    checks=[
        pa.Check(_action_is_admissible, error="action must be one of the admissible actions"),
        pa.Check(_steps_are_consecutive, error="steps must run 0, 1, 2, ... within each task (rows in order)"),
    ],
    strict=True,
    ordered=False,
    name="expert_trajectories",
)


def validate_expert_trajectories(df: pd.DataFrame, source: str) -> pd.DataFrame:
    try:
        return ExpertTrajectorySchema.validate(df, lazy=True)
    except (SchemaErrors, SchemaError) as e:
        cases = getattr(e, "failure_cases", None)
        detail = cases[["column", "check"]].drop_duplicates().head(5).to_string(index=False) if cases is not None else str(e)
        raise ValueError(f"{source}: expert trajectory table fails its schema:\n{detail}") from None


def load_expert_trajectories(path: str | Path) -> pd.DataFrame:
    """Read and validate; a corrupt or tampered file raises ValueError naming it and the check."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run the synthesize stage first (dvc repro synthesize)")
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    return validate_expert_trajectories(df, source=str(path))
