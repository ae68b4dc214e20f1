"""Training episodes, visible and replayable: each RL iteration's logged episodes keep their token ids;
`agentkiln replay` re-scores them under another checkpoint (under the policy that played them it gives
back their behaviour log-probs); the RL stage's trajectory page shows them with their advantages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkiln.config import RLParams
from agentkiln.policy import save_policy
from agentkiln.stages.rl import episode_logger, write_viewer
from agentkiln.trainers import episode_log
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.replay import ReplayError, load_records, replay

from tests.test_async_rl import policy

CLI = Path(sys.executable).parent / "agentkiln"


@pytest.fixture(scope="module")
def logged(lake_pool, tmp_path_factory):
    """A 3-iteration synchronous run that logs 2 episodes per iteration to episodes.jsonl; the
    starting and the trained policy."""
    from tests.conftest import task_texts

    tasks, tasks_dir = lake_pool
    texts = task_texts(tasks, tasks_dir)
    start, trained = policy(texts), policy(texts)
    p = RLParams(iterations=3, tasks_per_iter=2, group_size=4, max_turns=5, lr=5e-2, temperature=1.0,
                 algorithm="grpo", reward={"truncation": {"weight": 0.1}}, minibatch_size=4, log_episodes=2)
    path = tmp_path_factory.mktemp("replay") / "episodes.jsonl"
    mlflow_side = []
    trainer.train_rl(trained, None, tasks, tasks_dir, p, seed=5,
                     log_episodes=episode_logger(path, lambda it, s: mlflow_side.append(it)))
    assert mlflow_side == [1, 2, 3]  # passed on to MLflow as well
    return path, start, trained


def test_the_log_holds_every_iteration_with_replayable_ids(logged):
    path, start, _ = logged
    records = load_records(path)
    assert [it for it, _ in records] == [1, 1, 2, 2, 3, 3]
    for _, rec in records:
        ep = episode_log.episode(rec)
        assert ep.ids[: ep.prompt_len] and ep.windows and rec["temperature"] == 1.0
        for t, tr in zip(ep.turns, rec["turns"]):
            assert len(t.logprobs) == t.end - t.start == tr["tokens"] > 0
            # the reply's ids decode to the reply logged (the ids are what was generated)
            assert start.tokenizer.decode(ep.ids[t.start:t.end], skip_special_tokens=True).strip() in tr["reply"]
    assert len(load_records(path, iteration=2)) == 2


def test_replay_under_the_policy_that_played_gives_back_the_behaviour_log_probs(logged):
    path, start, trained = logged
    first = load_records(path, iteration=1)  # played by version 0: the starting weights
    rows = replay(start, first)
    assert rows and all(abs(r["delta"]) < 1e-4 for r in rows), [r["delta"] for r in rows]
    moved = replay(trained, first)  # three updates later the same replies score differently
    assert max(abs(r["delta"]) for r in moved) > 1e-3
    assert [r["behaviour_logp"] for r in moved] == [r["behaviour_logp"] for r in rows]


def test_bad_logs_are_refused_by_name(logged, tmp_path):
    path, _, _ = logged
    with pytest.raises(ReplayError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    (bad := tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ReplayError, match="bad.json: not a log of training episodes"):
        load_records(bad)
    old = json.loads(path.read_text().splitlines()[0])
    for rec in old["episodes"]:
        del rec["ids"]
    (older := tmp_path / "iteration_0001.json").write_text(json.dumps(old))
    with pytest.raises(ReplayError, match="no token ids"):
        load_records(older)
    with pytest.raises(ReplayError, match=r"no episodes of iteration 9 \(logged: \[1, 2, 3\]\)"):
        load_records(path, iteration=9)


def test_a_resumed_run_replaces_the_iterations_it_plays_again(tmp_path):
    path = tmp_path / "episodes.jsonl"
    log = episode_logger(path)
    for it in (1, 2, 3, 2):  # killed after logging 3, resumed from the checkpoint of iteration 1
        log(it, [{"iteration_played": it}])
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]


def test_the_stage_page_shows_the_first_and_last_iterations_with_advantages(logged, tmp_path):
    path, _, _ = logged
    write_viewer(path, page := tmp_path / "trajectories.html", "main")
    html = page.read_text()
    assert "rl main: training episodes with their advantages" in html
    assert "id='iteration 1'" in html and "id='iteration 3'" in html and "id='iteration 2'" not in html
    assert html.count("advantage ") >= 4 and "policy version" in html
    write_viewer(tmp_path / "none.jsonl", empty := tmp_path / "empty.html", "main")
    assert "none logged" in empty.read_text()


def test_the_replay_command(logged, tmp_path):
    path, start, _ = logged
    save_policy(start, model := tmp_path / "start")
    out = subprocess.run([str(CLI), "replay", str(path), "--model", str(model), "--iteration", "1",
                          "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows and all(abs(r["delta"]) < 1e-4 and r["iteration"] == 1 for r in rows)
    assert "behaviour" in out.stdout and "replayed" in out.stdout and "turns with" in out.stdout
    bad = subprocess.run([str(CLI), "replay", str(tmp_path / "nope.jsonl"), "--model", str(model)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "nope.jsonl: no such file" in bad.stderr


def test_a_resumed_run_logs_the_same_episodes_as_an_uninterrupted_one(lake_pool, tmp_path):
    """A checkpoint keeps the episodes logged so far: a run stopped after iteration 2 and resumed (its
    episodes file gone, as DVC removes a stage's outputs before running it again) writes the very
    file of a run that never stopped."""
    from tests.conftest import task_texts

    tasks, tasks_dir = lake_pool
    texts = task_texts(tasks, tasks_dir)
    p = RLParams(iterations=3, tasks_per_iter=2, group_size=4, max_turns=5, lr=5e-2, temperature=1.0,
                 algorithm="grpo", reward={"truncation": {"weight": 0.1}}, minibatch_size=4, log_episodes=2)
    trainer.train_rl(policy(texts), None, tasks, tasks_dir, p, seed=5,
                     log_episodes=episode_logger(whole := tmp_path / "whole.jsonl"))
    stopped = tmp_path / "stopped.jsonl"
    trainer.train_rl(policy(texts), None, tasks, tasks_dir, p.model_copy(update={"iterations": 2}), seed=5,
                     ckpt_dir=tmp_path / "ckpt", ckpt_key="same run", log_episodes=episode_logger(stopped))
    stopped.unlink()
    trainer.train_rl(policy(texts), None, tasks, tasks_dir, p, seed=5, ckpt_dir=tmp_path / "ckpt",
                     ckpt_key="same run", log_episodes=episode_logger(stopped))
    assert stopped.read_text() == whole.read_text()
    assert [it for it, _ in load_records(stopped)] == [1, 1, 2, 2, 3, 3]
