"""An RL iteration's rollouts in flight: who plays them, on which weights, with which seeds.

Synchronous (`asynchronous.max_staleness: 0`) an iteration plays its tasks as one round on the live
weights, in a worker thread the trainer waits for: the same bytes as playing in its own thread.

Asynchronous (`max_staleness: k`) the iterations up to k ahead are launched on a snapshot of the
weights before this iteration's update, so their rollouts overlap the update. Its tasks are cut into chunks of
`asynchronous.chunk_episodes` episodes (whole groups; vLLM: `rollout_batch`), each with a seed of its own:
an episode depends on its chunk alone, never on who played it or when, so a run is deterministic
whatever the timing.

- `worker: process` (the in-process engine): `asynchronous.processes` rollout processes
  (`RolloutProcess`), each on one torch thread, play on one copy of the model in shared memory into
  which the trainer writes each flight's weights (weight sync in memory, nothing pickled). They and
  the trainer claim chunks from one shared counter: the processes play while the trainer updates, and
  the trainer, its update done, plays whatever is left (on one thread, as they do, so a chunk's bytes
  do not depend on who played it) instead of waiting. The trainer trains on as many torch threads
  fewer than it was given as there are processes: on 2 cores, one each. `processes: 0`: none, the
  trainer plays each flight once its update is done.
- `worker: ray` (with `compute.ray.enabled`): `asynchronous.processes` Ray actors (`RolloutActors`),
  one torch thread each, each holding a copy of the policy; a flight's weights go into Ray's object
  store once (in memory, shared by the actors of a node) and its chunks are dealt to the actors
  round-robin. The same chunk seeds, so the same bytes as the rollout processes; on a cluster the
  actors spread over the nodes (the tasks directory at the same path on each, as for fan-out).
- `worker: thread` (and vLLM, a process of its own already): a thread plays the chunks on the
  backend's snapshot.

On DeepSpeed ranks (`compute.deepspeed.spread_rollouts`, `worker: process`) the flights launched ahead
are shared with the other ranks, which have no rollout process: rank 0 puts a new flight's chunks
(tasks, seeds) into the iteration's broadcast, and every other rank (`RankFlights`) snapshots its
weights on receipt, before its update (ZeRO-2: the weights rank 0 launched the flight on). Once the
update is done (every rank at once: ZeRO-2's step ends in a collective), rank 0 reserves a share of
the next flight's chunks that its rollout processes have not claimed yet (`share_out`: an equal part
per player, its processes and trainer counting one each) and broadcasts which rank plays which; each
rank plays them, while rank 0's processes and trainer play the rest, and hands them over
(`Engine.gather`) when rank 0 takes that flight. Who plays a chunk never changes its bytes, so the
curve is one process's whatever the timing. A flight launched at `take` for the iteration itself, or
restored from a checkpoint, is rank 0's alone.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import queue
import random
import signal
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from agentkiln import fanout, lifecycle
from agentkiln.config import RLParams
from agentkiln.envs import TaskSpec
from agentkiln.policy.model import Policy
from agentkiln.rewards import needs_potentials
from agentkiln.rollout.backends import HFRollout, SnapshotRollout, snapshot_weights
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode
from agentkiln.trainers.engine import Engine
from agentkiln.trainers.sampler import TaskSampler


def iteration_seed(seed: int, it: int) -> int:
    """The seed of iteration `it`'s rollouts: the same whoever plays them and whenever."""
    return seed * 100_003 + it * 101


def chunk_seed(seed: int, it: int, chunk: int) -> int:
    """The seed of chunk `chunk` of asynchronous iteration `it`."""
    return iteration_seed(seed, it) * 1_000 + chunk


def play(rollout, tasks: list[TaskSpec], tasks_dir: Path, p: RLParams, seed: int) -> list[Episode]:
    """One round: G episodes per task from the same initial state, on the rollout backend (spread over
    DeepSpeed ranks when it is trainers.rank_rounds.RankRounds)."""
    if hasattr(rollout, "play_round"):
        return rollout.play_round(tasks, seed)
    agent = rollout.agent(p.temperature, False, seed, p.rollout_batch, p.decoding, p.max_reply_tokens)
    return run_episodes(agent, tasks, tasks_dir, p.max_turns, group_size=p.group_size,
                        potentials=needs_potentials(p.reward), guided=p.guidance.per_group, seed=seed)


def tasks_per_chunk(p: RLParams, snapshot: bool = False) -> int:
    """Tasks per chunk: of an asynchronous flight on the in-process engine's snapshot
    `asynchronous.chunk_episodes`, else (a synchronous round spread over ranks; vLLM, which batches a
    chunk itself) `rollout_batch` episodes; whole groups."""
    size = p.asynchronous.chunk_episodes if snapshot else None
    return max(1, (size or p.rollout_batch) // p.group_size)


def joined(parts: list[list[Episode]], per: int) -> list[Episode]:
    """The chunks' episodes in task order, each group numbered by its task's place in the iteration."""
    out: list[Episode] = []
    for c, episodes in enumerate(parts):
        for ep in episodes:
            ep.group += c * per
        out += episodes
    return out


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _claim(counter, flight: int, slot: int) -> int | None:
    """The next unplayed chunk of `flight` (its counter at `slot`: [flight, next chunk, end]), or None:
    the processes and the trainer share this; chunks from `end` on are reserved for other ranks."""
    with counter.get_lock():
        if counter[3 * slot] != flight or counter[3 * slot + 1] >= counter[3 * slot + 2]:
            return None
        counter[3 * slot + 1] += 1
        return counter[3 * slot + 1] - 1


def _serve(policies: list[Policy], tasks_dir: Path, p: RLParams, counter, todo, done, parent: int) -> None:
    """A rollout process: for each flight, claim chunks and play them on the flight's slot. The
    policies' tensors are in shared memory: the trainer writes a flight's weights into its slot before
    launching it, and a slot is reused only once every chunk of its previous flight is in."""
    lifecycle.die_with_parent(signal.SIGTERM, parent)  # a killed trainer leaves no rollout process behind
    torch.set_num_threads(1)
    rollouts = [HFRollout(policy) for policy in policies]
    while (flight := todo.get()) is not None:
        fid, slot, parts, seeds = flight
        while (c := _claim(counter, fid, slot)) is not None:
            try:
                done.put((fid, c, play(rollouts[slot], parts[c], tasks_dir, p, seeds[c])))
            except BaseException:  # noqa: BLE001  (handed to the trainer, which raises it)
                done.put((fid, c, RuntimeError(f"rl: the rollout process failed:\n{traceback.format_exc()}")))


class RolloutProcess:
    """Rollout processes (`asynchronous.processes`) sharing `slots` copies of the policy in shared
    memory, one per flight that can be in flight at once (`max_staleness`): the trainer writes a
    flight's weights into its slot (weight sync in memory, nothing pickled per iteration), and the
    processes only read them while it plays."""

    def __init__(self, policy: Policy, tasks_dir: Path, p: RLParams, processes: int = 1, slots: int = 1):
        ctx = torch.multiprocessing.get_context("spawn")
        self.slots = slots
        owns = []
        for _ in range(slots):
            own = copy.deepcopy(policy)
            own.model.eval().requires_grad_(False).share_memory()
            owns.append(own)
        self.weights = [own.model.state_dict() for own in owns]  # views of the shared tensors
        self.counter = ctx.Array("q", [0, 0, 0] * slots)  # per slot: [flight, next chunk, end], under its lock
        self.todo, self.done = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_serve, name=f"rl-rollout-{i}", daemon=True,
                                  args=(owns, tasks_dir, p, self.counter, self.todo, self.done, os.getpid()))
                      for i in range(processes)]
        for proc in self.procs:
            proc.start()  # they spawn and import while the first iteration is played here

    def launch(self, fid: int, weights: dict, parts: list[list[TaskSpec]], seeds: list[int]) -> None:
        slot = fid % self.slots
        with torch.no_grad():
            for k, v in weights.items():  # nothing reads this slot: its previous flight is all in
                self.weights[slot][k].copy_(v)
        with self.counter.get_lock():
            self.counter[3 * slot : 3 * slot + 3] = [fid, 0, len(parts)]
        for _ in self.procs:
            self.todo.put((fid, slot, parts, seeds))

    def claim(self, fid: int) -> int | None:
        return _claim(self.counter, fid, fid % self.slots)

    def reserve(self, fid: int, share: float) -> list[int]:
        """Take `share` of flight `fid`'s unclaimed chunks (the last ones) away from the processes and
        the trainer, for other ranks to play."""
        slot = fid % self.slots
        with self.counter.get_lock():
            start, end = self.counter[3 * slot + 1], self.counter[3 * slot + 2]
            if self.counter[3 * slot] != fid or start >= end:
                return []
            self.counter[3 * slot + 2] = end - int((end - start) * share)
            return list(range(self.counter[3 * slot + 2], end))

    def result(self, fid: int) -> tuple[int, list[Episode]]:
        """The next chunk of flight `fid` a process played: (its index, its episodes)."""
        while True:
            try:
                got, c, episodes = self.done.get(timeout=1.0)
            except queue.Empty:
                dead = [proc for proc in self.procs if not proc.is_alive()]
                if dead:
                    raise RuntimeError(f"rl: the rollout process {dead[0].name} died (exit code {dead[0].exitcode})"
                                       ) from None
                continue
            if isinstance(episodes, BaseException):
                raise episodes
            if got == fid:
                return c, episodes

    def close(self) -> None:
        for _ in self.procs:
            with contextlib.suppress(Exception):
                self.todo.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


class _RolloutActor:
    """A Ray actor's body (`RolloutActors`): its own copy of the policy on one torch thread; a chunk's
    call carries its flight's weights (an object-store reference, loaded once per flight)."""

    def __init__(self, policy: Policy, tasks_dir: str, p: RLParams):
        torch.set_num_threads(1)
        self.rollout = SnapshotRollout(policy)
        self.tasks_dir, self.p, self.loaded = Path(tasks_dir), p, None

    def play(self, fid: int, weights: dict, part: list[TaskSpec], seed: int) -> list[Episode]:
        if self.loaded != fid:
            self.rollout.load(weights)
            self.loaded = fid
        return play(self.rollout, part, self.tasks_dir, self.p, seed)


class RolloutActors:
    """`asynchronous.worker: ray`: the rollout workers are Ray actors (module docstring). The same
    interface as RolloutProcess; the actors play every chunk of a flight (the trainer claims none)."""

    def __init__(self, policy: Policy, tasks_dir: Path, p: RLParams, actors: int = 1):
        if not fanout.active():
            raise ValueError("rl: asynchronous.worker = 'ray' needs a Ray session: set compute.ray.enabled: true")
        import ray  # noqa: PLC0415  (Ray only on its path: a run without it never imports it)

        self.ray = ray
        remote = ray.remote(_RolloutActor).options(num_cpus=1, scheduling_strategy="SPREAD")
        own = ray.put(policy)  # pickled once, read by every actor
        self.actors = [remote.remote(own, str(Path(tasks_dir).resolve()), p) for _ in range(actors)]
        self.refs: dict[int, list] = {}  # flight -> its chunks' results, by chunk (None once taken)
        self.dealt = 0

    def launch(self, fid: int, weights: dict, parts: list[list[TaskSpec]], seeds: list[int]) -> None:
        ref = self.ray.put(weights)  # weight sync through the object store: in memory, once per flight
        refs = []
        for part, seed in zip(parts, seeds):
            refs.append(self.actors[self.dealt % len(self.actors)].play.remote(fid, ref, part, seed))
            self.dealt += 1
        self.refs[fid] = refs

    def claim(self, fid: int) -> None:
        return None

    def result(self, fid: int) -> tuple[int, list[Episode]]:
        """The next chunk of flight `fid` an actor played: (its index, its episodes)."""
        refs = self.refs[fid]
        (ready,), _ = self.ray.wait([r for r in refs if r is not None], num_returns=1)
        c = refs.index(ready)
        refs[c] = None
        if all(r is None for r in refs):
            del self.refs[fid]
        try:
            return c, self.ray.get(ready)
        except self.ray.exceptions.RayError as e:
            raise RuntimeError(f"rl: a Ray rollout actor failed: {e}") from None

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)


@dataclass
class Flight:
    """An iteration's rollouts launched: on the weights of policy `version`, played by `job` (a thread's
    future, or (flight id, chunks, seeds) for the rollout processes)."""

    it: int
    version: int
    tasks: list[TaskSpec]
    weights: dict | None
    job: object
    spread: bool = False  # launched ahead on DeepSpeed ranks: others may play chunks of it (`share_out`)
    reserved: list[int] | None = None  # the chunks other ranks play (None: not shared out)


class InFlight:
    """The rollouts of the iterations in flight: their tasks dealt (on the trainer's thread, from its
    rng) and their episodes played by a worker (module docstring).

    `take(it, last)` returns iteration `it`'s episodes and the policy version that played them
    (launched now, on the current weights, if `it` is not in flight: always when synchronous, and on
    the first iteration or a resume without a checkpointed flight when asynchronous). Asynchronous, it
    then launches every iteration up to `it + max_staleness` (and `last`) not in flight yet, on the
    weights as they are, before this iteration's update, which therefore overlaps those rollouts: an
    iteration launched at `take(i)` is `j - i <= max_staleness` versions stale when taken."""

    def __init__(self, rollout, pool: list[TaskSpec], tasks_dir: Path, p: RLParams, seed: int, rng: random.Random,
                 sampler: TaskSampler, policy: Policy, ranks: Engine | None = None):
        self.rollout, self.pool, self.tasks_dir, self.p, self.seed = rollout, pool, tasks_dir, p, seed
        self.rng, self.sampler, self.policy = rng, sampler, policy
        self.outbox: list[dict] = []  # the flights launched ahead since `plans()`, for the other ranks
        self.ranks_playing = 1  # ranks that played the flight taken last
        self.pending: dict[int, Flight] = {}  # by iteration, in launch order
        self.bound = p.asynchronous.max_staleness
        self.per = tasks_per_chunk(p, isinstance(rollout, SnapshotRollout))  # tasks per chunk of a flight
        if self.bound > 1 and not isinstance(rollout, SnapshotRollout):
            raise ValueError(f"rl: asynchronous.max_staleness = {self.bound} with the {type(rollout).__name__} backend: "
                             "it plays on the live policy's weights, so only one iteration can be in flight; use "
                             "max_staleness 1, or the hf backend")
        self.process = None
        if self.bound and isinstance(rollout, SnapshotRollout) and p.asynchronous.worker != "thread":
            workers = RolloutActors if p.asynchronous.worker == "ray" else functools.partial(
                RolloutProcess, slots=self.bound)
            self.process = workers(rollout.policy, tasks_dir, p, p.asynchronous.processes)
        # DeepSpeed ranks that play chunks of the flights launched ahead (module docstring)
        self.ranks = ranks if ranks is not None and ranks.world > 1 and isinstance(self.process, RolloutProcess) \
            else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rl-rollout")
        self.flights = 0
        self.loaded: int | None = None  # the flight whose weights the snapshot holds (the trainer's chunks)
        self.threads = torch.get_num_threads()
        if self.process is not None:  # each rollout process has a core of its own: the trainer the rest
            torch.set_num_threads(max(1, self.threads - p.asynchronous.processes))  # (2 threads beside one on 2 cores: 27.8 s of update, not 21.6)

    def _launch(self, it: int, version: int, tasks: list[TaskSpec] | None = None, weights: dict | None = None,
                spread: bool = False) -> None:
        if tasks is None:
            tasks = self.sampler.sample(self.p.tasks_per_iter, self.rng)
        if not self.bound:  # one round on the live weights
            self.rollout.sync(self.policy)
            job = self.thread.submit(play, self.rollout, tasks, self.tasks_dir, self.p, iteration_seed(self.seed, it))
            self.pending[it] = Flight(it, version, tasks, None, job)
            return
        if weights is None:
            weights = snapshot_weights(self.policy)
        parts = [tasks[i : i + self.per] for i in range(0, len(tasks), self.per)]
        seeds = [chunk_seed(self.seed, it, c) for c in range(len(parts))]
        spread = spread and self.ranks is not None
        if spread:  # its chunks go out with the iteration's broadcast: other ranks may play some
            self.outbox.append({"iteration": it, "parts": parts, "seeds": seeds})
        self.flights += 1
        if self.process is not None:
            self.process.launch(self.flights, weights, parts, seeds)
            job = (self.flights, parts, seeds)
        else:
            rollout = self.rollout
            if not hasattr(rollout, "load"):  # vLLM takes weights from a policy (one flight at a time)
                rollout.sync(self.policy)

            def play_all() -> list[list[Episode]]:  # the thread plays flights in launch order
                if hasattr(rollout, "load"):
                    rollout.load(weights)
                return [play(rollout, part, self.tasks_dir, self.p, s) for part, s in zip(parts, seeds)]

            job = self.thread.submit(play_all)
        self.pending[it] = Flight(it, version, tasks, weights, job, spread)

    def _gather(self, flight: Flight) -> list[list[Episode]]:
        """A flight's chunks in order: this process's (those nobody claimed yet played here, then the
        processes' collected), then, spread, the other ranks'."""
        if not self.bound:
            return flight.job.result()
        got = self._gather_here(flight)
        self.ranks_playing = 1
        if flight.reserved is not None:  # every rank takes part, in the same order as the other collectives
            for part in self.ranks.gather({})[1:]:
                got |= part
                self.ranks_playing += bool(part)
        return [got[c] for c in range(len(got))]

    def _gather_here(self, flight: Flight) -> dict[int, list[Episode]]:
        """The chunks played on this rank: by the thread, or by the processes and the trainer."""
        if isinstance(flight.job, Future):
            return dict(enumerate(flight.job.result()))
        fid, parts, seeds = flight.job
        got: dict[int, list[Episode]] = {}
        with torch_threads(1):
            while (c := self.process.claim(fid)) is not None:
                if self.loaded != fid:
                    self.rollout.load(flight.weights)
                    self.loaded = fid
                got[c] = play(self.rollout, parts[c], self.tasks_dir, self.p, seeds[c])
        while len(got) < len(parts) - len(flight.reserved or []):
            c, episodes = self.process.result(fid)
            got[c] = episodes
        return got

    def take(self, it: int, last: int) -> tuple[list[Episode], int]:
        if it not in self.pending:
            self._launch(it, version=it)
        flight = self.pending.pop(it)
        out = self._gather(flight)
        if not self.bound:
            return out, flight.version
        weights = None
        for j in range(it + 1, min(it + self.bound, last) + 1):
            if j not in self.pending:  # on the weights before this iteration's update
                weights = weights or snapshot_weights(self.policy)
                self._launch(j, version=it, weights=weights, spread=True)
        return joined(out, self.per), flight.version

    def plans(self) -> list[dict]:
        """The flights launched ahead since the last call, for the other ranks (the iteration's broadcast)."""
        out, self.outbox = self.outbox, []
        return out

    def share_out(self, it: int) -> dict | None:
        """Once every rank's update is done: which of flight `it`'s unclaimed chunks each other rank
        plays (an equal part per player: each rollout process, the trainer, each other rank), reserved
        here so that nobody else plays them; None if flight `it` is not spread."""
        flight = self.pending.get(it)
        if flight is None or not flight.spread or flight.reserved is not None:
            return None
        others = self.ranks.world - 1
        flight.reserved = self.process.reserve(flight.job[0], others / (others + 1 + len(self.process.procs)))
        return {"iteration": it, "chunks": {r: flight.reserved[r - 1 :: others] for r in range(1, others + 1)}}

    def state(self) -> list[dict]:
        """What a checkpoint keeps of the flights: each one's iteration, version, tasks and weights."""
        return [{"iteration": f.it, "version": f.version, "task_ids": [t.task_id for t in f.tasks], "weights": f.weights}
                for f in self.pending.values()]

    def restore(self, state: list[dict] | dict) -> None:
        """Relaunch checkpointed flights, in order: the same tasks on the same weights (exact; vLLM, which
        takes weights only from the live policy, plays it on the resumed trainer's)."""
        by_id = {t.task_id: t for t in self.pool}
        for f in [state] if isinstance(state, dict) else state:
            self._launch(f["iteration"], f["version"], [by_id[i] for i in f["task_ids"]], f["weights"])

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)
        if self.process is not None:
            self.process.close()
            torch.set_num_threads(self.threads)


class RankFlights:
    """A DeepSpeed rank other than 0, asynchronous and spread (module docstring): the chunks rank 0 shares
    out of its flights, played on a snapshot of the weights the flights were launched on."""

    def __init__(self, policy: Policy, engine: Engine, tasks_dir: Path, p: RLParams):
        self.policy, self.engine, self.tasks_dir, self.p = policy, engine, tasks_dir, p
        self.rollout = SnapshotRollout(policy)
        self.flights: dict[int, tuple[dict, dict]] = {}  # by iteration: (weights, plan) of the flights in flight
        self.done: dict[int, dict[int, list[Episode]]] = {}  # by iteration: this rank's chunks played

    def receive(self, plans: list[dict]) -> None:
        """Before this rank's update: its weights are those rank 0 launched the flights on (ZeRO-2)."""
        weights = snapshot_weights(self.policy) if plans else None
        for plan in plans:
            self.flights[plan["iteration"]] = (weights, plan)

    def play(self, share: dict | None) -> None:
        """After the update: play this rank's chunks of `share` (rank 0's `share_out`), on one torch
        thread as rank 0's processes do."""
        if share is None:
            return
        it = share["iteration"]
        weights, plan = self.flights.pop(it)
        mine = share["chunks"].get(self.engine.rank, [])
        self.done[it] = {}
        if mine:
            self.rollout.load(weights)
        with torch_threads(1):
            for c in mine:
                self.done[it][c] = play(self.rollout, plan["parts"][c], self.tasks_dir, self.p, plan["seeds"][c])

    def hand_over(self, it: int) -> None:
        """At iteration `it`, before its broadcast: rank 0 takes flight `it` and gathers its shared chunks."""
        if it in self.done:
            self.engine.gather(self.done.pop(it))
