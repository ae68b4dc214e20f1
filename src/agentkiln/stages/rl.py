"""One RL stage: start from its `init` model (which is also its KL reference), train on the RL pool,
save the model, the per-iteration curve and the pool's greedy success before and after. With
`select.panel` (trainers.select) the model saved is the best the stage played on that panel, family
by family no worse than its start, not its last weights; the metrics say which iteration it is.

A killed stage resumes from its last checkpoint (models/checkpoints/rl/<stage>) when run again with
the same params, starting model and pool; the checkpoint is removed once every output is written (the
model, the curve, then `outputs`: reports and MLflow logging), never before.

With `compute.backend: deepspeed` the stage launches `compute.deepspeed.num_procs` data-parallel
ZeRO-2 ranks (trainers.distributed, trainers.rl.rl_rank: the same loop over a rank's engine): every
rank plays its chunks of a synchronous round (trainers.rank_rounds), or rank 0 plays them (asynchronous,
vLLM, or `spread_rollouts: false`); rank 0 broadcasts each iteration's batch, every rank trains on its
share of each minibatch; rank 0 relays the metrics, writes the checkpoints, measures the pool after
and saves the model (LoRA merged). PPO (critic) and ZeRO-3 are refused on ranks, naming the setting.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

from agentkiln import fanout, paths
from agentkiln.config import Params
from agentkiln.evaluate import trajectories
from agentkiln.evaluate.agents import policy_agent
from agentkiln.policy import load_policy, lora, save_policy
from agentkiln.rollout.backends import open_rollout
from agentkiln.stages.common import load_split
from agentkiln.trainers import checkpoint, distributed, episode_log
from agentkiln.trainers.select import Selector
from agentkiln.trainers.rl import POOL_PROBE, check_ranks, greedy_success, rl_rank, train_rl


def write_curve(history: list[dict], curve_csv: Path) -> None:
    curve_csv.parent.mkdir(parents=True, exist_ok=True)
    with curve_csv.open("w", newline="") as f:
        cols = sorted({k for row in history for k in row} - {"iteration"})
        w = csv.DictWriter(f, fieldnames=["iteration", *cols])
        w.writeheader()
        for row in history:
            w.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})


EPISODES = "episodes.jsonl"  # every iteration's logged episodes (trainers.episode_log), one JSON object per line
VIEWER = "trajectories.html"  # the first and last iterations' episodes with their advantages


def episode_logger(path: Path, forward: Callable[[int, list[dict]], None] | None = None):
    """`log_episodes` for train_rl: each iteration's sample appended to `path` as {"iteration",
    "episodes"} (an iteration played again after a resume replaces its line and every later one),
    then passed on to `forward` (MLflow)."""
    def log(it: int, sample: list[dict]) -> None:
        lines = path.read_text().splitlines() if path.is_file() else []
        kept = [line for line in lines if json.loads(line)["iteration"] < it]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in kept) + json.dumps({"iteration": it, "episodes": sample}) + "\n")
        if forward is not None:
            forward(it, sample)
    return log


def write_viewer(episodes_file: Path, out: Path, stage: str) -> None:
    """The stage's trajectory page: its first and last iterations' logged episodes, each reply with
    the advantage it was trained with (none logged: the page says so)."""
    blocks = [json.loads(line) for line in episodes_file.read_text().splitlines()] if episodes_file.is_file() else []
    shown = {f"iteration {b['iteration']}": [episode_log.episode(r) for r in b["episodes"]]
             for b in (blocks[:1] + blocks[-1:] if len(blocks) > 1 else blocks)}
    title = f"rl {stage}: training episodes with their advantages"
    if not shown:
        title += " (none logged: rl.log_episodes is 0, or the stage ran on DeepSpeed ranks)"
    trajectories.write(shown, out, title)


@fanout.in_session
def run_rl(params: Params, stage: str, tasks_dir: Path, init_dir: Path, out_dir: Path, reports_dir: Path,
           ckpt_dir: Path | None = None, log=None, outputs: Callable[[dict], object] | None = None,
           log_episodes=None) -> dict:
    """Train RL stage `stage`; save its model to `out_dir`, and its curve, logged episodes (EPISODES) and
    their trajectory page (VIEWER) to `reports_dir`; its metrics.
    `outputs(metrics)` writes the stage's other outputs (the flow's reports and MLflow logging) before
    the checkpoint is removed (checkpoint.finish)."""
    p = params.rl.stage(stage)
    pool = load_split(tasks_dir, "rl")  # first: a damaged split (a truncated game) stops the stage before any work
    ranks = params.compute.backend == "deepspeed"
    if ranks:  # a setting this machine or RL on ranks cannot honour stops the run before any work
        distributed.plan(params.compute)
        check_ranks(p, params.compute)
    compute = distributed.parent_compute(params.compute) if ranks else params.compute
    policy = load_policy(init_dir, compute=compute)
    # the KL reference: a frozen copy, or with LoRA the policy itself with its adapters off
    ref = load_policy(init_dir, compute=compute) if p.kl_coef > 0 and not p.lora.enabled else None
    # the rendezvous port does not change what a run computes: a resumed run may use another one
    compute_key = params.compute.model_dump(exclude={"deepspeed": {"master_port"}} if ranks else None)
    key = checkpoint.fingerprint(stage, p.model_dump(), compute_key, params.seed,
                                 [t.task_id for t in pool], files=[init_dir])
    before = greedy_success(policy, pool, tasks_dir, p, f"rl {stage}: pool (before)")
    select = None
    if p.select.panel is not None:  # played as the evaluate stage plays it: greedy, its decoding settings
        select = Selector(p.select, load_split(tasks_dir, p.select.panel), tasks_dir, params.evaluate.max_turns,
                          lambda pol: policy_agent(pol, params.evaluate, greedy=True))
    episodes_file = Path(reports_dir) / EPISODES
    episodes_file.unlink(missing_ok=True)  # a resumed run writes its checkpoint's episodes again
    if p.lora.enabled:
        lora.add_lora(policy, p.lora, seed=params.seed)
    if ranks:
        job = {"policy": policy, "ref": ref, "pool": pool, "tasks_dir": Path(tasks_dir), "p": p, "seed": params.seed,
               "out_dir": Path(out_dir), "ckpt_dir": ckpt_dir and Path(ckpt_dir), "ckpt_key": key,
               "desc": f"rl {stage}: pool (after)"}
        done = distributed.launch(rl_rank, job, params.compute, log=log)
        history, after, merged = done["history"], done["after"], done["merged"]
    else:
        with open_rollout(policy, params.compute, seed=params.seed, lora=p.lora.enabled) as rollout:
            history = train_rl(policy, ref, pool, tasks_dir, p, seed=params.seed, log=log, ckpt_dir=ckpt_dir,
                               ckpt_key=key, rollout=rollout,
                               log_episodes=episode_logger(episodes_file, log_episodes), select=select)
        after = greedy_success(policy, pool, tasks_dir, p, f"rl {stage}: pool (after)")
        merged = None
        if lora.has_lora(policy):
            merged = lora.merge(policy, out_dir)
        save_policy(policy, out_dir)
    write_curve(history, reports_dir / "curve.csv")
    write_viewer(episodes_file, Path(reports_dir) / VIEWER, stage)
    return checkpoint.finish({
        "stage": stage,
        "algorithm": p.algorithm,
        "init": p.init,
        "max_turns": p.max_turns,
        "pool_success_before": before,
        "pool_success_after": after,
        "pool_size": len(pool),
        "pool_probe_tasks": min(POOL_PROBE, len(pool)),  # pool_success_* are measured on these
        "iterations": len(history),
        "episodes": history[-1]["episodes"] if history else 0,
        **({f"lora_{k}": v for k, v in merged.items()} if merged else {}),
        **(select.report() if select is not None else {}),
    }, ckpt_dir, outputs)


def stage_dirs(params: Params, stage: str) -> dict[str, Path]:
    """Where stage `stage` reads and writes (mirrors dvc.yaml's foreach entry)."""
    p = params.rl.stage(stage)
    return {"init_dir": paths.model_dir(p.init), "out_dir": paths.RL_MODELS / stage,
            "reports_dir": paths.rl_reports(stage), "ckpt_dir": paths.CHECKPOINTS / "rl" / stage}
