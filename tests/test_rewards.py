"""The reward subsystem (agentkiln.rewards): every component by value on hand-built episodes, the
per-episode bound, adaptive weights, the online process model, the judge, the expert distances on
real environments, and the reward section of params (per-stage merge, validation)."""

import random
from pathlib import Path

import pytest
import yaml

from agentkiln.config import ModelParams, Params, ParamsError, RewardParams, RLParams, load_params
from agentkiln.envs import Env, make
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.rewards import RewardState, needs_potentials, observe_iteration, turn_rewards
from agentkiln.rewards.adaptive import SuccessEMA
from agentkiln.rewards.components import Context, overlong
from agentkiln.rewards.judge import Judge, agreement
from agentkiln.rewards.potential import potential
from agentkiln.rewards.process import ProcessModel
from agentkiln.rollout.agents import RandomAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.potentials import ENDED, UNREACHABLE
from agentkiln.synthesis.generate import generate
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.credit import shaped_turn_rewards

from tests.conftest import task_texts
from tests.test_python_tool import COUNTDOWN

ROOT = Path(__file__).resolve().parents[1]


def ep(rewards=(0.0,), won=False, max_turns=10, to_go=None, end=None, group=0, task_type="lake", **flags) -> Episode:
    """An episode of len(rewards) turns; flags: per-turn lists of invalid / parsed / n_tokens / action."""
    e = Episode("t", "gym-toytext", group, task_type, max_turns, "goal", won=won, end_to_go=end)
    for k, r in enumerate(rewards):
        t = Turn(f"obs {k}", ["a"], f"s{k}", reward=r, to_go=None if to_go is None else to_go[k])
        t.invalid = flags.get("invalid", [False] * len(rewards))[k]
        t.parsed = flags.get("parsed", [True] * len(rewards))[k]
        t.end = flags.get("n_tokens", [0] * len(rewards))[k]
        t.action = flags.get("action", ["a"] * len(rewards))[k]
        e.turns.append(t)
    return e


def params(bound=0.5, **weights) -> RLParams:
    reward = {"bound": bound} | {k: v if isinstance(v, dict) else {"weight": v} for k, v in weights.items()}
    return RLParams(reward=reward)


def rewards(episodes, p: RLParams, state=None):
    return turn_rewards(episodes, p.reward, state or RewardState(p))


# --------------------------------------------------------------------------- simple components
def test_default_reward_is_the_environment_reward_exactly():
    eps = [ep([0.0, 0.3, 1.0], won=True), ep([0.0] * 10, invalid=[True] * 10, parsed=[False] * 10)]
    got, means = rewards(eps, RLParams())
    assert got == [[0.0, 0.3, 1.0], [0.0] * 10]
    assert means == {"outcome": pytest.approx(1.3 / 2), "shaped_return": pytest.approx(1.3 / 2)}


def test_format_invalid_and_truncation_penalties_land_on_their_turns():
    e = ep([0.0, 0.0, 0.0], max_turns=3, invalid=[False, True, False], parsed=[False, True, True])
    got, means = rewards([e], params(bound=10, format=0.2, invalid=0.1, truncation=0.5))
    assert got == [[pytest.approx(-0.2), pytest.approx(-0.1), pytest.approx(-0.5)]]
    assert means["format"] == pytest.approx(-0.2) and means["truncation"] == pytest.approx(-0.5)
    won = ep([0.0, 1.0], won=True, max_turns=2)  # a win on the last allowed turn is no truncation
    assert rewards([won], params(truncation=0.5))[0] == [[0.0, 1.0]]
    # the trainer's entry point gives the same
    assert shaped_turn_rewards([e], params(bound=10, format=0.2, invalid=0.1, truncation=0.5)) == got


def test_failure_lands_on_the_turn_the_task_ended_lost_and_only_for_its_families():
    hole = ep([0.0, 0.0], max_turns=10)  # ended by the task on turn 2 (a hole): no win, turns left
    wandering = ep([0.0] * 3, max_turns=3)  # ran out of turns: no failure (truncation's case)
    won = ep([0.0, 1.0], won=True, max_turns=10)
    got, means = rewards([hole, wandering, won], params(bound=10, failure=0.5))
    assert got == [[0.0, -0.5], [0.0, 0.0, 0.0], [0.0, 1.0]]
    assert means["failure"] == pytest.approx(-0.5 / 3)
    # a lost group no longer scores alike: the hole is below the walk that ran out of time
    assert sum(got[0]) < sum(got[1]) < sum(got[2])
    words = ep([0.0, 0.0], max_turns=10)
    words.family = "python-tool"  # a wrong answer: penalised only where its family is named
    only_lakes = params(bound=10, failure={"weight": 0.5, "families": ["gym-toytext"]})
    assert rewards([hole, words], only_lakes)[0] == [[0.0, -0.5], [0.0, 0.0]]
    assert rewards([words], params(bound=10, failure=0.5))[0] == [[0.0, -0.5]]
    # bounded like every shaping component
    assert rewards([hole], params(bound=0.2, failure=1.0))[0] == [[0.0, pytest.approx(-0.2)]]


def test_failure_families_are_checked_against_the_catalog():
    with pytest.raises(ValueError, match="unknown families \\['lake'\\]"):
        params(failure={"weight": 0.5, "families": ["lake"]})


def test_overlong_penalty_at_the_boundaries():
    # budget 16, buffer 4: free up to 12 tokens, then linear to -1 at 16, -1 beyond
    assert [overlong(n, 16, 4) for n in (0, 12, 13, 14, 16, 17, 100)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    e = ep([0.0] * 3, n_tokens=[12, 14, 16])  # gym-toytext's own budget: 16
    assert rewards([e], params(bound=10, length={"weight": 1.0, "buffer": 4}))[0] == [[0.0, -0.5, -1.0]]
    p = RLParams(max_reply_tokens=14, reward={"bound": 10, "length": {"weight": 1.0, "buffer": 4}})
    assert rewards([e], p)[0] == [[-0.5, -1.0, -1.0]]  # the stage's budget wins over the family's


# --------------------------------------------------------------------------- potential shaping
def test_potential_shaping_telescopes_to_the_end_potentials():
    gamma, scale = 0.9, 10.0
    e = ep([0.0] * 4, to_go=[5, 4, 6, 3], end=2)
    p = RLParams(gamma=gamma, reward={"potential": {"weight": 1.0, "scale": scale}})
    f = potential(e, Context(p.reward, RewardState(p)), p.reward.potential)
    phi = [-5 / scale, -4 / scale, -6 / scale, -3 / scale, -2 / scale]
    assert f == pytest.approx([gamma * phi[k + 1] - phi[k] for k in range(4)])
    assert sum(gamma ** k * v for k, v in enumerate(f)) == pytest.approx(gamma ** 4 * phi[4] - phi[0])
    # a won episode ends at Phi = 0; an unreachable state counts `unreachable` steps
    won = ep([0.0, 1.0], won=True, to_go=[2, 1], end=0)
    assert potential(won, Context(p.reward, RewardState(p)), p.reward.potential) == pytest.approx(
        [gamma * -0.1 + 0.2, 0.1])
    # a game the task ended lost (a hole, a wrong answer) ends at Phi = 0 too: a terminal state
    hole = ep([0.0], to_go=[3], end=ENDED)
    assert potential(hole, Context(p.reward, RewardState(p)), p.reward.potential) == pytest.approx([0.3])
    # a state the expert cannot win from while the game goes on counts `unreachable` (50) steps
    stuck = ep([0.0], max_turns=1, to_go=[3], end=UNREACHABLE)
    assert potential(stuck, Context(p.reward, RewardState(p)), p.reward.potential) == pytest.approx([-0.9 * 5 + 0.3])
    with pytest.raises(ValueError, match="potentials=True"):
        rewards([ep([0.0])], p)


def test_potential_shaping_pays_every_ended_episode_the_same_whatever_its_path():
    # policy invariance (Ng et al. 1999): from one start, a win, a loss the task ended after a detour,
    # and a loss straight away earn the same discounted shaping, -Phi(s_0); only the outcome differs.
    # Waiting out the turn limit far from the goal pays less (its last state's Phi counts).
    gamma, scale = 0.9, 10.0
    p = RLParams(gamma=gamma, reward={"potential": {"weight": 1.0, "scale": scale}})
    ctx = Context(p.reward, RewardState(p))
    won = ep([0.0, 0.0, 1.0], won=True, to_go=[3, 2, 1], end=0)
    detour = ep([0.0] * 4, max_turns=10, to_go=[3, 4, UNREACHABLE, 5], end=ENDED)
    hole = ep([0.0], max_turns=10, to_go=[3], end=ENDED)
    waited = ep([0.0] * 3, max_turns=3, to_go=[3, 4, 5], end=6)
    def paid(e):
        return sum(gamma ** k * v for k, v in enumerate(potential(e, ctx, p.reward.potential)))
    assert paid(won) == pytest.approx(0.3) and paid(detour) == pytest.approx(0.3) and paid(hole) == pytest.approx(0.3)
    assert paid(waited) == pytest.approx(gamma ** 3 * -0.6 + 0.3)


def test_a_looping_policy_cannot_out_earn_a_solving_one_under_the_bound():
    # the looper circles two states 3 and 4 steps from the goal for 40 turns: with gamma < 1 every
    # cycle pays (1 - gamma)(3 + 4) / scale, so unbounded shaping would beat solving the task
    loop = ep([0.0] * 40, max_turns=40, to_go=[3, 4] * 20, end=3)
    solve = ep([0.0, 0.0, 1.0], won=True, to_go=[3, 2, 1], end=0)
    unbounded = rewards([loop, solve], RLParams(reward={"bound": 100, "potential": {"weight": 1.0, "scale": 1.0}}))[0]
    assert sum(unbounded[0]) > sum(unbounded[1])
    got, _ = rewards([loop, solve], RLParams(reward={"potential": {"weight": 1.0, "scale": 1.0}}))
    assert sum(got[0]) == pytest.approx(0.5) and sum(got[1]) == pytest.approx(1.5)  # shaping capped at bound 0.5
    # every non-outcome value is clipped to [-1, 1] before the weight; the bound scales the episode
    assert max(abs(v) for v in got[0]) <= 1.0
    scaled = rewards([loop], RLParams(reward={"bound": 100, "potential": {"weight": 1.0, "scale": 1.0}}))[0][0]
    assert max(scaled) == 1.0  # 4 -> 3 pays 0.95 * -3 + 4 = 1.15, clipped


# --------------------------------------------------------------------------- adaptive
def test_adaptive_weight_follows_each_task_types_success():
    ema = SuccessEMA(decay=0.5)
    ema.update([ep(won=True, task_type="a"), ep(won=True, task_type="a"), ep(won=False, task_type="b")])
    assert ema.success == {"a": 0.5, "b": 0.0}
    ema.update([ep(won=True, task_type="a"), ep(won=False, task_type="b")])
    assert ema.success == {"a": 0.75, "b": 0.0}
    p = RLParams(gamma=1.0, reward={"adaptive": {"weight": 1.0, "decay": 0.5}, "potential": {"scale": 10.0}})
    state = RewardState(p)
    state.success.load_state_dict(ema.state_dict())
    a = ep([0.0], to_go=[3], end=2, task_type="a")
    b = ep([0.0], to_go=[3], end=2, task_type="b")
    got, _ = rewards([a, b], p, state)  # potential 0.1 each, scaled by 1 - success of the type
    assert got == [[pytest.approx(0.1 * 0.25)], [pytest.approx(0.1)]]
    assert needs_potentials(p.reward) and not needs_potentials(RLParams().reward)
    row = observe_iteration(state, [ep([1.0], won=True, to_go=[1], end=0, task_type="b")], p.reward)
    assert state.success.success["b"] == 0.5 and set(row) == {"shaped_return", "reward/outcome", "reward/adaptive"}


# --------------------------------------------------------------------------- process reward
def _pair_group(group: int, good: str, bad: str) -> list[Episode]:
    """A won episode (steps `good`) and a lost one (steps `bad`), same start."""
    return [ep([0.0, 1.0], won=True, group=group, action=[good, good]),
            ep([0.0, 0.0], won=False, group=group, action=[bad, bad])]


def test_the_process_model_learns_to_rank_a_won_trajectory_above_a_lost_one():
    p = RLParams(reward={"bound": 10, "process": {"weight": 1.0, "features": 256, "epochs": 30, "lr": 0.1}})
    state = RewardState(p, seed=0)
    fresh = state.process.step_rewards(_pair_group(9, "go east", "go west")[0])
    assert fresh == [0.0, 0.0]  # zero-initialised: no opinion before any data
    info = state.update([e for g in range(4) for e in _pair_group(g, "go east", "go west")])
    assert info["process_pairs"] == 4 and info["process_loss"] < 0.69  # below log 2: it separates the pairs
    won, lost = _pair_group(9, "go east", "go west")
    r_won, r_lost = state.process.step_rewards(won), state.process.step_rewards(lost)
    assert sum(r_won) > sum(r_lost) and all(-1 <= v <= 1 for v in r_won + r_lost)
    got, means = rewards([won, lost], p, state)
    assert got[0] == pytest.approx([r_won[0], 1.0 + r_won[1]]) and means["process"] == pytest.approx(
        (sum(r_won) + sum(r_lost)) / 2)
    # deterministic, and checkpointable: a restored model scores the same
    again = RewardState(p, seed=0)
    again.update([e for g in range(4) for e in _pair_group(g, "go east", "go west")])
    assert again.process.step_rewards(won) == r_won
    restored = RewardState(p, seed=0)
    restored.load_state_dict(state.state_dict())
    assert restored.process.step_rewards(lost) == r_lost
    # groups without both a win and a loss carry no preference
    assert ProcessModel(p.reward.process).update([ep(won=True), ep(won=True)]) == {"process_loss": 0.0,
                                                                                    "process_pairs": 0}


# --------------------------------------------------------------------------- judge
def test_the_judge_scores_in_unit_range_caches_and_measures_agreement():
    texts = ["Goal: reach the goal", "Observation 1: obs 0", "Action 1: a", "Did the agent achieve the goal? "
             "Answer yes or no.", " yes", " no"]
    tiny = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=300, max_context=256)
    judge = Judge(build_scratch_policy(tiny, texts, AgentFormat(), seed=0), "Did the agent achieve the goal? "
                  "Answer yes or no.")
    p = RLParams(reward={"judge": {"weight": 1.0, "model": "unused"}})
    state = RewardState(p, judge=judge)
    e1, e2 = ep([0.0, 0.0]), ep([0.0, 0.0], action=["b", "b"])
    got, _ = rewards([e1, e2, e1], p, state)
    s = judge.score(e1)
    assert 0.0 <= s <= 1.0 and got[0] == [0.0, pytest.approx(s)]
    assert judge.forward_passes == 2  # e1 twice (and once more above) costs one pass: cached by its text
    assert agreement([0.9, 0.2, 0.6, 0.4], [True, False, False, False]) == {
        "accuracy": 0.75, "correlation": pytest.approx(0.375 / (0.2675 * 0.75) ** 0.5), "n": 4}  # by hand
    with pytest.raises(ValueError, match="reward.judge.weight > 0 needs reward.judge.model"):
        RLParams(reward={"judge": {"weight": 1.0}})


# --------------------------------------------------------------------------- expert distances
def _expert_path_distances(env: Env) -> list[int | None]:
    env.reset()
    out = [env.expert_distance()]
    while (a := env.expert_action()) is not None:
        env.step(a)
        out.append(env.expert_distance())
    return out


def test_frozenlake_distance_is_the_bfs_distance_and_the_generic_replay_agrees(lake_pool):
    tasks, tasks_dir = lake_pool
    for task in tasks[:3]:
        env = make(task, tasks_dir)
        env.reset()
        rng = random.Random(0)
        for _ in range(8):  # a random walk: every state visited has the model's BFS distance
            d = env.expert_distance()
            bfs = env.model.dist[env.s]
            if env.done and not env.won and not env.truncated:
                assert d is None  # a hole
                break
            assert d == bfs and Env.expert_distance(env) == d  # the generic replay measures the same
            env.step(rng.choice(env.model.admissible))
        dists = _expert_path_distances(make(task, tasks_dir))
        assert dists == list(range(task.expert_steps, -1, -1))


def test_python_tool_and_generic_distances_decrease_by_one_along_the_experts_path():
    assert _expert_path_distances(make(COUNTDOWN)) == [2, 1, 0]
    env = make(COUNTDOWN)
    env.reset()
    env.step("answer[1 + 2]")  # a wrong answer ends the task: the expert cannot win any more
    assert env.expert_distance() is None
    [soko] = generate("sokoban", 1, seed=0, level="easy")  # no override: the generic replay
    dists = _expert_path_distances(make(soko))
    assert dists == list(range(len(dists) - 1, -1, -1)) and dists[0] == soko.expert_steps


@pytest.mark.slow
def test_textworld_cooking_distance_decreases_by_one_along_the_experts_path(tmp_path):
    [task] = generate("textworld", 1, seed=1, level="easy", out_dir=tmp_path, game="cooking")
    env = make(task, tmp_path, max_turns=50)
    dists = _expert_path_distances(env)
    env.close()
    assert dists == list(range(len(dists) - 1, -1, -1)) and len(dists) > 3


def test_the_rollout_measures_distances_only_when_asked(lake_pool):
    tasks, tasks_dir = lake_pool
    eps = run_episodes(RandomAgent(seed=1), tasks[:3], tasks_dir, max_turns=6, group_size=2, potentials=True)
    ended = 0
    for e in eps:
        env = make(next(t for t in tasks if t.task_id == e.task_id), tasks_dir)
        env.reset()
        for turn in e.turns:
            assert turn.to_go == env.model.dist[env.s] and turn.parsed
            env.step(turn.action)
        assert e.end_to_go == (0 if e.won else ENDED if env.done else env.expert_distance()
                               if env.expert_distance() is not None else UNREACHABLE)
        ended += e.end_to_go == ENDED
    assert ended  # some random walks ended in a hole: terminal, Phi 0
    plain = run_episodes(RandomAgent(seed=1), tasks[:1], tasks_dir, max_turns=6)
    assert all(t.to_go is None for t in plain[0].turns) and plain[0].end_to_go is None
    # a tool family's reply that is no tool call does not parse (the random agent says nothing)
    [tool] = run_episodes(RandomAgent(seed=1), [COUNTDOWN], None, max_turns=2)
    assert [t.parsed for t in tool.turns] == [False, False]


# --------------------------------------------------------------------------- params
def test_a_stage_overrides_reward_components_one_by_one():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"]["defaults"]["reward"]["invalid"] = {"weight": 0.2}
    raw["rl"]["defaults"]["reward"]["potential"] = {"weight": 0.0, "scale": 5.0, "unreachable": 50}
    raw["rl"]["stages"] = {"main": {"init": "sft", "reward": {"potential": {"weight": 0.5}}}}
    p = Params.model_validate(raw).rl.stage("main")
    assert p.reward.potential.weight == 0.5 and p.reward.potential.scale == 5.0  # the defaults' knobs stay
    assert p.reward.invalid.weight == 0.2 and p.reward.outcome.weight == 1.0  # so do the other components
    assert RLParams().reward == RewardParams() and RewardParams().outcome.weight == 1.0
    arms = load_params(ROOT / "params.yaml")
    assert arms.ablation_stages("gigpo_dapo")[0].reward.truncation.weight == 0.1
    assert arms.ablation_stages("grpo")[0].reward.truncation.weight == 0.0


def test_bad_reward_settings_are_refused_naming_the_field(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["rl"]["stages"] = {"main": {"init": "sft", "reward": {"potential": {"weight": -1}}}}
    with pytest.raises(ValueError, match=r"stages\.main\.reward\.potential\.weight = -1"):
        Params.model_validate(raw)
    raw["rl"]["stages"] = {"main": {"init": "sft"}}
    raw["rl"]["defaults"]["reward"]["length"]["bufer"] = 3
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match=r"rl\.defaults\.reward\.length\.bufer: unknown key"):
        load_params(path)
    with pytest.raises(ValueError, match="base"):
        RLParams(reward={"adaptive": {"base": "outcome"}})


def test_invalid_penalty_keys_are_gone():
    with pytest.raises(ValueError, match="invalid_penalty"):
        RLParams(invalid_penalty=-0.1)


# --------------------------------------------------------------------------- in the trainer
class Killed(Exception):
    pass


def test_the_trainer_logs_components_and_resumes_its_reward_state(lake_pool, tmp_path, monkeypatch):
    # potential, adaptive and process rewards on: per-iteration metrics name them, and a run killed
    # after iteration 1 resumes (adaptive success and process model from the checkpoint) to the same curve
    tasks, tasks_dir = lake_pool
    texts = task_texts(tasks, tasks_dir)
    tiny = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400,
                       max_context=1024)
    p = RLParams(iterations=2, tasks_per_iter=2, group_size=3, max_turns=4, lr=5e-3, minibatch_size=6,
                 reward={"potential": {"weight": 0.5}, "adaptive": {"weight": 0.5}, "process": {"weight": 0.2}})

    def run(log=None, ckpt=None):
        pol = build_scratch_policy(tiny, texts, AgentFormat(), seed=0)
        return trainer.train_rl(pol, None, tasks, tasks_dir, p, seed=3, log=log, ckpt_dir=ckpt, ckpt_key="k")

    straight = run()
    row = straight[0]
    assert {"reward/outcome", "reward/potential", "reward/adaptive", "reward/process", "shaped_return",
            "success", "process_pairs"} <= set(row)
    assert row["reward/outcome"] == pytest.approx(row["reward_mean"])  # outcome weight 1: the raw reward
    assert abs(row["shaped_return"] - row["reward/outcome"]) <= 0.5 + 1e-9  # shaping within the bound

    def kill_at_2(row, step):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        run(log=kill_at_2, ckpt=tmp_path / "ckpt")
    loaded = []
    real_load = RewardState.load_state_dict
    monkeypatch.setattr(RewardState, "load_state_dict", lambda self, st: (loaded.append(st), real_load(self, st)))
    assert run(ckpt=tmp_path / "ckpt") == straight
    # the reward state of iteration 1 came back: every task type's success, the process model's weights
    [st] = loaded
    assert set(st["success"]["success"]) == {t.task_type for t in tasks} and "linear" in st["process"]
