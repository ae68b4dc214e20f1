"""Checkpoint selection on a frozen panel (`rl.*.select`, docs/rl.md "Checkpoint selection").

An RL stage's last weights are one draw of where its updates went: on the small default policy the
same recipe gains cooking games at every seed but, at some seeds or on another CPU's kernels, also
loses a few FrozenLake states it played well greedily (docs/journal.md, 2026-12-06). The selector
plays a validation panel greedily at the stage's start, every `every` iterations and at its end, and
keeps the best weights it saw: the highest success among the checkpoints that lost no more than
`guard` of the start's success on any family (the start always qualifies, so RL never ships a family
regression the panel can see). Ties go to the later checkpoint. The panel is not the one that reports:
the test panel is refused in config (choose on val, report on test, as verl's and TRL's evaluation
during training is used for). The best weights are kept as a CPU copy, so selection costs one
model's memory and the panel's greedy play per look.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from agentkiln.config import SelectParams
from agentkiln.envs import TaskSpec
from agentkiln.rollout.engine import run_episodes


def family_success(won: list[tuple[str, bool]]) -> dict[str, float]:
    """Success per family and over all ("all") of (family, won) pairs."""
    fams: dict[str, list[bool]] = {}
    for fam, w in won:
        fams.setdefault(fam, []).append(w)
    out = {f: sum(v) / len(v) for f, v in sorted(fams.items())}
    return out | {"all": sum(w for _, w in won) / len(won) if won else 0.0}


def play_panel(agent, tasks: list[TaskSpec], tasks_dir: Path, max_turns: int | None, progress: str) -> dict[str, float]:
    """One pass of `agent` over `tasks`, no gradients: success per family and over all ("all"). The
    selector's looks and the distill stage's restarts play their panels this way."""
    with torch.no_grad():
        eps = run_episodes(agent, tasks, tasks_dir, max_turns, progress=progress)
    return family_success([(e.family, bool(e.won)) for e in eps])


def admissible(scores: dict[str, float], start: dict[str, float], guard: float) -> bool:
    """No family below the start's success by more than `guard` (a small tolerance for float sums)."""
    return all(scores.get(f, 0.0) >= s - guard - 1e-9 for f, s in start.items() if f != "all")


class Selector:
    """Plays `tasks` greedily with `agent(policy)` when `due`, keeps the best admissible weights."""

    def __init__(self, p: SelectParams, tasks: list[TaskSpec], tasks_dir: Path, max_turns: int | None,
                 agent: Callable[[object], object]):
        if not tasks:
            raise ValueError(f"rl select: panel {p.panel!r} has no tasks")
        self.p, self.tasks, self.tasks_dir, self.max_turns, self.agent = p, tasks, Path(tasks_dir), max_turns, agent
        self.scores: dict[int, dict[str, float]] = {}  # iteration -> success per family and "all"
        self.best: int | None = None
        self.best_weights: dict[str, torch.Tensor] | None = None

    def due(self, iteration: int) -> bool:
        return iteration == 0 or iteration % self.p.every == 0

    def observe(self, iteration: int, policy) -> dict[str, float]:
        """Play the panel with the policy's weights now; keep them if they are the best admissible so far.
        Returns the metrics row (select/<family>, select/success, select/kept)."""
        model = policy.model
        was_training = model.training
        model.eval()
        scores = play_panel(self.agent(policy), self.tasks, self.tasks_dir, self.max_turns,
                            progress=f"select: {self.p.panel} at iteration {iteration}")
        model.train(was_training)
        self.scores[iteration] = scores
        start = self.scores[min(self.scores)]
        kept = admissible(scores, start, self.p.guard) and (
            self.best is None or scores["all"] >= self.scores[self.best]["all"])
        if kept:
            self.best = iteration
            self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return {f"select/{f}": s for f, s in scores.items() if f != "all"} | {
            "select/success": scores["all"], "select/kept": float(kept)}

    def restore(self, policy) -> int:
        """Load the kept weights into `policy`; the iteration they are from."""
        if self.best is None:
            raise RuntimeError("rl select: nothing observed; observe(0, policy) before training")
        policy.model.load_state_dict(self.best_weights)
        return self.best

    def report(self) -> dict:
        """What the stage's metrics say about the choice: the panel, the kept iteration, its and the
        start's and the last look's success, and every look's success per family."""
        first, last = min(self.scores), max(self.scores)
        return {"select_panel": self.p.panel, "selected_iteration": self.best,
                "select_success_start": self.scores[first]["all"],
                "select_success_selected": self.scores[self.best]["all"],
                "select_success_last": self.scores[last]["all"],
                "select_looks": [{"iteration": k, **v} for k, v in sorted(self.scores.items())]}

    def state_dict(self) -> dict:
        return {"scores": self.scores, "best": self.best, "best_weights": self.best_weights}

    def load_state_dict(self, state: dict) -> None:
        self.scores = {int(k): v for k, v in state["scores"].items()}
        self.best, self.best_weights = state["best"], state["best_weights"]
