"""Roll out episodes in lockstep: all environments advance one turn per batched policy call.

With `group_size=G`, each task is played G times from the same initial state (the group that
GRPO-style advantages compare). Every turn keeps the exact prompt and generated token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from agentkiln.envs import TaskSpec, make
from agentkiln.rollout.agents import AgentState
from agentkiln.rollout.constrained import Generation


@dataclass
class Turn:
    state: AgentState  # what the agent saw (text), for distillation into other tokenizers
    gen: Generation  # prompt ids, generated ids, allowed sets, behaviour log-probs, action
    anchor: str
    reward: float
    invalid: bool


@dataclass
class Episode:
    task_id: str
    family: str
    group: int  # index of the task in the batch: episodes of one group share an initial state
    task_type: str = ""
    max_turns: int = 0  # the environment's turn limit for this episode
    turns: list[Turn] = field(default_factory=list)
    won: bool = False

    @property
    def truncated(self) -> bool:
        """Ran out of turns without winning (a loss on the very last turn counts as truncated too)."""
        return not self.won and len(self.turns) >= self.max_turns

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def n_invalid(self) -> int:
        return sum(t.invalid for t in self.turns)


def run_episodes(
    agent,
    tasks: list[TaskSpec],
    tasks_dir: str | Path,
    max_turns: int | None,
    group_size: int = 1,
    progress: str | None = None,
) -> list[Episode]:
    episodes, envs, states = [], [], []
    for g, task in enumerate(tasks):
        for _ in range(group_size):
            env = make(task, tasks_dir, max_turns=max_turns)
            obs = env.reset()
            envs.append(env)
            episodes.append(Episode(task_id=task.task_id, family=task.family, group=g, task_type=task.task_type,
                                    max_turns=env.max_turns))
            states.append((AgentState(env.goal, [], obs.text, obs.admissible or []), obs.anchor))
    active = list(range(len(envs)))
    bar = tqdm(total=max(e.max_turns for e in envs), desc=progress, leave=False, disable=progress is None)
    while active:
        if getattr(agent, "needs_env", False):  # the oracle reads the environment, not the text
            gens = agent.act([states[i][0] for i in active], [envs[i] for i in active])
        else:
            gens = agent.act([states[i][0] for i in active])
        still = []
        for i, gen in zip(active, gens):
            state, anchor = states[i]
            res = envs[i].step(gen.action)
            episodes[i].turns.append(Turn(state=state, gen=gen, anchor=anchor, reward=res.reward, invalid=res.info["invalid"]))
            if res.done:
                episodes[i].won = bool(res.info["won"])
                envs[i].close()
                continue
            obs = res.observation
            past = state.past_actions + [gen.action]
            states[i] = (AgentState(state.goal, past, obs.text, obs.admissible or []), obs.anchor)
            still.append(i)
        active = still
        bar.update(1)
    bar.close()
    return episodes
