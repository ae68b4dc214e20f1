"""The findings (params.yaml `findings`): each claim of a paper agentkiln implements is a pair of arms
at the same RL rollout budget over seeds. Every arm x seed the claims name runs once (cached under
reports/findings/runs/, so an interrupted run resumes and a new claim trains only its new arms), plays
every panel greedily, and reports/findings/findings.{md,json,png} say, per claim, the paired effect
b - a with its CI and whether it reproduced.

    dvc repro sft && python -m flows.findings     # needs data/tasks, models/base and models/sft
    python -m flows.findings --claims rl_from_base # these claims only (their arms): --publish then replaces
                                                  # those claims of the published ones, the others kept
    python -m flows.findings --publish            # copy the summary to docs/findings.{md,json}
"""

import argparse
import sys
from pathlib import Path

from prefect import flow

from agentkiln import paths, tracking
from agentkiln.config import Params
from agentkiln.evaluate.findings_report import publish
from agentkiln.stages import findings
from flows._stage import call_flow, needs, run_flow, stage_context

OUT = paths.REPORTS / "findings"
DOCS = Path("docs")


def out_dir(params: Params) -> Path:
    """reports/findings for the default recipe, reports/findings/<profile> for a profile's claims."""
    return OUT if params.findings.profile == "default" else OUT / params.findings.profile


@flow(name="findings", log_prints=True)
def findings_flow(params: Params, claims: list[str] | None = None) -> dict:
    with stage_context("findings", params, params.findings.model_dump()):
        out = out_dir(params)
        result = findings.run_findings(params, paths.TASKS, out, only=claims)
        for c in result["claims"]:
            tracking.log_metrics({f"{c['id']}/effect": c["diff"], f"{c['id']}/ci_low": c["ci_low"],
                                  f"{c['id']}/ci_high": c["ci_high"]})
        for name in ("findings.md", "findings.json", "findings.png"):
            tracking.log_artifact(out / name)
    print((out / "findings.md").read_text())
    return {c["id"]: c["verdict"] for c in result["claims"]}


def check(params: Params, claims: list[str] | None = None) -> None:
    """The inputs, before anything starts (params.yaml checked every arm at load)."""
    if claims:
        params = findings.only_claims(params, claims)
    needs(paths.TASKS / "rl", "synthesize")
    inits = {params.findings.arms[a].init for a in findings.arms_in_use(params)}
    if inits & {"sft", "scratch"}:
        needs(paths.SFT_MODEL, "sft")
    if "base" in inits or ("sft_arm" in inits and params.sft.model.source != "scratch"):
        needs(paths.BASE_MODEL, "base")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m flows.findings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--publish", action="store_true", help="no training: copy the last report's summary to docs/")
    mode.add_argument("--claims", type=lambda v: [x for x in v.split(",") if x], metavar="ID[,ID...]",
                      help="run these claims of params.yaml findings.claims only (default: all)")
    args = ap.parse_args()
    if args.publish:
        try:
            from agentkiln.config import load_params

            for path in publish(out_dir(load_params()), DOCS):
                print(f"wrote {path}")
        except (FileNotFoundError, ValueError) as e:
            print(f"agentkiln: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    run_flow(lambda params: call_flow(findings_flow, params=params, claims=args.claims),
             check=lambda params: check(params, args.claims))
