"""Extra SFT episodes beside a task's clean expert walkthrough: recovery and alternative paths.

- `recovery`: the expert plays up to a seeded random step, then k wrong or random actions are taken
  (k seeded in `mistakes`), then the expert plays on from the state they led to (`expert_action()`
  works from any state) until it wins. Each mistake row is flagged (`mistake`): SFT keeps it as
  context and puts no loss on it (STeP's partial masking), so the model learns what to do *after* a
  mistake, never the mistake. A mistake is, where the family lists admissible actions, one of them
  that is not the expert's (FrozenLake / Taxi: nor another shortest-path action, see `optimal`); for
  free-form tool families, a plausible wrong call: the right tool with one number of its argument
  changed, an unknown tool, or the call without its brackets (garbage the environment rejects). An
  episode whose mistakes end it (a hole, a wrong answer, a wrong purchase, a ruined meal) or that the
  expert then cannot win within the turn limit is dropped: the task itself stays admitted.
- `alternative`: another optimal walkthrough, where a family has several (`OPTIMAL`): at every step
  a seeded choice among the actions on a shortest path to success; kept only if it differs from the
  clean walkthrough and from the earlier alternatives.

Families without alternatives: TextWorld (its walkthrough is the single plan TextWorld compiles with
the game; reorderings of independent steps are not known to it), Sokoban (the A* oracle returns one
move-optimal plan; enumerating the others would be a second search per state), shop (one query finds
the target, options are clicked in the goal's order) and the tool families sql, python-tool and
search-qa (one reference query / expression / hop order). For them `alternatives` is simply empty.

Every draw comes from `random.Random` seeded by a string of the task's seed, the variant and the
episode's index (string seeds hash with sha512, never with Python's per-process hash seed): the same
task gives the same episodes, byte for byte, in any worker.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from agentkiln.envs import Env, TaskSpec, make
from agentkiln.envs.base import tool_call
from agentkiln.envs.toytext import UNREACHABLE

WRONG_TOOLS = ("run", "calculate", "lookup", "query", "search", "python", "sql", "answer")


@dataclass(frozen=True)
class Extras:
    """What synthesis adds beside each clean walkthrough (params: synthesize.recovery)."""

    episodes_per_task: int = 0  # recovery episodes attempted per task
    mistakes: tuple[int, int] = (1, 2)  # k, drawn uniformly in [lo, hi]
    alternatives: int = 0  # alternative optimal walkthroughs attempted per task


def row(env: Env, obs, action: str, res, mistake: bool) -> dict:
    """One step row of the expert trajectory table (the columns play_expert writes, plus the flag)."""
    return {"goal": env.goal, "observation": obs.text, "action": action, "admissible": json.dumps(obs.admissible),
            "reward": float(res.reward), "done": res.done, "mistake": mistake}


# --------------------------------------------------------------------------- alternatives
def _toytext_optimal(env) -> list[str]:
    """FrozenLake / Taxi: every action on a shortest path to success from the current state."""
    m, s = env.model, env.s
    out = []
    for a in m.admissible:
        ns, r, term = m.next[s][m.actions.index(a)]
        if (term and r > 0) or (not term and m.dist[s] < UNREACHABLE and m.dist[ns] == m.dist[s] - 1):
            out.append(a)
    return out


# family -> the optimal actions from an environment's current state (families with several optimal paths)
OPTIMAL = {"gym-toytext": _toytext_optimal}


def optimal(env: Env) -> list[str] | None:
    """The actions on some shortest path from here, or None where the family cannot tell."""
    fn = OPTIMAL.get(env.family)
    return fn(env) if fn else None


# --------------------------------------------------------------------------- mistakes
def _change_a_number(arg: str, rng: random.Random) -> str | None:
    nums = list(re.finditer(r"\d+", arg))
    if not nums:
        return None
    m = rng.choice(nums)
    n, delta = int(m.group()), rng.choice((-3, -2, -1, 1, 2, 3))
    return arg[: m.start()] + str(n + delta if n + delta >= 0 else n - delta) + arg[m.end():]


def free_form_mistake(env: Env, expert: str, rng: random.Random) -> str:
    """A plausible wrong tool call, or garbage the environment rejects (never a final answer: that
    would end the episode)."""
    names = tuple(name for name, _, _ in env.tools)
    call = tool_call(expert, names) if names else None
    tool, arg = call if call else ("", expert)
    options = [f"{tool} {arg}" if call else "answer",  # brackets forgotten
               f"{rng.choice([t for t in WRONG_TOOLS if t not in names])}[{arg}]"]  # a tool the family lacks
    if call and tool != "answer" and (wrong := _change_a_number(arg, rng)) is not None:
        options.append(f"{tool}[{wrong}]")  # the right tool, a wrong argument
    return rng.choice([o for o in options if o != expert] or ["?"])


def mistake_action(env: Env, obs, expert: str, rng: random.Random) -> str | None:
    """A wrong action from the current state; None when every admissible action is optimal."""
    if obs.admissible is None:
        return free_form_mistake(env, expert, rng)
    good = set(optimal(env) or ()) | {expert}
    wrong = [a for a in obs.admissible if a not in good]
    return rng.choice(wrong) if wrong else None


# --------------------------------------------------------------------------- episodes
def turn_limit(task: TaskSpec, max_steps: int) -> int:
    """The extra episodes keep the task's own turn limit too: an episode the agent could never play
    to its end is no demonstration."""
    own = task.difficulty.get("max_turns")
    return min(max_steps, own) if isinstance(own, int) and own > 0 else max_steps


def recovery_episode(task: TaskSpec, tasks_dir, max_steps: int, n_clean: int, k_range: tuple[int, int],
                     rng: random.Random) -> list[dict] | None:
    """Expert steps, then k mistakes at a seeded step, then the expert from there: rows, or None
    (dropped: the mistakes ended the episode, or the expert could not win after them)."""
    k = rng.randint(*k_range)
    at = rng.randrange(n_clean)  # the first mistake replaces the expert's step `at`
    env = make(task, tasks_dir, max_turns=turn_limit(task, max_steps))
    try:
        obs, rows, made = env.reset(), [], 0
        while made < k:
            expert = env.expert_action()
            if expert is None:
                return None
            wrong = mistake_action(env, obs, expert, rng) if len(rows) >= at else None
            if wrong is None and made:
                break  # no wrong action here (a room with one exit): fewer mistakes
            # before `at`, or where nothing is wrong yet, the expert steps (the mistakes start later)
            action = expert if wrong is None else wrong
            res = env.step(action)
            rows.append(row(env, obs, action, res, mistake=wrong is not None))
            made += wrong is not None
            obs = res.observation
            if res.done:
                return None  # the mistakes ended it (or none could be placed): nothing left to recover
        while (action := env.expert_action()) is not None:
            res = env.step(action)
            rows.append(row(env, obs, action, res, mistake=False))
            obs = res.observation
            if res.done:
                break
        return rows if env.won else None
    finally:
        env.close()


def alternative_episode(task: TaskSpec, tasks_dir, max_steps: int, rng: random.Random) -> list[dict] | None:
    """A walkthrough along seeded choices among the optimal actions; None where the family has none."""
    env = make(task, tasks_dir, max_turns=turn_limit(task, max_steps))
    try:
        obs, rows = env.reset(), []
        while not env.done:
            choices = optimal(env)
            if not choices:
                return None
            action = rng.choice(choices)
            res = env.step(action)
            rows.append(row(env, obs, action, res, mistake=False))
            obs = res.observation
        return rows if env.won else None
    finally:
        env.close()


def extra_episodes(task: TaskSpec, tasks_dir: str | Path | None, max_steps: int, clean: list[dict],
                   extras: Extras) -> tuple[list[dict], int]:
    """([{"variant", "index", "rows"}], episodes dropped) for one admitted task whose clean walkthrough
    is `clean`. Attempt j of a variant is seeded by (task seed, variant, j); `index` is j."""
    out, dropped = [], 0
    for j in range(extras.episodes_per_task):
        rows = recovery_episode(task, tasks_dir, max_steps, len(clean), extras.mistakes,
                                random.Random(f"recovery:{task.seed}:{j}"))
        if rows is None:
            dropped += 1
        else:
            out.append({"variant": "recovery", "index": j, "rows": rows})
    if extras.alternatives and task.family in OPTIMAL:
        seen = {tuple(r["action"] for r in clean)}
        for j in range(extras.alternatives):
            rows = alternative_episode(task, tasks_dir, max_steps, random.Random(f"alternative:{task.seed}:{j}"))
            path = tuple(r["action"] for r in rows or ())
            if rows is None or path in seen:  # the grid allows no other shortest path (or this draw found none)
                dropped += 1
                continue
            seen.add(path)
            out.append({"variant": "alternative", "index": j, "rows": rows})
    return out, dropped
