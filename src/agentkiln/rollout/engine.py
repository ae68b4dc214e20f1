"""Roll out episodes in lockstep: every active environment advances one turn per batched agent call.

With `group_size=G` each task is played G times from the same initial state (the group that
GRPO-style advantages compare). Episodes are played in chunks of the agent's `batch_size` (one KV
cache per chunk); the order of the returned episodes is the order of `tasks`, G per task.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from agentkiln.envs import TaskSpec, make
from agentkiln.policy.prompt import parse_reply
from agentkiln.rollout.episode import Episode, Turn


def run_episodes(agent, tasks: list[TaskSpec], tasks_dir: str | Path, max_turns: int | None, group_size: int = 1,
                 progress: str | None = None) -> list[Episode]:
    episodes = [Episode(task.task_id, task.family, g, task.task_type) for g, task in enumerate(tasks)
                for _ in range(group_size)]
    specs = [task for task in tasks for _ in range(group_size)]
    chunk = getattr(agent, "batch_size", None) or len(episodes) or 1
    with tqdm(total=len(episodes), desc=progress, unit="episode", leave=False, disable=True if progress is None else None) as bar:
        for lo in range(0, len(episodes), chunk):
            _play(agent, episodes[lo : lo + chunk], specs[lo : lo + chunk], tasks_dir, max_turns, bar)
    return episodes


def _play(agent, episodes: list[Episode], tasks: list[TaskSpec], tasks_dir, max_turns: int | None, bar) -> None:
    envs = []
    for ep, task in zip(episodes, tasks):
        env = make(task, tasks_dir, max_turns=max_turns)
        obs = env.reset()
        ep.goal, ep.max_turns = env.goal, env.max_turns
        ep.turns.append(Turn(obs.text, obs.admissible, obs.anchor))
        envs.append(env)
    if hasattr(agent, "begin"):
        agent.begin(episodes)
    active = list(range(len(episodes)))
    while active:
        replies = agent.act([episodes[i] for i in active], [envs[i] for i in active])
        still = []
        for i, reply in zip(active, replies):
            ep, env, turn = episodes[i], envs[i], episodes[i].turns[-1]
            if reply is None:  # the latest observation no longer fits the context window
                ep.turns.pop()
                ep.cut = True
            else:
                turn.reply, turn.action = reply, parse_reply(reply)
                res = env.step(turn.action)
                turn.reward, turn.invalid = res.reward, bool(res.info["invalid"])
                turn.tool_error = bool(res.info.get("tool_error", False))
                if not res.done:
                    obs = res.observation
                    ep.turns.append(Turn(obs.text, obs.admissible, obs.anchor))
                    still.append(i)
                    continue
                ep.won = bool(res.info["won"])
            env.close()
            bar.update(1)
        active = still
