"""DeepSpeed ranks launched by the stage itself (`compute.backend: deepspeed`, docs/scale.md).

`launch(fn, job, compute)` starts `compute.deepspeed.num_procs` processes on this machine (spawned,
one per GPU on cuda, gloo over the CPU otherwise), each with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set, and runs `fn(rank, job)` in each: no `deepspeed` launcher, no hostfile, so DVC and
Prefect see one stage process. The job (a policy, its episodes, the settings) goes to the ranks as a
file written once by the parent and read by each rank: every rank owns its copy of the weights.

Rank 0 alone talks to the outside: its `rank.log(metrics, step)` rows reach the parent through a
queue and the parent logs them (the MLflow run stays the stage's), and the trainers have rank 0
alone write checkpoints and the saved model. An exception in any rank stops the stage with that
rank's traceback; the others (stuck in a collective by then) are stopped. No rank outlives the
stage: SIGTERM/SIGHUP reach them (lifecycle forwards to the process group, `launch` stops them on
the way out) and the kernel sends them SIGTERM if the stage dies, even by SIGKILL.

DeepSpeed on CPU: its TorchBackend JIT-compiles a shared-memory all-reduce (`deepspeed_shm_comm`,
~2.7 min on 2 cores, measured) the first time it starts on a machine, and only its inference
all-reduce uses it; training never calls it, so ranks mark the op incompatible before DeepSpeed
initialises and nothing is compiled (no DeepSpeedCPUAdam either: the optimizer is torch's AdamW).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentkiln.config import ComputeParams

POLL_S = 0.2  # how often the parent checks on its ranks
GRACE_S = 5.0  # a rank gets this long after SIGTERM before SIGKILL
ERROR_WAIT_S = 1.0  # after a first failure, how long to wait for the other ranks' tracebacks


class RankError(RuntimeError):
    """A rank failed; the message carries its traceback."""


@dataclass
class Rank:
    """What a rank knows about itself: its index, the world, its device and the compute settings it
    runs under (`compute.device` set to this rank's device)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    compute: ComputeParams
    job_path: str
    _queue: Any = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def log(self, metrics: dict, step: int) -> None:
        """Rank 0's metrics go to the parent, which logs them; other ranks' calls are dropped."""
        if self.main and self._queue is not None:
            self._queue.put(("log", metrics, step))

    def job(self) -> Any:
        """A fresh copy of the job the stage launched with (rank 0 rebuilds its unsharded policy from it)."""
        return torch.load(self.job_path, weights_only=False, map_location="cpu")


# --------------------------------------------------------------------------- parent side
def plan(compute: ComputeParams) -> tuple[str, str]:
    """(device type, communication backend) of the ranks, after checking that this machine can run
    them; a setting it cannot honour stops the run naming it."""
    ds = compute.deepspeed
    n = ds.num_procs
    if compute.device.startswith("cuda:") and n > 1:
        raise ValueError(f"compute.device = {compute.device} with compute.backend = deepspeed and "
                         f"compute.deepspeed.num_procs = {n}: each rank takes one GPU (rank i: cuda:i); "
                         "set compute.device to cuda or auto")
    if compute.device == "cpu" or (compute.device == "auto" and not torch.cuda.is_available()):
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(f"compute.device = {compute.device}: torch sees no CUDA device; set compute.device to "
                               "auto or cpu (DeepSpeed ranks then run on the CPU over gloo)")
        if n > torch.cuda.device_count():
            raise ValueError(f"compute.deepspeed.num_procs = {n}: one rank per GPU and torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s); set num_procs to at most that")
        device = "cuda"
    comm = ds.comm_backend if ds.comm_backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if comm == "nccl" and device != "cuda":
        raise ValueError("compute.deepspeed.comm_backend = nccl needs CUDA ranks, and these ranks run on the CPU "
                         "(compute.device); use gloo or auto")
    if ds.offload_params and ds.zero_stage != 3:
        raise ValueError(f"compute.deepspeed.offload_params = true needs zero_stage 3 (it is {ds.zero_stage}): "
                         "ZeRO-2 keeps every weight on every rank")
    return device, comm


def parent_compute(compute: ComputeParams) -> ComputeParams:
    """How the stage process builds the policy it hands to the ranks (each rank then `place`s its copy
    under its own settings): on the CPU (a copy on GPU 0 would only take rank 0's memory), without
    gradient checkpointing (peft then hooks the embeddings with a local function, which cannot be
    pickled; non-reentrant checkpointing, switched on in the ranks, does not need that hook)."""
    return compute.model_copy(update={"device": "cpu", "gradient_checkpointing": False})


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise RuntimeError(f"compute.deepspeed.master_port = {port}: cannot listen on it ({e.strerror}; another "
                               "run's ranks?); choose a free port") from None


def launch(fn: Callable[[Rank, Any], Any], job: Any, compute: ComputeParams,
           log: Callable[[dict, int], None] | None = None) -> Any:
    """Run `fn(rank, job)` on `compute.deepspeed.num_procs` ranks; rank 0's `rank.log` rows go to `log`;
    returns what rank 0's `fn` returned. `fn` must be a module-level function (ranks import it)."""
    import multiprocessing as mp

    device, comm = plan(compute)
    ds = compute.deepspeed
    _check_port(ds.master_port)
    n = ds.num_procs
    # CPU ranks share the stage's threads: oversubscribed cores slow every collective to a crawl
    threads = max(1, torch.get_num_threads() // n) if device == "cpu" else torch.get_num_threads()
    determinism = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no forked torch / CUDA / thread state
    q = ctx.Queue()
    procs = []
    with tempfile.TemporaryDirectory(prefix="agentkiln-ranks-") as tmp:
        job_path = str(Path(tmp) / "job.pt")
        torch.save(job, job_path)
        try:
            for r in range(n):
                env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ds.master_port), "DS_ACCELERATOR": device}
                p = ctx.Process(target=_rank_main, name=f"agentkiln-rank{r}",
                                args=(fn, job_path, r, n, env, device, comm, compute, threads, determinism,
                                      torch.initial_seed(), os.getpid(), q))
                p.start()
                procs.append(p)
            return _supervise(procs, q, log)
        finally:
            _stop(procs)
            q.close()
            q.cancel_join_thread()


def _supervise(procs: list, q, log: Callable[[dict, int], None] | None) -> Any:
    """Relay rank 0's log rows until every rank has exited; rank 0's result, or RankError."""
    n = len(procs)
    result, done = None, False
    while True:
        try:
            msg = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            msg = None
        if msg is not None:
            if msg[0] == "log":
                if log:
                    log(msg[1], msg[2])
            elif msg[0] == "done":
                result, done = msg[1], True
            elif msg[0] == "error":
                _fail(procs, q, [msg[1:]])
            continue
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            # a rank's last messages may still be in the pipe when its exit is seen
            msgs = _drain(q, ERROR_WAIT_S if any(c not in (None, 0) for c in codes) else 0.0)
            for m in msgs:
                if m[0] == "log" and log:
                    log(m[1], m[2])
                elif m[0] == "done":
                    result, done = m[1], True
            errors = [m[1:] for m in msgs if m[0] == "error"]
            if errors:
                _fail(procs, q, errors)
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with status {c}"
                raise RankError(f"deepspeed rank {r} of {n} {how} without a traceback (out of memory?)")
            if not done:
                raise RankError("deepspeed ranks exited without rank 0's result")
            return result


def _drain(q, wait: float) -> list:
    out, end = [], time.monotonic() + wait
    while True:
        try:
            out.append(q.get(timeout=max(0.01, end - time.monotonic())))
        except queue_mod.Empty:
            return out


def _fail(procs: list, q, errors: list[tuple[int, str]]):
    """Raise RankError with the first failed rank's traceback (others that failed within
    ERROR_WAIT_S are named: often the first one's peers, cut off mid-collective)."""
    errors += [m[1:] for m in _drain(q, ERROR_WAIT_S) if m[0] == "error"]
    _stop(procs)
    rank, tb = errors[0]
    others = "".join(f"\n(rank {r} failed too: {t.strip().splitlines()[-1]})" for r, t in errors[1:])
    raise RankError(f"deepspeed rank {rank} of {len(procs)} failed:\n{tb.rstrip()}{others}")


def _stop(procs: list) -> None:
    """SIGTERM every rank still running, SIGKILL those still there after GRACE_S; reap them all."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


# --------------------------------------------------------------------------- rank side
def _rank_main(fn, job_path: str, rank: int, world: int, env: dict, device: str, comm: str,
               compute: ComputeParams, threads: int, determinism: tuple[bool, bool], seed: int, parent: int,
               q) -> None:
    from agentkiln import lifecycle

    lifecycle.die_with_parent(signal.SIGTERM, parent)  # a SIGKILLed stage leaves no rank behind
    os.environ.update(env)
    try:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        if determinism[0]:
            torch.use_deterministic_algorithms(True, warn_only=determinism[1])
        if device == "cuda":
            torch.cuda.set_device(rank)
        dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
        _init_deepspeed(comm)
        r = Rank(rank, world, rank, dev, compute.model_copy(update={"device": str(dev)}), job_path, q)
        result = fn(r, r.job())
        if r.main:
            q.put(("done", result))
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent shows it and stops the other ranks)
        q.put(("error", rank, traceback.format_exc()))
        q.close()
        q.join_thread()
        os._exit(1)  # not sys.exit: no waiting on DeepSpeed's or gloo's threads for peers that are gone
    q.close()
    q.join_thread()
    # the work is done and said: skip the interpreter's teardown, where a native thread of DeepSpeed's
    # (seen with ZeRO-3 CPU offload) can abort the rank ("terminate called without an active
    # exception", SIGABRT) after its result is in, failing a run that succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init_deepspeed(comm: str) -> None:
    import logging
    import warnings

    import deepspeed
    import deepspeed.ops

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # torch 2.13 renamed the collectives ZeRO calls (all_gather_into_tensor, reduce_scatter_tensor):
    # a warning per rank per call is noise in the stage's log, and not ours to fix
    warnings.filterwarnings("ignore", message="`torch.distributed.[a-z_]+` is deprecated", category=FutureWarning)
    # TorchBackend builds this op whenever it is "compatible"; only inference_all_reduce uses it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=comm, auto_mpi_discovery=False, verbose=False)


class _Root(torch.nn.Module):
    """The module DeepSpeed wraps: `engine(fn, *args)` runs `fn(model, *args)`. Every forward enters
    through the engine (ZeRO-3 gathers each submodule's weights in hooks and traces their order from
    the root), while scoring keeps its own entry points (decoder + LM head at chosen positions)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def engine(rank: Rank, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
    """A DeepSpeed engine over `model` with the client `optimizer` (ZeRO shards its state), gradient
    clipping by the global norm, one micro-batch per step (the trainer splits minibatches itself)."""
    import deepspeed

    ds = rank.compute.deepspeed
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # no loss scaling by DeepSpeed: the trainer weights each rank's loss
        "train_batch_size": rank.world,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as the single-process trainer
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW: no DeepSpeedCPUAdam (a JIT build)
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    eng, *_ = deepspeed.initialize(model=_Root(model), optimizer=optimizer, config=config)
    return eng


def share(rows: list[int], rank: Rank) -> tuple[list[int], bool]:
    """This rank's rows of a minibatch (every world-th: minibatches are length-sorted, so shares
    balance). A rank left without a row runs the first one with zero weight: every rank must take
    part in every backward's gradient reduction."""
    mine = rows[rank.rank::rank.world]
    return (mine, True) if mine else (rows[:1], False)


def all_sum(values: list[float], rank: Rank) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=rank.device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def full_state_dict(rank: Rank, eng, model: torch.nn.Module) -> dict | None:
    """`model`'s full weights as a CPU state dict on rank 0 (None elsewhere); ZeRO-3 gathers the shards
    (every rank takes part)."""
    gather = contextlib.nullcontext()
    if rank.compute.deepspeed.zero_stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    with gather:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank.main else None


def optimizer_shards(rank: Rank, eng) -> list | None:
    """Every rank's ZeRO optimizer state (its shard of the fp32 master weights and AdamW moments), on
    rank 0 (None elsewhere): one checkpoint file, written by rank 0 alone."""
    out = [None] * rank.world if rank.main else None
    torch.distributed.gather_object(_cpu(eng.optimizer.state_dict()), out, dst=0)
    return out


def load_optimizer_shards(eng, shards: list) -> None:
    """Each rank takes its own shard back (same world size and ZeRO stage: the checkpoint key says so),
    fp32 master weights included."""
    eng.optimizer.load_state_dict(shards, load_from_fp32_weights=True)


class RankEngine:
    """One DeepSpeed rank as a training engine (trainers.engine): the model wrapped by `engine()`, its
    optimizer's state sharded by ZeRO, clipping by the global norm over every rank's gradient shard.
    One micro-batch per rank per step (ZeRO reduces gradients at every backward: ranks must run the
    same number of them)."""

    micro_batching = False

    def __init__(self, rank: Rank, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        self.ctx, self.model = rank, model  # the Rank this engine runs on
        self.world, self.rank, self.main = rank.world, rank.rank, rank.main
        self.ds = engine(rank, model, optimizer, max_grad_norm)

    def forward(self, fn: Callable, *args, **kwargs) -> Any:
        return self.ds(fn, *args, **kwargs)

    def zero_grad(self) -> None:
        pass  # the engine clears the gradients in its step

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> float:
        self.ds.step()  # clips by the global norm over every rank's gradient shard, then the optimizer
        return float(self.ds.get_global_grad_norm())

    def share(self, rows: list[int]) -> tuple[list[int], bool]:
        return share(rows, self.ctx)

    def all_sum(self, values: list[float]) -> list[float]:
        return all_sum(values, self.ctx)

    def broadcast(self, obj: Any) -> Any:
        self._device()
        msg = [obj if self.main else None]
        torch.distributed.broadcast_object_list(msg, src=0)
        return msg[0]

    def gather(self, obj: Any) -> list | None:
        self._device()
        out = [None] * self.world if self.main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def _device(self) -> None:
        # object collectives stage their bytes on the current CUDA device, which is per thread (rank 0's
        # synchronous rollouts call these from the rollout thread)
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def weights(self) -> dict | None:
        return full_state_dict(self.ctx, self.ds, self.model)

    def optimizer_state(self) -> list | None:
        return optimizer_shards(self.ctx, self.ds)

    def load_optimizer_state(self, state: list) -> None:
        load_optimizer_shards(self.ds, state)

    def log(self, metrics: dict, step: int) -> None:
        self.ctx.log(metrics, step)


class RankFactory:
    """This rank's engine factory (trainers.engine.EngineFactory); `engine`: the one it made, for what
    the rank does after the loop (its final weights)."""

    def __init__(self, rank: Rank):
        self.rank, self.engine = rank, None

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> RankEngine:
        self.engine = RankEngine(self.rank, model, optimizer, max_grad_norm)
        return self.engine
