"""Watch one episode in the terminal (`agentkiln play`): a policy plays a task greedily, exactly as
the evaluate stage plays it, then the episode is shown turn by turn."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

from agentkiln import paths
from agentkiln.config import ParamsError, load_params
from agentkiln.envs import FAMILIES
from agentkiln.panels import load_panel
from agentkiln.evaluate.sources import resolve_policy
from agentkiln.rollout.engine import run_episodes
from agentkiln.seeding import seed_everything
from agentkiln.evaluate.agents import greedy_agent
from agentkiln.synthesis import generate


class PlayError(ValueError):
    """A task or policy that cannot be played, with what to do instead."""


def play_episode(model: str, family: str = "sokoban", level: str = "easy", seed: int = 0, panel: str | None = None,
                 task_id: str | None = None, max_turns: int = 20, delay: float = 0.0,
                 out: Callable[[str], object] = print):
    """Play `model` on one task (generated from family/level/seed, or `task_id` of split `panel`)
    and print every turn via `out`; returns the Episode."""
    try:
        params = load_params()
    except ParamsError as e:
        raise PlayError(f"{e} (run from the project's root)") from None
    seed_everything(params.seed, params.torch_threads)
    with tempfile.TemporaryDirectory(prefix="agentkiln-play-") as tmp:
        if panel is not None:
            try:
                tasks = load_panel(paths.TASKS, panel)
            except (FileNotFoundError, ValueError) as e:
                raise PlayError(f"{e}; run `agentkiln stage synthesize` first") from None
            chosen = [t for t in tasks if task_id in (None, t.task_id)]
            if not chosen:
                raise PlayError(f"no task {task_id!r} in {paths.TASKS / panel} (e.g. {', '.join(t.task_id for t in tasks[:3])})")
            task, tasks_dir = chosen[0], paths.TASKS
        else:
            if family not in FAMILIES:
                raise PlayError(f"unknown family {family!r}; families: {', '.join(sorted(FAMILIES))}")
            if level not in ("easy", "medium", "hard"):
                raise PlayError(f"unknown level {level!r}; levels: easy, medium, hard")
            task, tasks_dir = generate(family, 1, seed=seed, level=level, out_dir=tmp)[0], tmp
        try:
            policy = resolve_policy(model, params)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise PlayError(str(e)) from None
        agent = greedy_agent(model if model in ("random", "oracle") else "policy", policy, params)
        episode = run_episodes(agent, [task], tasks_dir, max_turns)[0]
    out(f"{task.task_id} ({task.family}, {task.task_type or level}) played by {model}")
    out(f"goal: {episode.goal}")
    for i, t in enumerate(episode.turns, 1):
        out(f"\n--- turn {i}\n{t.observation.strip()}")
        out(f">>> {t.reply.strip()}" + ("   [invalid]" if t.invalid else "") + f"   reward {t.reward:+.2f}")
        if delay:
            time.sleep(delay)
    out(f"\n{'WON' if episode.won else 'lost'} in {len(episode.turns)} turns")
    return episode
