"""Roll out episodes in lockstep: every active environment advances one turn per batched agent call.

With `group_size=G` each task is played G times from the same initial state (the group that
GRPO-style advantages compare). Episodes are played in chunks of the agent's `batch_size` (one KV
cache per chunk); the order of the returned episodes is the order of `tasks`, G per task.

Inside an enabled `fanout.session` a chunk's environments live in Ray actors that step them in
parallel (`fanout.RemoteEnvs`); otherwise in this process. The agent and the episodes are the same.
"""

from __future__ import annotations

import random
from pathlib import Path

from tqdm import tqdm

from agentkiln import fanout
from agentkiln.envs import Env, Observation, StepResult, TaskSpec, make
from agentkiln.envs.base import tool_call
from agentkiln.policy.allocator import release_free_memory
from agentkiln.policy.prompt import parse_reply
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.potentials import measure as measure_distances


def run_episodes(agent, tasks: list[TaskSpec], tasks_dir: str | Path, max_turns: int | None, group_size: int = 1,
                 progress: str | None = None, potentials: bool = False, guided: int = 0, seed: int = 0
                 ) -> list[Episode]:
    """G episodes per task, in the order of `tasks`. `potentials`: also measure the expert's distance
    to a win at every state (`Turn.to_go`, `Episode.end_to_go`: rollout.potentials), for shaping.
    `guided`: the last that many episodes of every group are guided (rollout guidance): the policy
    plays them up to a turn drawn uniformly below the expert's distance from the start (seeded by
    `seed`, the task and the episode's place in its group), and the expert plays on from there."""
    episodes = [Episode(task.task_id, task.family, g, task.task_type) for g, task in enumerate(tasks)
                for _ in range(group_size)]
    specs = [task for task in tasks for _ in range(group_size)]
    members = [j for _ in tasks for j in range(group_size)]
    chunk = getattr(agent, "batch_size", None) or len(episodes) or 1
    with tqdm(total=len(episodes), desc=progress, unit="episode", leave=False, disable=True if progress is None else None) as bar:
        for lo in range(0, len(episodes), chunk):
            sl = slice(lo, lo + chunk)
            guide = [random.Random(f"{seed}:{specs[i].task_id}:{members[i]}") if members[i] >= group_size - guided
                     else None for i in range(len(episodes))[sl]]
            _play(agent, episodes[sl], specs[sl], tasks_dir, max_turns, bar, guide)
            release_free_memory()  # the chunk's KV cache, freed, leaves the process (policy/allocator.py)
    if potentials:
        measure_distances(episodes, specs, tasks_dir)
    return episodes


class LocalEnvs:
    """The environments of one chunk in this process (the interface of `fanout.RemoteEnvs`): `views`
    (what the agent is given), `first` (each one's first observation, goal and turn limit), `step`, `close`."""

    def __init__(self, tasks: list[TaskSpec], tasks_dir, max_turns: int | None):
        self.views: list[Env] = []
        self.first: list[tuple[Observation, str, int]] = []
        for task in tasks:
            env = make(task, tasks_dir, max_turns=max_turns)
            obs = env.reset()
            self.views.append(env)
            self.first.append((obs, env.goal, env.max_turns))
        self.open = set(range(len(tasks)))

    def step(self, actions: dict[int, str], close: list[int]) -> dict[int, StepResult]:
        out = {}
        for i, action in actions.items():
            out[i] = res = self.views[i].step(action)
            if res.done:
                self._close(i)
        for i in close:
            self._close(i)
        return out

    def _close(self, i: int) -> None:
        self.open.discard(i)
        self.views[i].close()

    def close(self) -> None:
        for i in list(self.open):
            self._close(i)


def _play(agent, episodes: list[Episode], tasks: list[TaskSpec], tasks_dir, max_turns: int | None, bar,
          guide: list[random.Random | None]) -> None:
    envs = (fanout.RemoteEnvs if fanout.active() else LocalEnvs)(tasks, tasks_dir, max_turns)
    try:
        for ep, rng, env in zip(episodes, guide, envs.views):
            if rng is not None:  # a turn the policy reaches while the expert could still win
                ep.guide_at = rng.randrange(max(1, env.expert_distance() or 1))
        _lockstep(agent, episodes, envs, bar)
    finally:
        envs.close()


def parsed(action: str, env) -> bool:
    """Whether a reply's action has the form of one (the `format` reward): a tool family's must be one
    of its tool calls `name[argument]`; any other family's must be non-empty (its environment judges
    whether it is admissible)."""
    if env.free_form:
        return tool_call(action, tuple(name for name, _, _ in env.tools)) is not None
    return bool(action.strip())


def _lockstep(agent, episodes: list[Episode], envs, bar) -> None:
    for ep, (obs, goal, max_turns) in zip(episodes, envs.first):
        ep.goal, ep.max_turns = goal, max_turns
        ep.turns.append(Turn(obs.text, obs.admissible, obs.anchor))
    if hasattr(agent, "begin"):
        agent.begin(episodes)
    active = list(range(len(episodes)))
    while active:
        replies = agent.act([episodes[i] for i in active], [envs.views[i] for i in active])
        actions, cut = {}, []
        for i, reply in zip(active, replies):
            ep, turn = episodes[i], episodes[i].turns[-1]
            if reply is None:  # the latest observation no longer fits the context window
                ep.turns.pop()
                ep.cut = True
                cut.append(i)
            else:
                turn.reply, turn.action = reply, parse_reply(reply)
                turn.parsed = parsed(turn.action, envs.views[i])
                actions[i] = turn.action
        results = envs.step(actions, cut)  # every environment of the turn at once (in parallel on Ray)
        still = []
        for i in active:
            ep = episodes[i]
            if i in results:
                res, turn = results[i], ep.turns[-1]
                turn.reward, turn.invalid = res.reward, bool(res.info["invalid"])
                turn.tool_error = bool(res.info.get("tool_error", False))
                if not res.done:
                    obs = res.observation
                    ep.turns.append(Turn(obs.text, obs.admissible, obs.anchor))
                    still.append(i)
                    continue
                ep.won = bool(res.info["won"])
            bar.update(1)
        active = still
