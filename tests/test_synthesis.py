"""The synthesize stage: a mixture of families into seeded, verified, disjoint splits (ood held
out; val a second panel of test's kind of tasks), task and expert tables under their schemas (clean
walkthroughs, recovery episodes whose mistakes are flagged, alternative walkthroughs), and the Great
Expectations checkpoint. Tiny params, synthesized twice per module to check reproducibility."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from agentkiln.config import SPLITS, SynthesizeParams
from agentkiln.data_checks import run_checkpoint
from agentkiln.envs import TaskSpec, make
from agentkiln.schemas import load_expert_trajectories, validate_task_table
from agentkiln.synthesis import env_version, stage, synthesize
from agentkiln.synthesis.generate import generate, play_expert
from agentkiln.synthesis.recovery import Extras, extra_episodes, optimal, turn_limit

TYPES = {
    "coin": {"family": "textworld", "level": "easy"},
    "cook": {"family": "textworld", "knobs": {"game": "cooking"}},
    "lake": {"family": "gym-toytext", "knobs": {"game": "frozenlake"}},
    "sok": {"family": "sokoban"},
    "sok_hard": {"family": "sokoban", "level": "hard"},
}
SIZES = {"sft": 4, "rl": 2, "test": 3, "ood": 2, "val": 2}


def tiny(**over) -> SynthesizeParams:
    raw = {
        "workers": 2,
        "max_expert_steps": 40,
        "task_types": TYPES,
        "splits": {
            "sft": {"n_tasks": 4, "seed": 1, "mix": {"coin": 1, "cook": 1, "lake": 1, "sok": 1}},
            "rl": {"n_tasks": 2, "seed": 2, "mix": {"coin": 1, "lake": 1}},
            "test": {"n_tasks": 3, "seed": 3, "mix": {"coin": 1, "lake": 1, "sok": 1}},
            "ood": {"n_tasks": 2, "seed": 4, "mix": {"sok_hard": 1}},
            "val": {"n_tasks": 2, "seed": 5, "mix": {"coin": 1, "lake": 1}},  # a second draw of test's kind of tasks
        },
    }
    return SynthesizeParams.model_validate(raw | over)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same params synthesized twice: here, and in another interpreter with another hash seed."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    code = ("import json, sys\nfrom pathlib import Path\nfrom agentkiln.config import SynthesizeParams\n"
            "from agentkiln.synthesis import synthesize\n"
            "p = SynthesizeParams.model_validate_json(sys.argv[1])\n"
            "print(json.dumps(synthesize(p, Path(sys.argv[2]), progress=False)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, tiny().model_dump_json(), str(b)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return (a, synthesize(tiny(), a, progress=False)), (b, json.loads(out.strip().splitlines()[-1]))


def manifest(root, split) -> dict:
    return json.loads((root / split / "manifest.json").read_text())


def test_layout_manifests_and_summary(runs):
    (root, summary), _ = runs
    for split, n in SIZES.items():
        m = manifest(root, split)
        assert (m["split"], m["seed"], m["n_tasks"]) == (split, tiny().splits[split].seed, n)
        families = {t["family"] for t in m["tasks"]}
        assert m["env_versions"] == {f: env_version(f) for f in families}
        for i, t in enumerate(m["tasks"]):
            task = TaskSpec(**t)
            assert task.task_id == f"{split}-{i:04d}-{task.task_type}"
            assert task.family == TYPES[task.task_type]["family"]
            assert task.seed % 100_000 == i and task.seed // 100_000 == m["seed"]  # no retries needed here
            assert 1 <= task.expert_steps <= 40
            if task.family == "textworld":
                assert (root / task.data["game_file"]).is_file()
        assert summary["splits"][split]["n_tasks"] == n and sum(summary["splits"][split]["by_type"].values()) == n
    referenced = {t["data"].get("game_file") for s in SPLITS for t in manifest(root, s)["tasks"]}
    assert {f"games/{p.name}" for p in (root / "games").glob("*.z8")} == referenced - {None}  # no orphans
    timing = ("seconds", "seconds_per_task")  # the file holds everything but wall-clock timings
    assert json.loads((root / "summary.json").read_text()) == {k: v for k, v in summary.items() if k not in timing}


def test_splits_are_disjoint_and_ood_is_held_out(runs):
    (root, _), _ = runs
    tasks = [TaskSpec(**t) for s in SPLITS for t in manifest(root, s)["tasks"]]
    assert len({t.task_id for t in tasks}) == len({t.seed for t in tasks}) == len(tasks)
    # content, not just ids: replay each task's expert and compare fingerprints
    prints = [play_expert(t, root, 40)[1] for t in tasks]
    assert prints == [t.fingerprint for t in tasks] and len(set(prints)) == len(prints)
    trained = {t.task_type for t in tasks if t.task_id.startswith(("sft", "rl"))}
    assert {t.task_type for t in tasks if t.task_id.startswith("ood")}.isdisjoint(trained)


def test_task_and_expert_tables(runs):
    (root, _), _ = runs
    tasks = validate_task_table(pd.read_parquet(root / "tasks.parquet"), "tasks.parquet")
    assert tasks.groupby("split").size().to_dict() == SIZES
    df = load_expert_trajectories(root / "expert_trajectories.parquet")
    assert set(df["split"]) == {"sft", "rl"}  # the panels' solutions are never training data
    assert set(df["family"]) == {"textworld", "gym-toytext", "sokoban"}
    assert set(df["variant"]) == {"clean", "recovery", "alternative"}
    assert set(df.loc[df["variant"] == "alternative", "family"]) == {"gym-toytext"}  # the one family that has them
    for split in ("sft", "rl"):
        for t in manifest(root, split)["tasks"]:
            rows = df[df["episode"] == f"{t['task_id']}/clean"]
            assert not rows["mistake"].any()
            assert list(rows["step"]) == list(range(t["expert_steps"]))
            assert list(rows["done"]) == [False] * (len(rows) - 1) + [True] and rows["reward"].iloc[-1] == 1.0
            if t["task_type"] == "cook":
                assert rows["action"].iloc[0] == "examine cookbook"


def replay_checks(task: TaskSpec, root, rows: pd.DataFrame) -> None:
    """Replay an extra episode's actions in a fresh environment: the same observations, every
    non-mistake step is the expert's own action from the state it was in (after the mistakes: the
    perturbed state), every flagged step is not, and the episode ends in a win."""
    env = make(task, root, max_turns=turn_limit(task, 40))
    obs = env.reset()
    for r in rows.itertuples():
        assert obs.text == r.observation
        assert (r.action != env.expert_action()) == r.mistake, (task.task_id, r.step)
        res = env.step(r.action)
        assert (res.done, res.reward) == (r.done, r.reward)
        obs = res.observation
    assert env.won and rows["done"].iloc[-1]


def test_recovery_episodes_recover_from_flagged_mistakes(runs):
    (root, summary), _ = runs
    df = load_expert_trajectories(root / "expert_trajectories.parquet")
    tasks = {t["task_id"]: TaskSpec(**t) for s in ("sft", "rl") for t in manifest(root, s)["tasks"]}
    rec = df[df["variant"] == "recovery"]
    assert rec["episode"].nunique() >= 4 and set(rec["family"]) == {"textworld", "gym-toytext", "sokoban"}
    for _, rows in rec.groupby("episode"):
        flags = rows["mistake"].tolist()
        first = flags.index(True)
        k = sum(flags)
        assert 1 <= k <= 2 and flags[first:first + k] == [True] * k  # one block of 1-2 injected steps
        assert not any(flags[first + k:]) and len(flags) > first + k  # then the expert plays on
        clean = df[df["episode"] == f"{rows['task_id'].iloc[0]}/clean"]
        assert rows["action"].iloc[:first].tolist() == clean["action"].iloc[:first].tolist()  # the expert's prefix
        replay_checks(tasks[rows["task_id"].iloc[0]], root, rows)
    kept = sum(summary["splits"][s]["episodes"].get("recovery", 0) for s in ("sft", "rl"))
    dropped = sum(summary["splits"][s]["extra_dropped"] for s in ("sft", "rl"))
    assert kept == rec["episode"].nunique() and kept + dropped >= len(tasks)
    assert "episodes" not in summary["splits"]["test"]  # the panels get no extra episodes


def test_alternative_walkthroughs_are_other_shortest_paths(runs):
    (root, _), _ = runs
    df = load_expert_trajectories(root / "expert_trajectories.parquet")
    tasks = {t["task_id"]: TaskSpec(**t) for s in ("sft", "rl") for t in manifest(root, s)["tasks"]}
    alt = df[df["variant"] == "alternative"]
    assert alt["episode"].nunique() >= 1 and not alt["mistake"].any()
    for _, rows in alt.groupby("episode"):
        task = tasks[rows["task_id"].iloc[0]]
        clean = df[df["episode"] == f"{task.task_id}/clean"]
        assert len(rows) == len(clean) == task.expert_steps  # as short as the expert's
        assert rows["action"].tolist() != clean["action"].tolist()
        env = make(task, root)
        env.reset()
        for a in rows["action"]:
            assert a in optimal(env)
            env.step(a)
        assert env.won


def test_free_form_mistakes_are_wrong_calls_or_garbage(tmp_path):
    """Tool families have no admissible list: a mistake is a wrong tool call or a malformed one, never
    a final answer; the expert recovers; the same task gives the same episodes."""
    tasks = generate("python-tool", 6, seed=7, level="easy", out_dir=tmp_path)
    extras = Extras(episodes_per_task=2, mistakes=(1, 2), alternatives=1)
    n = 0
    for task in tasks:
        clean = play_expert(task, tmp_path, 40)[2]
        eps, dropped = extra_episodes(task, tmp_path, 40, clean, extras)
        assert (eps, dropped) == extra_episodes(task, tmp_path, 40, clean, extras)  # seeded by the task
        assert all(e["variant"] == "recovery" for e in eps)  # python-tool has no alternative paths
        for e in eps:
            rows = pd.DataFrame(e["rows"])
            assert not any(a.startswith("answer[") for a in rows.loc[rows["mistake"], "action"])
            replay_checks(task, tmp_path, rows.assign(step=range(len(rows))))
            n += 1
    assert n >= 6


def test_same_params_same_bytes(runs):
    (a, sa), (b, sb) = runs
    for split in SPLITS:
        assert manifest(a, split) == manifest(b, split)
    for name in ("expert_trajectories.parquet", "tasks.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(a / name), pd.read_parquet(b / name))
    assert (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
    # every file, the compiled TextWorld games included, byte for byte (run b had another hash seed)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert any(f.suffix == ".z8" for f in files)
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
        # and nothing of this machine's installation (another clone has another path)
        assert sys.prefix.encode() not in (a / f).read_bytes() and os.path.realpath(sys.prefix).encode() \
            not in (a / f).read_bytes(), f


def test_corrupt_tables_are_rejected_by_name(runs, tmp_path):
    (root, _), _ = runs
    df = pd.read_parquet(root / "expert_trajectories.parquet")
    cases = {
        "not_admissible.parquet": (df.assign(action="dance"), "admissible"),
        "missing.parquet": (df.drop(columns="goal"), "'goal': missing"),
        "extra.parquet": (df.assign(hint="x"), "'hint': unexpected"),
        "gap.parquet": (df.assign(step=df["step"] * 2), "column step"),
        "empty_action.parquet": (df.assign(action=""), "'action'"),
        "bad_json.parquet": (df.assign(admissible="go east"), "'admissible'"),
        "bad_family.parquet": (df.assign(family="minecraft"), "'family'"),
        "bad_variant.parquet": (df.assign(variant="noisy"), "'variant'"),
        "clean_mistake.parquet": (df.assign(mistake=True), "mistake may be true only in recovery"),
        "bad_episode.parquet": (df.assign(episode=df["task_id"] + "/other"), "column episode must be"),
        "no_clean.parquet": (df[df["variant"] != "clean"], "must include its clean walkthrough"),
    }
    for name, (bad, needle) in cases.items():
        bad.to_parquet(tmp_path / name, index=False)
        with pytest.raises(ValueError) as err:
            load_expert_trajectories(tmp_path / name)
        assert name in str(err.value) and needle in str(err.value), str(err.value)
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="garbage.parquet: not a readable parquet"):
        load_expert_trajectories(tmp_path / "garbage.parquet")
    tasks = pd.read_parquet(root / "tasks.parquet")
    for bad, needle in (
        (tasks.assign(fingerprint=tasks["fingerprint"].iloc[0]), "'fingerprint'"),  # a duplicate task
        (tasks.assign(split="train"), "'split'"),
        (tasks.assign(data="not json"), "'data'"),
        (tasks.assign(env_version="v1"), "env_version"),
    ):
        with pytest.raises(ValueError, match="tasks.parquet: task table fails") as err:
            validate_task_table(bad, "tasks.parquet")
        assert needle in str(err.value), str(err.value)


def test_data_checkpoint_passes_and_names_failures(runs, tmp_path):
    (root, _), _ = runs
    result = run_checkpoint(tiny(), root, tmp_path / "docs")
    assert result["success"] and result["evaluated"] >= 12
    assert (tmp_path / "docs" / "index.html").is_file()
    bad = tmp_path / "bad"
    bad.mkdir()
    tasks = pd.read_parquet(root / "tasks.parquet")
    tasks.assign(seed=0).to_parquet(bad / "tasks.parquet", index=False)  # seeds collide
    experts = pd.read_parquet(root / "expert_trajectories.parquet")
    experts.assign(task_id="test-0000-coin").to_parquet(bad / "expert_trajectories.parquet", index=False)
    with pytest.raises(ValueError) as err:
        run_checkpoint(tiny(), bad, tmp_path / "bad_docs")
    msg = str(err.value)
    assert "expect_column_values_to_be_unique seed" in msg and "expert_trajectories.parquet" in msg
    assert (tmp_path / "bad_docs" / "index.html").is_file()  # the report is written before failing


def test_allot_is_proportional_and_seeded():
    mix = {"a": 0.4, "b": 0.3, "c": 0.3}
    a = stage.allot(mix, 10, seed=1)
    assert sorted(a) == sorted(["a"] * 4 + ["b"] * 3 + ["c"] * 3)
    assert a == stage.allot(mix, 10, seed=1) and len(stage.allot(mix, 1, seed=0)) == 1


def test_unwinnable_tasks_are_retried_then_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "MAX_RETRIES", 1)  # read by the parent process only
    params = tiny(
        workers=1,
        max_expert_steps=1,  # a coin collector at level 2 needs two steps: never admitted
        task_types={"coin": {"family": "textworld", "knobs": {"coin_levels": [2, 2]}}},
        splits={s: {"n_tasks": 1, "seed": k, "mix": {"coin": 1.0}} for k, s in enumerate(SPLITS[:3])},
    )
    with pytest.raises(RuntimeError, match=r"sft task 0 \(coin\): no winnable, unseen task in 2 seeds"):
        synthesize(params, tmp_path / "tasks", progress=False)


def test_a_panel_from_other_environment_code_is_refused(runs, tmp_path):
    import shutil

    from agentkiln.panels import seal
    from agentkiln.stages.common import load_split

    (root, _), _ = runs
    assert [t.task_id for t in load_split(root, "test")] == [t["task_id"] for t in manifest(root, "test")["tasks"]]
    shutil.copytree(root / "test", tmp_path / "test")
    m = manifest(root, "test")
    m["env_versions"]["sokoban"] = "sokoban-agentkiln-000000000000"
    (tmp_path / "test" / "manifest.json").write_text(json.dumps(seal(m)))  # sealed: only the version differs
    with pytest.raises(ValueError, match=r"sokoban tasks were made by environment version sokoban-agentkiln-0+, the code is"):
        load_split(tmp_path, "test")
    (tmp_path / "test" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid task manifest"):
        load_split(tmp_path, "test")


def test_a_tampered_panel_is_refused(runs, tmp_path):
    """Frozen panels: any edit of a sealed manifest (a task's seed, a task dropped, the seal removed)
    is refused before the panel is played; restoring the bytes makes it valid again."""
    import shutil

    from agentkiln.panels import load_manifest, panel_id
    from agentkiln.stages.common import load_split

    (root, _), _ = runs
    shutil.copytree(root / "test", tmp_path / "test")
    shutil.copytree(root / "games", tmp_path / "games")  # the panel's games: sealed with it
    path = tmp_path / "test" / "manifest.json"
    original = path.read_text()
    assert panel_id(tmp_path) == load_manifest(root, "test")["sha256"][:16]
    for tamper in (lambda m: m["tasks"][0].update(seed=m["tasks"][0]["seed"] + 1),
                   lambda m: m["tasks"].pop(),
                   lambda m: m["tasks"][1]["data"].update(tampered=True)):
        m = json.loads(original)
        tamper(m)
        path.write_text(json.dumps(m))
        with pytest.raises(ValueError, match=r"test/manifest.json: the manifest was modified after it was frozen"):
            load_split(tmp_path, "test")
    m = json.loads(original)
    del m["sha256"]
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="has no sha256 field"):
        load_split(tmp_path, "test")
    path.write_text(original)
    assert [t.task_id for t in load_split(tmp_path, "test")] == [t["task_id"] for t in m["tasks"]]


def test_cooking_games_share_one_parse_of_the_knowledge_base_with_the_same_bytes(tmp_path, monkeypatch):
    """A synthesis worker parses the knowledge base cooking.make loads once: a game made after another,
    from the shared parse, has the bytes of the same game made from a parse of its own."""
    from textworld.challenges import cooking
    from textworld.generator.data import KnowledgeBase

    from agentkiln.families import resolve
    from agentkiln.synthesis import textworld_games
    from agentkiln.synthesis.stage import _timed_build

    knobs = resolve("textworld", "easy", game="cooking")
    shared, own = tmp_path / "shared", tmp_path / "own"
    # a worker's first TextWorld build installs the shared parse
    assert _timed_build("textworld", "t", "cook", 7001, knobs, str(shared), 40)["task"] is not None
    # the next game is served by the shared parse: a parse of its own fails the test
    monkeypatch.setattr(KnowledgeBase, "load", classmethod(lambda cls, *a, **k: pytest.fail("parsed again")))
    first = textworld_games.candidate(7002, knobs, shared)
    monkeypatch.undo()
    monkeypatch.setattr(cooking, "KnowledgeBase", KnowledgeBase)  # TextWorld's own: a parse per game
    second = textworld_games.candidate(7002, knobs, own)
    assert first.data == second.data  # the sha256 of the .z8 and .json, the recipe
    for f in sorted((own / "games").glob("tw-7002.*")):
        assert (shared / "games" / f.name).read_bytes() == f.read_bytes(), f.name


def test_cooking_games_compile_without_inform_index_to_the_same_bytes(tmp_path, monkeypatch):
    """A synthesis worker runs Inform 7's ni with --noindex (its Index is thrown away with the project
    folder): the game comes out with the bytes of the same game compiled with the Index written."""
    import subprocess

    from textworld.generator.inform7 import world2inform7

    from agentkiln.families import resolve
    from agentkiln.synthesis import textworld_games, textworld_noindex  # noqa: F401 (installs the flag)

    knobs = resolve("textworld", "easy", game="cooking")
    calls, real = [], subprocess.check_output
    monkeypatch.setattr(subprocess, "check_output", lambda cmd, *a, **k: (calls.append(list(cmd)), real(cmd, *a, **k))[1])
    fast = textworld_games.candidate(7003, knobs, tmp_path / "fast")
    ni = [c for c in calls if Path(c[0]).name == "ni"]
    assert len(ni) == 2 and all("--noindex" in c for c in ni)  # the walkthrough's compile and the game's
    assert not any("--noindex" in c for c in calls if Path(c[0]).name != "ni")
    monkeypatch.setattr(world2inform7, "subprocess", subprocess)  # TextWorld's own call: the Index written
    calls.clear()
    slow = textworld_games.candidate(7003, knobs, tmp_path / "slow")
    assert calls and not any("--noindex" in c for c in calls)
    assert fast.data == slow.data  # the sha256 of the .z8 and .json
    for f in sorted((tmp_path / "slow" / "games").glob("tw-7003.*")):
        assert (tmp_path / "fast" / "games" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_synthesis_worker_compiles_without_the_index():
    """What turns --noindex on in the spawned workers: their first TextWorld build (a fresh interpreter,
    so no other test has installed it before)."""
    from agentkiln.families import resolve

    code = ("import json, sys, tempfile\nfrom textworld.generator.inform7 import world2inform7\n"
            "from agentkiln.synthesis.stage import _timed_build\n"
            "assert type(world2inform7.subprocess).__name__ != '_NoIndex'\n"
            "assert _timed_build('textworld', 't', 'cook', 7004, json.loads(sys.argv[1]), tempfile.mkdtemp(), 40)['task']\n"
            "assert type(world2inform7.subprocess).__name__ == '_NoIndex'")
    subprocess.run([sys.executable, "-c", code, json.dumps(resolve("textworld", "easy", game="cooking"))], check=True)
