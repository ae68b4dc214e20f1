"""Stage `rl@<stage>`: one entry of params.yaml's rl.stages (algorithm, horizon, lr, KL, iterations),
starting from its `init` model. `python -m flows.rl --stage NAME`; without --stage, every stage in order."""

import argparse

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.collected import split_digest
from agentkiln.config import Params
from agentkiln.registry.model_registry import log_policy
from agentkiln.stages.rl import stage_dirs
from flows._stage import call_flow, needs, publish, run_flow, stage_context, write_json
from tasks.rl import rl_task


@flow(name="rl", log_prints=True)
def rl_flow(params: Params, stage: str | None = None) -> dict:
    results = {}
    for name in [stage] if stage else list(params.rl.stages):
        dirs = stage_dirs(params, name)

        def outputs(metrics: dict, name=name, dirs=dirs) -> None:  # before the stage removes its checkpoint
            tracking.log_metrics(metrics)
            tracking.log_artifact(dirs["reports_dir"] / "curve.csv")
            tracking.log_artifact(dirs["reports_dir"] / "trajectories.html")
            write_json(dirs["reports_dir"] / "metrics.json", metrics)
            tracking.log_split(paths.TASKS / "rl")
            if offline := params.rl.stage(name).offline.split:
                tracking.log_collected(offline, split_digest(offline))
            log_policy(dirs["out_dir"])
            publish(f"rl-{name}", metrics)

        with stage_context(f"rl-{name}", params, params.rl.stage(name).model_dump()):
            metrics = rl_task(params, name, paths.TASKS, log=tracking.log_metrics, log_episodes=tracking.log_episodes,
                              outputs=outputs, **dirs)
        print(f"RL stage {name} ({metrics['algorithm']}): pool success "
              f"{metrics['pool_success_before']:.3f} -> {metrics['pool_success_after']:.3f}")
        if "selected_iteration" in metrics:
            print(f"RL stage {name}: saved the weights of iteration {metrics['selected_iteration']} of "
                  f"{metrics['iterations']} ({metrics['select_panel']} {metrics['select_success_start']:.3f} at the "
                  f"start, {metrics['select_success_selected']:.3f} kept, {metrics['select_success_last']:.3f} last)")
        results[name] = metrics
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default=None, help="one of params.yaml's rl.stages (default: all, in order)")
    args = ap.parse_args()
    def check(params: Params) -> None:  # an unknown stage name or a missing starting model: exit 2
        init = params.rl.stage(args.stage or next(iter(params.rl.stages))).init
        needs(paths.model_dir(init), "sft" if init == "sft" else init.replace("/", "@"))

    run_flow(lambda params: call_flow(rl_flow, params=params, stage=args.stage), check=check)
