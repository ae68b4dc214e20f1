"""A synchronous round's rollouts spread over DeepSpeed ranks (`compute.deepspeed.spread_rollouts`).

Under ZeRO-2 every rank holds the whole, current weights (data parallel), so every rank can play:
rank 0 deals a round's tasks (its sampler, its rng) and broadcasts them with the round's seed; the
tasks are dealt into chunks of `rl.rollout_batch` episodes (whole groups; task i to chunk i mod
the number of chunks, so the slow and fast families of a round, which the sampler deals in family
order, spread over the chunks), chunk c seeded by (round seed, c) and played by rank c mod world on its
own live weights, and rank 0 gathers the chunks' episodes in task order. Nothing moves but tasks out
and episodes back: no weight sync.

A chunk's episodes depend on its tasks, seed and weights alone, so a run's curve does not depend on
how many ranks play it: one process with `RankRounds` over its local engine (world 1) plays every
chunk itself and gives the same curve (tests/test_deepspeed.py). Ranks beyond the number of chunks
idle: give every rank a chunk by setting `rl.rollout_batch` to (tasks_per_iter x group_size) / ranks.

Rank 0 calls `play_round` (through trainers.inflight.play) for every round of an iteration, then
`finish`; every other rank calls `serve`, which plays its chunks of each round until `finish`.
"""

from __future__ import annotations

from pathlib import Path

from agentkiln.config import RLParams
from agentkiln.envs import TaskSpec
from agentkiln.rollout.backends import HFRollout
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode
from agentkiln.rewards import needs_potentials
from agentkiln.trainers.engine import Engine
from agentkiln.trainers.inflight import tasks_per_chunk


def round_chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk `chunk` of a round seeded `seed`."""
    return seed * 1_000 + chunk


class RankRounds:
    """The in-process engine on this rank's live weights, playing its share of each round (module
    docstring). Rank 0 hands it to the loop as its rollout backend."""

    recompute = False  # every rank plays on the trainer's own weights: the log-probs are the trainer's

    def __init__(self, rollout: HFRollout, engine: Engine, tasks_dir: Path, p: RLParams):
        self.rollout, self.engine, self.tasks_dir, self.p = rollout, engine, Path(tasks_dir), p
        self.per = tasks_per_chunk(p)
        self.playing: set[int] = set()  # ranks that played a chunk since the last `finish`

    def sync(self, policy) -> None:
        self.rollout.sync(policy)

    def agent(self, *args, **kwargs):
        return self.rollout.agent(*args, **kwargs)

    def chunks(self, tasks: list[TaskSpec]) -> int:
        return -(-len(tasks) // self.per)

    def _play_mine(self, tasks: list[TaskSpec], seed: int) -> dict[int, list[Episode]]:
        p, world, rank = self.p, self.engine.world, self.engine.rank
        out = {}
        n = self.chunks(tasks)
        for c in range(rank, n, world):
            agent = self.rollout.agent(p.temperature, False, round_chunk_seed(seed, c), p.rollout_batch, p.decoding,
                                       p.max_reply_tokens)
            out[c] = run_episodes(agent, tasks[c::n], self.tasks_dir, p.max_turns, group_size=p.group_size,
                                  potentials=needs_potentials(p.reward), guided=p.guidance.per_group,
                                  seed=round_chunk_seed(seed, c))
        return out

    def play_round(self, tasks: list[TaskSpec], seed: int) -> list[Episode]:
        """Rank 0: one round's episodes, every rank playing its chunks; groups numbered in task order."""
        self.engine.broadcast((tasks, seed))
        n = self.chunks(tasks)
        out: list[Episode] = []
        for r, part in enumerate(self.engine.gather(self._play_mine(tasks, seed))):
            for c, episodes in part.items():
                for ep in episodes:
                    ep.group = c + ep.group * n  # chunk c's group g is task c + g n
                out += episodes
            if part:
                self.playing.add(r)
        return sorted(out, key=lambda ep: ep.group)  # stable: a group's episodes keep their order

    def finish(self) -> int:
        """Rank 0: this iteration's rounds are over (the other ranks leave `serve`); how many ranks played."""
        if self.engine.world > 1:
            self.engine.broadcast(None)
        n, self.playing = len(self.playing), set()
        return n

    def serve(self) -> None:
        """Ranks other than 0: play this rank's chunks of each round rank 0 deals, until it says `finish`."""
        while (msg := self.engine.broadcast(None)) is not None:
            tasks, seed = msg
            self.engine.gather(self._play_mine(tasks, seed))
