"""Data contracts (pandera): what every stage may assume about the tables it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors
from pandera.typing.pandas import Series

from agentkiln.config import SPLITS
from agentkiln.envs import FAMILIES


VARIANTS = ("clean", "recovery", "alternative")  # the expert table's episodes (agentkiln.synthesis.recovery)
_FREE_FORM = "null"  # the admissible column of a free-form family's step (tool calls): JSON null


def _json_list(x) -> list | None:
    try:
        v = json.loads(x)
    except (TypeError, ValueError):
        return None
    return v if isinstance(v, list) and all(isinstance(a, str) for a in v) else None


def _json_dict(x) -> bool:
    try:
        return isinstance(json.loads(x), dict)
    except (TypeError, ValueError):
        return False


class ExpertTrajectorySchema(pa.DataFrameModel):
    """One row per step of every episode of every sft and rl task (`expert_trajectories.parquet`):
    the task's `clean` expert walkthrough and the `recovery` / `alternative` episodes synthesis adds
    (agentkiln.synthesis.recovery), each named by `episode`. `observation` is what the agent saw before
    acting; `admissible` is that state's JSON list of actions, or JSON null for free-form families.
    `mistake` flags a recovery episode's injected wrong actions: data, trained as context only."""

    task_id: Series[str] = pa.Field(str_length={"min_value": 1})
    split: Series[str] = pa.Field(isin=["sft", "rl"])  # test walkthroughs are never training data
    family: Series[str] = pa.Field(str_length={"min_value": 1})
    task_type: Series[str] = pa.Field(str_length={"min_value": 1})
    episode: Series[str] = pa.Field(str_length={"min_value": 1})
    variant: Series[str] = pa.Field(isin=list(VARIANTS))
    step: Series[int] = pa.Field(ge=0)
    goal: Series[str]
    observation: Series[str] = pa.Field(str_length={"min_value": 1})
    action: Series[str] = pa.Field(str_length={"min_value": 1})
    admissible: Series[str]
    reward: Series[float] = pa.Field(isin=[0.0, 1.0])
    done: Series[bool]
    mistake: Series[bool]

    @pa.check("family", name="known_family")
    def _known_family(cls, family: Series[str]) -> Series[bool]:
        return family.isin(list(FAMILIES))  # at validation time: plugins register families after import

    class Config:
        strict = True  # an extra column means a producer/consumer mismatch: fail loudly
        name = "expert_trajectories"

    @pa.check("admissible", error="admissible must be a JSON list of strings or null (free-form)")
    def admissible_is_json_list(cls, s: Series[str]) -> Series[bool]:
        return s.map(lambda x: x == _FREE_FORM or _json_list(x) is not None)

    @pa.dataframe_check(error="column action must be one of the actions in column admissible")
    def action_is_admissible(cls, df: pd.DataFrame) -> Series[bool]:
        return pd.Series(
            [adm == _FREE_FORM or a in (_json_list(adm) or []) for a, adm in zip(df["action"], df["admissible"])],
            index=df.index,
        )

    @pa.dataframe_check(error="column step must run 0, 1, 2, ... within each episode (rows in order)")
    def steps_are_consecutive(cls, df: pd.DataFrame) -> Series[bool]:
        return df["step"] == df.groupby("episode").cumcount()

    @pa.dataframe_check(error="column episode must be '<task_id>/<variant>' or '<task_id>/<variant>-<j>'")
    def episode_names_task_and_variant(cls, df: pd.DataFrame) -> Series[bool]:
        return pd.Series([e == f"{t}/{v}" or (e.startswith(f"{t}/{v}-") and e.rsplit("-", 1)[1].isdigit())
                          for e, t, v in zip(df["episode"], df["task_id"], df["variant"])], index=df.index)

    @pa.dataframe_check(error="column mistake may be true only in recovery episodes, on steps that do not end them")
    def mistakes_only_in_recovery(cls, df: pd.DataFrame) -> Series[bool]:
        return ~df["mistake"] | ((df["variant"] == "recovery") & ~df["done"] & (df["reward"] == 0.0))

    @pa.dataframe_check(error="every task's episodes must include its clean walkthrough")
    def every_task_has_a_clean_episode(cls, df: pd.DataFrame) -> Series[bool]:
        clean = set(df.loc[df["variant"] == "clean", "task_id"])
        return df["task_id"].isin(clean)


class TaskTableSchema(pa.DataFrameModel):
    """One row per synthesized task of every split (`tasks.parquet`): the versioned task set."""

    task_id: Series[str] = pa.Field(unique=True, str_length={"min_value": 1})
    split: Series[str] = pa.Field(isin=list(SPLITS))
    family: Series[str] = pa.Field(str_length={"min_value": 1})
    task_type: Series[str] = pa.Field(str_length={"min_value": 1})
    seed: Series[int] = pa.Field(ge=0)
    expert_steps: Series[int] = pa.Field(ge=1)
    fingerprint: Series[str] = pa.Field(unique=True, str_matches=r"^[0-9a-f]{40}$")  # deduplicated
    difficulty: Series[str]
    data: Series[str]
    env_version: Series[str] = pa.Field(str_length={"min_value": 1})

    @pa.check("family", name="known_family")
    def _known_family(cls, family: Series[str]) -> Series[bool]:
        return family.isin(list(FAMILIES))  # at validation time: plugins register families after import

    class Config:
        strict = True
        name = "tasks"

    @pa.check("difficulty", "data", error="must be a JSON object")
    def is_json_object(cls, s: Series[str]) -> Series[bool]:
        return s.map(_json_dict)

    @pa.dataframe_check(error="env_version must start with the task's family")
    def version_names_family(cls, df: pd.DataFrame) -> Series[bool]:
        return pd.Series([v.startswith(f + "-") for f, v in zip(df["family"], df["env_version"])], index=df.index)


def _describe(cases: pd.DataFrame) -> list[str]:
    """One readable line per failing check, from pandera's failure-case table."""
    lines = []
    groups = cases.groupby(["schema_context", "column", "check"], sort=False, dropna=False)
    for (context, column, check), rows in groups:
        first = rows.iloc[0]
        if check in ("column_in_dataframe", "column_in_schema"):
            what = "missing" if check == "column_in_dataframe" else "unexpected"
            lines += [f"column {c!r}: {what} ({check})" for c in rows["failure_case"]]
        elif context == "DataFrameSchema":  # a table-level check reports every column of a bad row
            line = f"table check failed: {check} (first bad row: {first['index']})"
            lines += [line] if line not in lines else []
        else:
            where = "" if first["index"] is None else f" at row {first['index']}"
            lines.append(f"column {column!r}: check {check} failed (e.g. {first['failure_case']!r}{where})")
    return lines


def _validate(schema, df: pd.DataFrame, source: str, what: str) -> pd.DataFrame:
    """Validate all checks at once; raise ValueError naming `source` and each failing column/check."""
    try:
        return schema.validate(df, lazy=True)
    except SchemaErrors as e:
        detail = "\n".join(f"  - {line}" for line in _describe(e.failure_cases))
    except SchemaError as e:
        detail = f"  - {e}"
    raise ValueError(f"{source}: {what} fails its schema:\n{detail}")


def validate_expert_trajectories(df: pd.DataFrame, source: str) -> pd.DataFrame:
    return _validate(ExpertTrajectorySchema, df, source, "expert trajectory table")


def validate_task_table(df: pd.DataFrame, source: str) -> pd.DataFrame:
    return _validate(TaskTableSchema, df, source, "task table")


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


class CollectedEpisodeSchema(pa.DataFrameModel):
    """One row per episode of a collected split (`agentkiln collect`): episodes recorded by the endpoint,
    token ids as served. `won` / `reward` are the client's posted outcome (null: never rewarded)."""

    episode_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    task_id: Series[str]
    family: Series[str]
    model: Series[str] = pa.Field(str_length={"min_value": 1})
    model_version: Series[str] = pa.Field(str_length={"min_value": 1})
    tokenizer: Series[str] = pa.Field(str_length={"min_value": 16})
    turns: Series[int] = pa.Field(ge=1)
    n_ids: Series[int] = pa.Field(ge=2)
    rewarded: Series[bool]
    reward: Series[float] = pa.Field(nullable=True)
    won: Series[pd.BooleanDtype] = pa.Field(nullable=True)
    retokenized: Series[bool]
    spans_ok: Series[bool] = pa.Field(isin=[True])  # every reply's span inside the ids, one log-prob per token

    class Config:
        strict = True
        name = "collected_episodes"


def validate_collected(df: pd.DataFrame, source: str) -> pd.DataFrame:
    return _validate(CollectedEpisodeSchema, df, source, "collected episode table")
