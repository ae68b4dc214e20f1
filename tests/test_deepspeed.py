"""DeepSpeed ranks for real (compute.backend: deepspeed): 2 ZeRO-2 processes over gloo on the CPU,
launched by the SFT stage itself; no mocks.

- The data-parallel SFT run gives the single-process trainer's per-epoch loss curve (every rank takes
  its share of each minibatch, its loss weighted so the averaged gradient is the minibatch's): same
  minibatches, same clipping, schedule and AdamW, to float rounding (REL_TOL, measured ~1e-7).
- It is SIGTERMed after its first checkpoint (as a stage under DVC: `lifecycle.handle_signals`):
  the stage and every rank are gone; run again, it resumes after that epoch and ends on the curve.
- Rank 0 alone logs (one row per epoch), writes the checkpoint and the model; the model loads and
  has the single-process run's weights (to WEIGHT_TOL).
- A rank that raises stops the stage with that rank's traceback, its peer (stuck in a collective)
  stopped too.
- RL on ranks (GRPO, 2 iterations, KL to a frozen reference): rank 0 plays the rollouts (spread off) and broadcasts
  the batch, each rank takes its share of each minibatch; every rollout metric equals the single
  process's, the update metrics (loss, KL, entropy, grad norm) follow it to RL_REL_TOL (measured
  8e-7), the saved model loads with the single run's weights; PPO / ZeRO-3 refused by name.
  Rollouts spread over the ranks (each plays its chunks of a round) give the curve of one process
  playing the same chunks, and ranks resume from rank 0's checkpoint after iteration 1 onto it (slow,
  ~45 s).

Timings on 2 cores: each launch ~10 s (two interpreters importing torch + deepspeed), 20-45 s while
the machine is busy; the whole file ~55 s idle. Nothing is JIT-compiled (trainers.distributed keeps
DeepSpeed from building its shm comm op, ~2.7 min otherwise).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

MIX = {"frozenlake_easy": 1.0}
MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vocab_size": 400,
         "max_context": 1024}
# 7 episodes in minibatches of 3: shares of 2+1 rows, and a 1-row minibatch where rank 1 idles (clean
# walkthroughs only: recovery episodes would change the count)
SFT = {"epochs": 3, "batch_size": 3, "warmup_steps": 2, "lr": 0.01, "model": MODEL,
       "data": {"clean": 1.0, "recovery": 0.0}}
REL_TOL = 1e-5  # per-epoch loss, relative (fp32; summation order differs between 1 and 2 processes)
WEIGHT_TOL = 1e-4  # final weights, max |difference|

RUNNER = """
import sys
from pathlib import Path
from agentkiln import lifecycle
from agentkiln.config import load_params
from agentkiln.seeding import seed_everything
from agentkiln.stages.sft import run_sft
lifecycle.handle_signals()  # as a flow does: SIGTERM raises Terminated in the main thread
root, params_file = Path(sys.argv[1]), sys.argv[2]
params = load_params(params_file)
seed_everything(params.seed, params.torch_threads)
run_sft(params, root / "tasks", root / "killed" / "model", ckpt_dir=root / "killed" / "ckpt")
print("FINISHED")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_params(port: int, **over):
    from tests.conftest import params_with

    return params_with({"torch_threads": 2, "sft": SFT,
                        "compute": {"device": "cpu", "backend": "deepspeed",
                                    "deepspeed": {"num_procs": 2, "zero_stage": 2, "master_port": port, **over}}})


def sft(params, root: Path, out: Path, ckpt: Path | None = None) -> tuple[dict, list[dict]]:
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.sft import run_sft

    rows = []
    seed_everything(params.seed, params.torch_threads)
    metrics = run_sft(params, root / "tasks", out, log=lambda row, step: rows.append({"step": step, **row}),
                      ckpt_dir=ckpt)
    return metrics, rows


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny frozenlake splits and the single-process SFT run (its metrics, log rows, saved model)."""
    from tests.conftest import params_with, tiny_dataset

    root = tmp_path_factory.mktemp("ds")
    tiny_dataset(root / "tasks", {"sft": MIX, "rl": MIX, "test": MIX}, n={"sft": 7, "rl": 2, "test": 2})
    metrics, rows = sft(params_with({"torch_threads": 2, "sft": SFT}), root, root / "single")
    return root, metrics, rows


def alive(pids: list[int]) -> list[int]:
    from agentkiln.lifecycle import _stat

    return [p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"]


def test_zero2_ranks_follow_the_single_process_curve_resume_after_sigterm_and_rank0_alone_writes(world, tmp_path,
                                                                                                  capfd):
    from agentkiln.lifecycle import children
    from agentkiln.policy import load_policy

    root, want, want_rows = world
    params = ds_params(free_port())
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))

    # the stage, for real, SIGTERMed while rank 0 pauses after writing the first epoch's checkpoint
    killed = root / "killed"
    log = tmp_path / "killed.log"
    env = os.environ | {"AGENTKILN_PAUSE_AFTER_CHECKPOINT": "120", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])])}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(root), str(params_file)], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    while "pausing" not in log.read_text() and proc.poll() is None and time.monotonic() - t0 < 240:
        time.sleep(0.1)
    ranks = children(proc.pid)
    assert proc.poll() is None and len(ranks) >= 2, log.read_text()[-3000:]  # 2 ranks (+ mp's resource tracker)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    out = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM and "FINISHED" not in out, out[-3000:]
    deadline = time.monotonic() + 10
    while alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(ranks), f"ranks outlived the stage: {alive(ranks)}"
    ckpt = killed / "ckpt"
    assert (ckpt / "state.pt").is_file() and not (killed / "model").exists()
    print(f"killed run: {time.monotonic() - t0:.1f} s")

    # run again (another port: it is not part of the run's identity): resumes after epoch 1
    t0 = time.monotonic()
    params = ds_params(free_port())
    got, rows = sft(params, root, killed / "model", ckpt)
    printed = capfd.readouterr().out
    assert f"sft: resumed from {ckpt} after epoch 1" in printed, printed[-3000:]
    assert not ckpt.exists()  # removed once the model (rank 0 saves it) and every output are written
    print(f"resumed run: {time.monotonic() - t0:.1f} s")

    # one row per epoch: rank 0 alone logs (the resumed run logs the checkpoint's epoch 1 again)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["step"] for r in want_rows] == [1, 2, 3]
    rel = max(abs(a["sft/loss"] - b["sft/loss"]) / b["sft/loss"] for a, b in zip(rows, want_rows))
    print(f"max relative per-epoch loss difference, 2-rank ZeRO-2 vs single: {rel:.2e}")
    assert rel < REL_TOL, (rows, want_rows)
    assert all(abs(a["sft/token_acc"] - b["sft/token_acc"]) < 1e-9 and a["sft/lr"] == pytest.approx(b["sft/lr"])
               for a, b in zip(rows, want_rows))
    assert got["n_params"] == want["n_params"] and got["n_episodes"] == want["n_episodes"] == 7
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=REL_TOL)

    # the model rank 0 saved loads (its manifest checks every file) and has the single run's weights
    model_dir = killed / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in (root / "single").iterdir())
    a, b = load_policy(model_dir).model.state_dict(), load_policy(root / "single").model.state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    print(f"max |weight difference|: {diff:.2e}")
    assert diff < WEIGHT_TOL


# big enough that ZeRO-3 really shards weights: the tied embedding / LM head (373 x 288) and the MLP
# are over DeepSpeed's persistence threshold (1e5 elements); smaller ones stay whole on every rank
WIDE = MODEL | {"hidden_size": 288, "intermediate_size": 576}
REL_TOL_WIDE = 1e-4  # its steps move the loss more, so rounding differences grow (measured 5e-6 .. 1e-5)


@pytest.mark.slow
def test_zero3_with_cpu_offload_follows_the_single_process_curve(world, tmp_path):
    from agentkiln.policy import load_policy
    from tests.conftest import params_with

    root = world[0]
    wide = {"torch_threads": 2, "sft": SFT | {"model": WIDE}}
    _, want = sft(params_with(wide), root, tmp_path / "single")
    params = ds_params(free_port(), zero_stage=3, offload_optimizer=True, offload_params=True)
    t0 = time.monotonic()
    _, rows = sft(params.model_copy(update={"sft": params_with(wide).sft}), root, tmp_path / "ds")
    print(f"ZeRO-3 + offload run: {time.monotonic() - t0:.1f} s")
    assert [r["step"] for r in rows] == [1, 2, 3]
    rel = max(abs(a["sft/loss"] - b["sft/loss"]) / b["sft/loss"] for a, b in zip(rows, want))
    print(f"max relative per-epoch loss difference, 2-rank ZeRO-3 + offload vs single: {rel:.2e}")
    assert rel < REL_TOL_WIDE, (rows, want)
    # rank 0 gathered the sharded weights into a whole model
    a, b = load_policy(tmp_path / "ds").model.state_dict(), load_policy(tmp_path / "single").model.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in b)


def _rank1_fails(rank, job):
    """A job whose rank 1 raises while rank 0 waits for it in a collective."""
    if rank.rank == 1:
        raise ValueError(f"boom on rank {rank.rank}: {job}")
    torch.distributed.barrier()


def test_a_failing_rank_stops_the_stage_with_its_traceback():
    from agentkiln.config import ComputeParams
    from agentkiln.lifecycle import children
    from agentkiln.trainers.distributed import RankError, launch

    compute = ComputeParams(device="cpu", backend="deepspeed", deepspeed={"num_procs": 2, "master_port": free_port()})
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(_rank1_fails, "the job", compute)
    msg = str(err.value)
    assert "deepspeed rank 1 of 2 failed" in msg and "ValueError: boom on rank 1: the job" in msg
    assert "in _rank1_fails" in msg  # the rank's own traceback
    assert not [p for p in children() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    print(f"failure surfaced in {time.monotonic() - t0:.1f} s")


def test_settings_this_machine_cannot_honour_stop_the_run_by_name():
    from agentkiln.config import ComputeParams
    from agentkiln.trainers.distributed import plan

    def compute(**kw):
        return ComputeParams(backend="deepspeed", **kw)

    with pytest.raises(ValueError, match="comm_backend = nccl needs CUDA ranks"):
        plan(compute(device="cpu", deepspeed={"comm_backend": "nccl"}))
    with pytest.raises(ValueError, match="offload_params = true needs zero_stage 3"):
        plan(compute(device="cpu", deepspeed={"offload_params": True}))
    with pytest.raises(ValueError, match="compute.device = cuda:1 .*num_procs = 2"):
        plan(compute(device="cuda:1"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="compute.device = cuda: torch sees no CUDA device"):
            plan(compute(device="cuda"))
    else:
        with pytest.raises(ValueError, match="num_procs = 4096: one rank per GPU"):
            plan(compute(device="cuda", deepspeed={"num_procs": 4096}))
    assert plan(compute(device="cpu")) == ("cpu", "gloo")


# --------------------------------------------------------------------------- RL on ranks (issue 14, part 3)
# GRPO from the single-process SFT model: 2 tasks x 4 episodes, KL to a frozen reference, entropy
# bonus, penalties so the groups' rewards vary; minibatches of 7 rows, so the 8-row batch of
# iteration 1 leaves a 1-row minibatch where rank 1 joins the reduction with a zero-weight row
RL = {"defaults": {"algorithm": "grpo", "iterations": 2, "episode_budget": None, "tasks_per_iter": 2, "group_size": 4,
                   "max_turns": 6, "minibatch_size": 7, "micro_batch_size": None, "kl_coef": 0.05,
                   "entropy_coef": 0.01, "reward": {"truncation": {"weight": 0.5}, "invalid": {"weight": 0.1}},
                   "checkpoint_every": 1, "select": {"panel": None}},  # ranks train the last weights
      "stages": {"s1": {"init": "sft"}}}
RL_REL_TOL = 1e-5  # per-iteration loss / KL / entropy / grad norm, relative (measured <= 8e-7)
# ...to at least 0.01: the KL (~2e-4 here) is a mean of differences of log-probs of order 1, whose fp32
# rounding is absolute (8e-9 measured: 4e-5 of the KL itself)
FLOOR = 1e-2


def rl(params, root: Path, out: Path, ckpt: Path | None = None) -> tuple[dict, list[dict]]:
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.rl import run_rl

    rows = []
    seed_everything(params.seed, params.torch_threads)
    metrics = run_rl(params, "s1", root / "tasks", root / "single", out / "model", out / "reports",
                     ckpt_dir=ckpt, log=lambda row, step: rows.append({"step": step, **row}))
    return metrics, rows


@pytest.mark.parametrize("staleness", [0, 1])
def test_rl_on_zero2_ranks_follows_the_single_process_curve_and_rank0_saves(world, tmp_path, staleness):
    """Synchronous, and asynchronous (staleness 1: rank 0's next rollouts play on a snapshot while the
    ranks train; both iterations then play the starting weights, so the rollouts match exactly)."""
    from agentkiln.policy import load_policy
    from tests.conftest import params_with

    root = world[0]
    rl_params = copy.deepcopy(RL)
    rl_params["stages"]["s1"]["asynchronous"] = {"max_staleness": staleness}
    want, want_rows = rl(params_with({"torch_threads": 2, "sft": SFT, "rl": rl_params}), root, tmp_path / "single")
    # rank 0 plays every rollout here (the spread rounds: the resume test below)
    params = ds_params(free_port(), spread_rollouts=False).model_copy(update={"rl": params_with({"rl": rl_params}).rl})
    t0 = time.monotonic()
    got, rows = rl(params, root, tmp_path / "ds", tmp_path / "ckpt")
    print(f"2-rank RL run: {time.monotonic() - t0:.1f} s")

    # rank 0 alone logs, one row per iteration; both iterations trained
    assert [r["step"] for r in rows] == [1, 2] == [r["step"] for r in want_rows]
    assert all(r["rl/trained_tokens"] > 0 for r in want_rows)
    # the rollouts (rank 0's, same seeds) and the batch are the single process's: metrics equal
    update_keys = {"rl/loss", "rl/pg_loss", "rl/kl", "rl/entropy", "rl/grad_norm", "rl/ratio_mean", "rl/clip_frac"}
    # asynchronous: iteration 2's stale rollouts are re-scored under the weights updated once (float rounding)
    update_keys |= {k for k in want_rows[0] if k.startswith("rl/mismatch/") and k != "rl/mismatch/alarm"}
    for a, b in zip(rows, want_rows):
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if k not in update_keys} == {k: v for k, v in b.items() if k not in update_keys}
    assert [r["rl/async/staleness"] for r in rows] == ([0, 1] if staleness else [0, 0])
    rel = max(abs(a[k] - b[k]) / max(abs(b[k]), FLOOR) for a, b in zip(rows, want_rows) for k in update_keys)
    print(f"max relative per-iteration update-metric difference, 2-rank ZeRO-2 vs single: {rel:.2e}")
    assert rel < RL_REL_TOL, (rows, want_rows)
    assert {k: v for k, v in got.items()} == want
    assert not (tmp_path / "ckpt").exists()  # written every iteration by rank 0, removed once the model is saved
    curve = (tmp_path / "ds" / "reports" / "curve.csv").read_text().splitlines()
    assert curve[0] == (tmp_path / "single" / "reports" / "curve.csv").read_text().splitlines()[0] and len(curve) == 3

    # the model rank 0 saved loads and has the single run's weights
    a, b = load_policy(tmp_path / "ds" / "model").model.state_dict(), load_policy(tmp_path / "single" / "model").model.state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    print(f"max |weight difference|: {diff:.2e}")
    assert diff < WEIGHT_TOL


def test_rl_on_ranks_refuses_what_it_does_not_do_by_name():
    from agentkiln.config import ComputeParams, RLParams
    from agentkiln.trainers.rl import check_ranks, spreads

    compute = ComputeParams(device="cpu", backend="deepspeed")
    check_ranks(RLParams(algorithm="grpo"), compute)
    with pytest.raises(ValueError, match="algorithm = ppo with compute.backend = deepspeed"):
        check_ranks(RLParams(algorithm="ppo"), compute)
    with pytest.raises(ValueError, match="zero_stage = 3"):
        check_ranks(RLParams(), ComputeParams(device="cpu", backend="deepspeed", deepspeed={"zero_stage": 3}))
    # rank 0 plays the rollouts on either backend, synchronous or not (tests/test_vllm_rollout.py: vLLM)
    check_ranks(RLParams(asynchronous={"max_staleness": 1}),
                ComputeParams(device="cpu", backend="deepspeed", rollout={"backend": "vllm"}))
    # every rank plays its chunks of synchronous rounds and asynchronous flights on the in-process
    # engine; otherwise rank 0 plays
    ranks = ComputeParams(device="cpu", backend="deepspeed")
    assert spreads(RLParams(), ranks)
    assert spreads(RLParams(asynchronous={"max_staleness": 1}), ranks)
    assert not spreads(RLParams(), ComputeParams(device="cpu", backend="deepspeed", rollout={"backend": "vllm"}))
    assert not spreads(RLParams(), ComputeParams(device="cpu", backend="deepspeed", deepspeed={"spread_rollouts": False}))


@pytest.mark.slow
def test_rl_ranks_spread_rollouts_resume_from_rank0s_checkpoint_onto_the_single_process_curve(world, tmp_path):
    """Rollouts spread over the ranks (rollout_batch 4: each round is 2 chunks of one task's group,
    one per rank), ranks stopped after iteration 1 (a run of 1 iteration: its checkpoint stays, the
    stage is not there to remove it), then ranks of the 2-iteration run under the same checkpoint key:
    they resume after iteration 1 (weights, optimizer shards, task sampler, minibatch generator) and end
    on the curve of one process that plays the same chunks itself (trainers.rank_rounds)."""
    from agentkiln.policy import load_policy
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.common import load_split
    from agentkiln.trainers import distributed
    from agentkiln.trainers.rl import rl_rank, train_rl
    from tests.conftest import params_with

    root = world[0]
    single = params_with({"torch_threads": 2, "sft": SFT, "rl": RL, "seed": 3})  # seed 3: both iterations train
    p = single.rl.stage("s1").model_copy(update={"rollout_batch": 4})
    pool = load_split(root / "tasks", "rl")
    seed_everything(single.seed, single.torch_threads)
    policy = load_policy(root / "single", compute=single.compute)
    want = train_rl(policy, load_policy(root / "single", compute=single.compute), pool, root / "tasks", p,
                    seed=single.seed, spread=True)

    def ranks(iterations: int) -> tuple[dict, list[dict]]:
        params = ds_params(free_port())
        compute = distributed.parent_compute(params.compute)
        seed_everything(single.seed, params.torch_threads)
        job = {"policy": load_policy(root / "single", compute=compute),
               "ref": load_policy(root / "single", compute=compute), "pool": pool, "tasks_dir": root / "tasks",
               "p": p.model_copy(update={"iterations": iterations}), "seed": single.seed,
               "out_dir": tmp_path / f"model{iterations}", "ckpt_dir": tmp_path / "ckpt", "ckpt_key": "same run",
               "desc": "after"}
        rows: list[dict] = []
        done = distributed.launch(rl_rank, job, params.compute, log=lambda row, step: rows.append({"step": step}))
        return done, rows

    ranks(1)
    assert (tmp_path / "ckpt" / "state.pt").is_file()
    done, rows = ranks(2)
    assert [r["step"] for r in rows] == [1, 2]  # the checkpoint's iteration logged again, then iteration 2
    got = done["history"]
    assert [r["iteration"] for r in got] == [1, 2]
    # both ranks played (one process: itself alone), every other rollout metric is the one process's
    assert [r["rollout/ranks_playing"] for r in got] == [2, 2] and [r["rollout/ranks_playing"] for r in want] == [1, 1]
    assert all(r["trained_tokens"] > 0 for r in want)
    keys = {"loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean", "clip_frac"}
    for a, b in zip(got, want):
        same = lambda row: {k: v for k, v in row.items() if k not in keys | {"rollout/ranks_playing"}}  # noqa: E731
        assert same(a) == same(b)
    rel = max(abs(a[k] - b[k]) / max(abs(b[k]), FLOOR) for a, b in zip(got, want) for k in keys)
    print(f"resumed 2-rank RL vs single, max relative update-metric difference: {rel:.2e}")
    assert rel < RL_REL_TOL


# the rollout process's case runs by default; the in-rank flights are `slow` (test_async_rl covers staleness 2)
@pytest.mark.parametrize("processes, staleness", [pytest.param(0, 1, marks=pytest.mark.slow), (1, 1),
                                                  pytest.param(0, 2, marks=pytest.mark.slow)])
def test_rl_ranks_share_asynchronous_flights_onto_the_single_process_curve(world, tmp_path, processes, staleness):
    """Asynchronous, chunks of one group (2 per flight): each flight launched ahead (iteration 2's while
    iteration 1 trains; at staleness 2, iterations 2 and 3 on the same snapshot) is shared once an update
    is done (trainers.inflight.RankFlights): rank 1 snapshots its weights on receiving the flight, and
    plays the chunks rank 0 reserves for it out of those its rollout processes have not claimed (an
    equal part per player). Without a rollout process every chunk is unclaimed then: rank 1 plays chunk
    1, rank 0's trainer chunk 0; with one, the share depends on timing. Either way the chunks and seeds
    are one process's, so every rollout metric is one process's; iteration 1's flight (launched for
    itself) is rank 0's."""
    from agentkiln.policy import load_policy
    from agentkiln.seeding import seed_everything
    from agentkiln.stages.common import load_split
    from agentkiln.trainers import distributed
    from agentkiln.trainers.rl import rl_rank, train_rl
    from tests.conftest import params_with

    root = world[0]
    single = params_with({"torch_threads": 2, "sft": SFT, "rl": RL, "seed": 3})
    base = single.rl.stage("s1")
    p = base.model_copy(update={"iterations": 1 + staleness, "asynchronous": base.asynchronous.model_copy(
        update={"max_staleness": staleness, "chunk_episodes": 4, "processes": processes})})
    pool = load_split(root / "tasks", "rl")
    seed_everything(single.seed, single.torch_threads)
    want = train_rl(load_policy(root / "single", compute=single.compute),
                    load_policy(root / "single", compute=single.compute), pool, root / "tasks", p,
                    seed=single.seed, spread=True)

    params = ds_params(free_port())
    compute = distributed.parent_compute(params.compute)
    seed_everything(single.seed, params.torch_threads)
    job = {"policy": load_policy(root / "single", compute=compute),
           "ref": load_policy(root / "single", compute=compute), "pool": pool, "tasks_dir": root / "tasks",
           "p": p, "seed": single.seed, "out_dir": tmp_path / "model", "ckpt_dir": None, "ckpt_key": "",
           "desc": "after"}
    got = distributed.launch(rl_rank, job, params.compute)["history"]
    # staleness 2: iterations 2 and 3 were launched at iteration 1's start, on the starting weights
    assert [r["iteration"] for r in got] == list(range(1, staleness + 2))
    assert [r["async/staleness"] for r in got] == list(range(staleness + 1))
    # one process plays every chunk itself; on ranks the flights launched ahead were shared (always
    # without a rollout process, which would otherwise have claimed chunks while the ranks trained)
    assert [r["rollout/ranks_playing"] for r in want] == [1] * (staleness + 1)
    assert got[0]["rollout/ranks_playing"] == 1
    assert all(r["rollout/ranks_playing"] in ([2] if not processes else [1, 2]) for r in got[1:])
    assert all(r["trained_tokens"] > 0 for r in want)
    keys = {"loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean", "clip_frac"}
    keys |= {k for k in want[0] if k.startswith("mismatch/") and k != "mismatch/alarm"}
    for a, b in zip(got, want):
        same = lambda row: {k: v for k, v in row.items() if k not in keys | {"rollout/ranks_playing"}}  # noqa: E731
        assert same(a) == same(b)
    rel = max(abs(a[k] - b[k]) / max(abs(b[k]), FLOOR) for a, b in zip(got, want) for k in keys if k in b)
    print(f"2-rank shared asynchronous RL vs single, max relative update-metric difference: {rel:.2e}")
    assert rel < RL_REL_TOL
