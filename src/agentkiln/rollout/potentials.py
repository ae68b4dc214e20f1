"""The expert's distance to a win at every state of played episodes (potential-based shaping's Phi).

After a chunk is played, each episode is replayed in a fresh environment of its task (environments
are deterministic from reset) and `Env.expert_distance()` is read before every turn and after the
last one: `Turn.to_go`, `Episode.end_to_go` (UNREACHABLE: the expert cannot win from there; ENDED:
the task ended the episode without a win, a terminal state, which shaping gives Phi = 0). A
distance is cached per (task, anchor), the end state's per (task, last anchor, last action): an
episode whose states are all known is not replayed, so a group's shared states cost nothing. States
the anchor does not tell apart share the first value measured (TextWorld's anchor leaves out whether
the cookbook was read): Phi stays a function of the anchored state, so shaping stays potential-based.
"""

from __future__ import annotations

from pathlib import Path

from agentkiln.envs import TaskSpec, make
from agentkiln.rollout.episode import Episode

UNREACHABLE = -1  # to_go of a state the expert cannot win from (a lost game still being played)
ENDED = -2  # end_to_go of an episode the task ended without a win (a hole, a wrong answer): terminal


def measure(episodes: list[Episode], tasks: list[TaskSpec], tasks_dir: str | Path | None,
            cache: dict | None = None) -> dict:
    """Fill `to_go` of every turn and `end_to_go` of every episode (tasks[i] is episodes[i]'s task);
    returns the cache (pass it again to reuse the distances)."""
    cache = {} if cache is None else cache
    for ep, task in zip(episodes, tasks):
        if not ep.turns:
            ep.end_to_go = None
            continue
        keys = [(task.task_id, t.anchor) for t in ep.turns]
        end_key = (task.task_id, ep.turns[-1].anchor, ep.turns[-1].action, "end")
        if ep.won:
            cache[end_key] = 0
        if any(k not in cache for k in keys) or end_key not in cache:
            _replay(ep, task, tasks_dir, keys, end_key, cache)
        for turn, key in zip(ep.turns, keys):
            turn.to_go = cache[key]
        ep.end_to_go = cache[end_key]
    return cache


def _replay(ep: Episode, task: TaskSpec, tasks_dir, keys: list, end_key: tuple, cache: dict) -> None:
    env = make(task, tasks_dir, max_turns=len(ep.turns) + 1)  # room for every turn: no truncation on the way
    try:
        env.reset()
        for turn, key in zip(ep.turns, keys):
            if key not in cache:
                cache[key] = _distance(env)
            env.step(turn.action)
        if end_key not in cache:
            cache[end_key] = _distance(env)
    finally:
        env.close()


def _distance(env) -> int:
    if env.done:  # the replica has room for every turn: only the task ends it
        return 0 if env.won else ENDED
    d = env.expert_distance()
    return UNREACHABLE if d is None else d
