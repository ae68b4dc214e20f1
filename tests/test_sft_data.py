"""SFT's training episodes (`sft.data`): clean-only reproduces the walkthrough list SFT trained on
before recovery data existed; variant weights take seeded shares; a recovery episode's mistakes
reach SFT flagged; a saved policy's own won episodes join the data (rejection sampling)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from agentkiln.config import SFTDataParams
from agentkiln.policy import AgentFormat
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.schemas import load_expert_trajectories
from agentkiln.stages.sft import corpus, run_sft
from agentkiln.stages.sft_data import mixture, used_variants
from agentkiln.seeding import seed_everything
from agentkiln.stages.common import expert_episodes

from tests.conftest import params_with, tiny_dataset

MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vocab_size": 400,
         "max_context": 1024}
MIX = {"frozenlake_easy": 0.5, "python_words": 0.5}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("sftdata") / "tasks", {"sft": MIX, "rl": MIX, "test": MIX},
                        n={"sft": 8, "rl": 4, "test": 2})


def table(tasks_dir) -> pd.DataFrame:
    return load_expert_trajectories(tasks_dir / "expert_trajectories.parquet")


def before_recovery(df: pd.DataFrame) -> list[Episode]:
    """How the SFT stage turned the expert table into episodes when it held one walkthrough per task."""
    out = []
    for g, (task_id, rows) in enumerate(df.sort_values(["task_id", "step"]).groupby("task_id", sort=True)):
        first = rows.iloc[0]
        ep = Episode(task_id, first.family, g, first.task_type, goal=first.goal, won=bool(rows["done"].iloc[-1]))
        ep.turns = [Turn(r.observation, json.loads(r.admissible), "", reply=r.action, action=r.action, reward=r.reward)
                    for r in rows.itertuples()]
        out.append(ep)
    return out


def test_clean_only_is_the_recipe_before_recovery_data(tasks_dir):
    df = table(tasks_dir)
    clean_only = SFTDataParams(clean=1.0, recovery=0.0, alternative=0.0)
    got, counts = mixture(df[df["split"] == "sft"], clean_only, seed=0)
    old = before_recovery(df[(df["split"] == "sft") & (df["variant"] == "clean")])
    assert got == old and counts == {"clean": 8}
    # the scratch tokenizer's text: every sft + rl walkthrough, as before
    fmt = AgentFormat()
    pool = expert_episodes(df[df["variant"].isin(used_variants(clean_only))])
    assert corpus(fmt, pool) == corpus(fmt, before_recovery(df[df["variant"] == "clean"]))


def test_weights_take_seeded_shares_and_mistakes_reach_sft(tasks_dir):
    df = table(tasks_dir)
    sft = df[df["split"] == "sft"]
    n_rec = sft.loc[sft["variant"] == "recovery", "episode"].nunique()
    n_alt = sft.loc[sft["variant"] == "alternative", "episode"].nunique()
    assert n_rec >= 4 and n_alt >= 1
    half = SFTDataParams(clean=1.0, recovery=0.5, alternative=2.0)
    eps, counts = mixture(sft, half, seed=0)
    assert counts == {"clean": 8, "recovery": round(n_rec / 2), "alternative": 2 * n_alt}
    assert mixture(sft, half, seed=0)[0] == eps  # seeded
    recovery = eps[8 : 8 + counts["recovery"]]
    assert all(any(t.mistake for t in ep.turns) and not ep.turns[-1].mistake and ep.won for ep in recovery)
    assert not any(t.mistake for ep in eps[:8] + eps[8 + counts["recovery"]:] for t in ep.turns)


def test_sft_trains_on_recovery_and_its_own_wins(tasks_dir, tmp_path):
    seed_everything(0, 2)
    first = params_with({"sft": {"epochs": 1, "batch_size": 4, "warmup_steps": 1, "model": MODEL,
                                 "data": {"clean": 1.0, "recovery": 1.0, "alternative": 0.0}}})
    m = run_sft(first, tasks_dir, tmp_path / "round1")
    n_rec = table(tasks_dir).query("split == 'sft' and variant == 'recovery'")["episode"].nunique()
    assert (m["n_episodes_clean"], m["n_episodes_recovery"]) == (8, n_rec) and m["n_episodes"] == 8 + n_rec
    again = params_with({"sft": {"epochs": 1, "batch_size": 4, "warmup_steps": 1, "model": MODEL,
                                 "data": {"recovery": 0.0, "own_wins": {"policy": str(tmp_path / "round1"),
                                                                        "samples_per_task": 2}}}})
    m2 = run_sft(again, tasks_dir, tmp_path / "round2")
    assert m2["n_episodes_own_played"] == 16 and m2["n_episodes"] == 8 + m2["n_episodes_own_wins"]
    missing = params_with({"sft": {"data": {"own_wins": {"policy": str(tmp_path / "nope")}}}})
    with pytest.raises(FileNotFoundError, match="own_wins.policy"):
        run_sft(missing, tasks_dir, tmp_path / "round3")
