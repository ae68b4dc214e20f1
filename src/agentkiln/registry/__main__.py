"""The registry from the command line (the MLflow store of this project, or MLFLOW_TRACKING_URI):

    python -m agentkiln.registry show               # versions, aliases, lineage and scores
    python -m agentkiln.registry rollback           # champion <- previous (the demoted version is tagged rolled_back)

To play or evaluate the champion: python -m agentkiln.evaluate --model models:/agentkiln-policy@champion
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentkiln.registry", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["show", "rollback"])
    ap.add_argument("--name", default="agentkiln-policy", help="registered model name")
    args = ap.parse_args(argv)

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from agentkiln import tracking
    from agentkiln.registry import model_registry as mr

    store = tracking.default_store_path()
    if store is not None and not store.exists():  # do not create an empty store by looking at it
        print(f"agentkiln registry: no MLflow store at {store}: run the pipeline first (agentkiln run), "
              "or point MLFLOW_TRACKING_URI at your team's server", file=sys.stderr)
        return 1
    tracking.setup()
    try:
        if args.command == "rollback":
            demoted, restored = mr.rollback(args.name)
            print(f"{args.name}: champion is v{restored} again (v{demoted} tagged rolled_back); aliases {mr.aliases(args.name)}")
            return 0
        client = MlflowClient()
        aliases = mr.aliases(args.name)
        by_version: dict[str, list[str]] = {}
        for a, v in aliases.items():
            by_version.setdefault(v, []).append(a)
        print(f"{args.name} at {tracking.tracking_uri()}")
        for mv in sorted(client.search_model_versions(f"name='{args.name}'"), key=lambda m: int(m.version)):
            t = mv.tags
            print(f"  v{mv.version} [{', '.join(sorted(by_version.get(str(mv.version), []))) or '-'}] "
                  f"candidate={t.get('candidate', '?')} stage={t.get('stage', '?')} success={t.get('eval.success', '?')} "
                  f"panel={t.get('eval.panel', '?')} commit={t.get('lineage.git_commit', '?')[:12]} "
                  f"params={t.get('lineage.params_hash', '?')}{' rolled_back' if t.get('rolled_back') else ''}")
        return 0
    except (RuntimeError, MlflowException) as e:
        print(f"agentkiln registry: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
