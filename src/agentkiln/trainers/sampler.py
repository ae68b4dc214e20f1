"""Which tasks an RL iteration plays: the curriculum and the balance between task types.

- `uniform`: `tasks_per_iter` tasks drawn from the whole pool (a type's share of an iteration is
  left to chance: with 8 tasks of 3 types an iteration can hold one type only);
- `balanced`: every iteration's tasks are allotted to task types by `mix` (largest remainder, the
  type that gets the odd task rotating), so no type crowds out the others;
- `learnability`: shares follow prioritized level replay's learnability score p * (1 - p), p the
  type's recent success (an exponential moving average over iterations, 0.5 before it is seen):
  types the policy always or never solves give no GRPO signal and get only `min_share` each.

Within a type, tasks are dealt from a shuffled deck that is reshuffled when spent, so every task of
the pool is played before any repeats.

`replay_share` > 0 adds task-level replay (prioritized level replay over single tasks, Jiang et al.
2021): that share of each iteration's tasks is drawn again from the tasks whose last group was neither
all won nor all lost, weighted by p * (1 - p) of that group, without replacement; the rest are dealt
as above. Most groups of a policy fresh from SFT are flat (every episode won, or every one lost) and
teach GRPO-style estimators nothing; the few that vary are worth another look while they still do.

The sampler's state (decks, success estimates, the replayable tasks) is part of the RL checkpoint: a
resumed run deals the same tasks.
"""

from __future__ import annotations

import random
from collections import defaultdict

from agentkiln.envs import TaskSpec


def type_of(task: TaskSpec) -> str:
    return task.task_type or task.family


def apportion(shares: dict[str, float], n: int, rng: random.Random) -> dict[str, int]:
    """`n` items over keys in proportion to `shares` (largest remainder; ties broken by `rng`)."""
    total = sum(shares.values())
    exact = {k: n * v / total for k, v in shares.items()}
    counts = {k: int(x) for k, x in exact.items()}
    keys = sorted(exact)
    rng.shuffle(keys)  # which of the tied types gets the odd task rotates with the iteration
    for k in sorted(keys, key=lambda k: counts[k] - exact[k])[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


class TaskSampler:
    """Deals each iteration's tasks from `pool` (see the module docstring)."""

    def __init__(self, pool: list[TaskSpec], mode: str = "uniform", mix: dict[str, float] | None = None,
                 min_share: float = 0.1, success_ema: float = 0.5, replay_share: float = 0.0):
        self.pool, self.mode, self.min_share, self.success_ema = pool, mode, min_share, success_ema
        self.replay_share = replay_share
        self.by_id = {t.task_id: t for t in pool}
        self.task_success: dict[str, float] = {}  # task id -> success of its last group (replay)
        by_type: dict[str, list[TaskSpec]] = defaultdict(list)
        for t in pool:
            by_type[type_of(t)].append(t)
        self.by_type = dict(sorted(by_type.items()))
        if mix:
            unknown = sorted(set(mix) - set(self.by_type))
            if unknown:
                raise ValueError(f"rl.mix: task type(s) {', '.join(unknown)} not in the RL pool "
                                 f"(its types: {', '.join(self.by_type)}); fix rl.mix or the rl split's mix")
            self.mix = {k: float(v) for k, v in sorted(mix.items()) if v > 0}
        else:
            self.mix = {k: 1.0 for k in self.by_type}
        self.success: dict[str, float] = {}
        self.decks: dict[str, list[int]] = {k: [] for k in self.by_type}

    def shares(self) -> dict[str, float]:
        """This iteration's share of each task type."""
        if self.mode != "learnability":
            return dict(self.mix)
        score = {k: self.success.get(k, 0.5) * (1 - self.success.get(k, 0.5)) for k in self.mix}
        total = sum(score.values())
        floor = min(self.min_share, 1.0 / len(self.mix))
        free = 1.0 - floor * len(self.mix)
        return {k: floor + free * (score[k] / total if total > 0 else 1.0 / len(self.mix)) for k in self.mix}

    def _deal(self, ttype: str, rng: random.Random) -> TaskSpec:
        deck = self.decks[ttype]
        if not deck:
            deck.extend(range(len(self.by_type[ttype])))
            rng.shuffle(deck)
        return self.by_type[ttype][deck.pop()]

    def replayable(self) -> dict[str, float]:
        """Tasks whose last group varied, by learnability p * (1 - p)."""
        return {tid: p * (1 - p) for tid, p in sorted(self.task_success.items()) if 0 < p < 1}

    def _replay(self, n: int, rng: random.Random) -> list[TaskSpec]:
        """Up to `n` replayable tasks, weighted by learnability, without replacement."""
        weights = self.replayable()
        out: list[TaskSpec] = []
        while weights and len(out) < n:
            tid = rng.choices(list(weights), weights=list(weights.values()))[0]
            del weights[tid]
            out.append(self.by_id[tid])
        return out

    def sample(self, n: int, rng: random.Random) -> list[TaskSpec]:
        """`n` tasks (at most the pool's size), distinct within the call."""
        n = min(n, len(self.pool))
        replayed = self._replay(round(n * self.replay_share), rng) if self.replay_share > 0 else []
        taken = {t.task_id for t in replayed}
        return replayed + self._fresh(n - len(replayed), rng, taken)

    def _fresh(self, n: int, rng: random.Random, taken: set[str]) -> list[TaskSpec]:
        if self.mode == "uniform":
            return rng.sample([t for t in self.pool if t.task_id not in taken], n)
        counts = apportion(self.shares(), n, rng)
        tasks: list[TaskSpec] = []
        for ttype, k in counts.items():
            free = sum(t.task_id not in taken for t in self.by_type[ttype])
            k = min(k, free)
            picked: dict[str, TaskSpec] = {}
            while len(picked) < k:
                t = self._deal(ttype, rng)
                if t.task_id not in taken:
                    picked.setdefault(t.task_id, t)
            tasks += picked.values()
        return tasks

    def observe(self, won_by_type: dict[str, list[bool]], won_by_task: dict[str, list[bool]] | None = None) -> None:
        """Fold one iteration's outcomes into each type's success estimate (and each task's, for replay)."""
        for ttype, won in won_by_type.items():
            rate = sum(won) / len(won)
            old = self.success.get(ttype)
            self.success[ttype] = rate if old is None else self.success_ema * old + (1 - self.success_ema) * rate
        for tid, won in (won_by_task or {}).items():
            if tid in self.by_id:  # a harness's offline episodes are not the pool's tasks
                self.task_success[tid] = sum(won) / len(won)

    def state_dict(self) -> dict:
        return {"success": dict(self.success), "decks": {k: list(v) for k, v in self.decks.items()},
                "task_success": dict(self.task_success)}

    def load_state_dict(self, state: dict) -> None:
        self.success = dict(state["success"])
        self.decks = {k: list(state["decks"].get(k, [])) for k in self.by_type}
        self.task_success = dict(state.get("task_success", {}))
