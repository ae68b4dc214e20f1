"""Synthesis: seeded, verified, disjoint splits; the expert table's contract. Tiny params (4 games
per run, every game type once), synthesized twice per module to check reproducibility."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from agentkiln.config import SynthesizeParams
from agentkiln.envs import TaskSpec
from agentkiln.schemas import load_expert_trajectories
from agentkiln.synthesis import env_version, synthesize
from agentkiln.synthesis import textworld_games as tg

GAME_TYPES = {
    "coin_easy": {"challenge": "coin_collector", "level_min": 1, "level_max": 10},
    "coin_deadends": {"challenge": "coin_collector", "level_min": 101, "level_max": 110},
    "cooking": {"challenge": "cooking", "recipe": 1, "take": 1, "go": 1},
}
MIX = {"coin_easy": 0.4, "coin_deadends": 0.3, "cooking": 0.3}


def tiny(**over) -> SynthesizeParams:
    raw = {
        "workers": 2,
        "max_expert_steps": 40,
        "game_types": GAME_TYPES,
        "splits": {
            "sft": {"n_games": 2, "seed": 1, "mix": {"coin_easy": 1, "cooking": 1}},
            "rl": {"n_games": 1, "seed": 2, "mix": {"coin_deadends": 1}},
            "test": {"n_games": 1, "seed": 3, "mix": MIX},
        },
    }
    return SynthesizeParams.model_validate(raw | over)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    return (a, synthesize(tiny(), a, progress=False)), (b, synthesize(tiny(), b, progress=False))


def manifest(root, split) -> dict:
    return json.loads((root / split / "manifest.json").read_text())


def test_layout_manifests_and_summary(runs):
    (root, summary), _ = runs
    assert env_version().startswith("textworld-") and "+agentkiln-" in env_version()
    for split, n, seed in (("sft", 2, 1), ("rl", 1, 2), ("test", 1, 3)):
        m = manifest(root, split)
        assert (m["split"], m["seed"], m["n_tasks"], m["env_version"]) == (split, seed, n, env_version())
        for i, t in enumerate(m["tasks"]):
            task = TaskSpec(**t)
            assert task.task_id == f"{split}-{i:04d}-{task.game_type}" and task.family == "textworld"
            assert task.seed % 100_000 == i and task.seed // 100_000 == seed  # no retries needed here
            assert (root / task.game_file).is_file() and task.game_file.endswith(".z8")
            assert not (root / task.game_file).with_suffix(".ni").exists()
            assert 1 <= task.expert_steps <= 40
            if task.difficulty["challenge"] == "coin_collector":
                spec = GAME_TYPES[task.game_type]
                assert spec["level_min"] <= task.difficulty["level"] <= spec["level_max"]
        assert summary["splits"][split]["n_tasks"] == n and sum(summary["splits"][split]["by_type"].values()) == n
    # the file holds everything but wall-clock timings (same params, same bytes)
    timing = ("seconds", "seconds_per_game")
    assert json.loads((root / "summary.json").read_text()) == {k: v for k, v in summary.items() if k not in timing}
    assert summary["rejected"] >= 0 and set(summary["seconds_per_game"]) <= set(GAME_TYPES)


def test_splits_are_disjoint(runs):
    (root, _), _ = runs
    tasks = [t for s in tg.SPLITS for t in manifest(root, s)["tasks"]]
    assert len({t["task_id"] for t in tasks}) == len({t["seed"] for t in tasks}) == len(tasks)
    # content, not just ids: replay each game's expert and compare fingerprints
    prints = [tg._play_expert(root / t["game_file"], 40)[1] for t in tasks]
    assert len(set(prints)) == len(prints)


def test_expert_table_matches_manifests_and_schema(runs):
    (root, _), _ = runs
    df = load_expert_trajectories(root / "expert_trajectories.parquet")
    assert set(df["split"]) == {"sft", "rl"}  # the test panel's walkthroughs are never training data
    assert set(df["game_type"]) == set(GAME_TYPES)
    for split in ("sft", "rl"):
        for t in manifest(root, split)["tasks"]:
            rows = df[df["task_id"] == t["task_id"]]
            assert list(rows["step"]) == list(range(t["expert_steps"]))
            assert list(rows["reward"]) == [0.0] * (len(rows) - 1) + [1.0]
            assert list(rows["done"]) == [False] * (len(rows) - 1) + [True]
            if t["game_type"] == "cooking":
                assert rows["action"].iloc[0] == "examine cookbook"


def test_same_params_same_tasks_and_trajectories(runs):
    (a, sa), (b, sb) = runs
    for split in tg.SPLITS:
        assert manifest(a, split) == manifest(b, split)
    pd.testing.assert_frame_equal(
        pd.read_parquet(a / "expert_trajectories.parquet"), pd.read_parquet(b / "expert_trajectories.parquet")
    )
    assert sa["splits"] == sb["splits"]


def test_corrupt_expert_table_is_rejected_by_name(runs, tmp_path):
    (root, _), _ = runs
    df = pd.read_parquet(root / "expert_trajectories.parquet")
    cases = {
        "not_admissible.parquet": (df.assign(action="dance"), "admissible"),
        "missing.parquet": (df.drop(columns="goal"), "'goal': missing"),
        "extra.parquet": (df.assign(hint="x"), "'hint': unexpected"),
        "gap.parquet": (df.assign(step=df["step"] * 2), "column step"),
        "empty_action.parquet": (df.assign(action=""), "'action'"),
        "bad_json.parquet": (df.assign(admissible="go east"), "'admissible'"),
    }
    for name, (bad, needle) in cases.items():
        bad.to_parquet(tmp_path / name, index=False)
        with pytest.raises(ValueError) as err:
            load_expert_trajectories(tmp_path / name)
        assert name in str(err.value) and needle in str(err.value), str(err.value)
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="garbage.parquet: not a readable parquet"):
        load_expert_trajectories(tmp_path / "garbage.parquet")


def test_allot_is_proportional_and_seeded():
    a = tg.allot(MIX, 10, seed=1)
    assert sorted(a) == sorted(["coin_easy"] * 4 + ["coin_deadends"] * 3 + ["cooking"] * 3)
    assert a == tg.allot(MIX, 10, seed=1) and len(tg.allot(MIX, 1, seed=0)) == 1


def test_unwinnable_games_are_retried_then_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(tg, "MAX_RETRIES", 1)  # read by the parent process only
    params = tiny(
        workers=1,
        max_expert_steps=1,  # level 2 needs two steps: never admitted
        game_types={"coin_easy": {"challenge": "coin_collector", "level_min": 2, "level_max": 2}},
        splits={s: {"n_games": 1, "seed": k, "mix": {"coin_easy": 1.0}} for k, s in enumerate(tg.SPLITS)},
    )
    with pytest.raises(RuntimeError, match=r"sft task 0 \(coin_easy\): no winnable, unseen game in 2 seeds"):
        synthesize(params, tmp_path / "tasks", progress=False)
    assert not list((tmp_path / "tasks" / "games").glob("*.z8"))  # rejected games are deleted
