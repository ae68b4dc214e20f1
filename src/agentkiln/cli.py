"""`agentkiln`: one command line over the pipeline, the registry and the UIs.

    agentkiln run [-S sft.epochs=2]          the pipeline (dvc repro / dvc exp run -S, then promotion)
    agentkiln stage rl@main                  one DVC stage and what it needs
    agentkiln eval --model sft --panel ood   evaluate any policy on a frozen panel
    agentkiln play --family sokoban          watch an episode in the terminal
    agentkiln findings [--publish]           reproduce the papers' claims (params.yaml findings; --claims:
                                             some of them)
    agentkiln promote | rollback | registry  the model registry
    agentkiln serve --cron "0 3 * * *"       the pipeline on a schedule (Prefect)
    agentkiln ui                             MLflow and Prefect servers on loopback
    agentkiln endpoint --model models:/agentkiln-policy@champion
                                             the policy behind an OpenAI-compatible API
    agentkiln collect DIR --name NAME        recorded episodes -> a versioned training split
    agentkiln doctor                         is this machine ready?

Commands that run a flow run `python -m flows.<name>` in the project (the nearest directory above
the current one holding dvc.yaml), so `python -m flows.X` and `agentkiln` stay one code path. Heavy
libraries (torch, mlflow, prefect) are imported inside the command that needs them, so `--help` and
every usage error answer at once and touch nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from agentkiln.config import PARAMS_FILE, ParamsError, load_params
from agentkiln.paths import repo_root
from agentkiln.serving.limits import OPTION, Limits

app = typer.Typer(name="agentkiln", help=__doc__.split("\n\n")[0] + "\n\nSettings live in params.yaml.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)
registry_app = typer.Typer(help="The MLflow model registry: versions, aliases, lineage, scores.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"agentkiln: {message}", err=True)
    raise typer.Exit(code)


def project() -> Path:
    root = repo_root()
    if not (root / "dvc.yaml").is_file():
        fail(f"{Path.cwd()}: not inside an agentkiln project (no dvc.yaml above it); cd into your clone")
    return root


def run_module(module: str, *args: str) -> None:
    """`python -m module args` in the project root, this interpreter first on PATH (DVC's stage
    commands say `python`); exits with its status. The child's life is tied to this command's: a
    signal to this command (SIGTERM from `docker stop` or systemd, Ctrl-C, a closed terminal) stops it
    in order and this waits for it; if this command is SIGKILLed, the kernel sends the child SIGTERM."""
    from agentkiln import lifecycle

    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    raise typer.Exit(lifecycle.run_forwarding(lifecycle.child_argv(module, list(args)), cwd=project(), env=env))


def check_overrides(root: Path, overrides: list[str]) -> None:
    try:
        load_params(root / PARAMS_FILE, overrides=overrides)
    except ParamsError as e:
        fail(f"{e}\nFix the override (or params.yaml) and run again.")


def dvc_stages(root: Path) -> list[str]:
    """Stage names as `dvc repro` takes them: foreach stages expand to `name@key` (params.yaml keys)."""
    spec = yaml.safe_load((root / "dvc.yaml").read_text()).get("stages", {})
    params = yaml.safe_load((root / PARAMS_FILE).read_text()) or {}
    names = []
    for name, stage in spec.items():
        if isinstance(stage, dict) and "foreach" in stage:
            node = params
            for part in str(stage["foreach"]).strip("${} ").split("."):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            names += [f"{name}@{key}" for key in node]
        else:
            names.append(name)
    return names


# ---------------------------------------------------------------------------- the pipeline
@app.command()
def run(
    force: Annotated[bool, typer.Option("--force", help="re-run every stage even if DVC has it cached")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("-S", "--set", metavar="KEY=VALUE",
                    help="override a params.yaml setting for this run (repeatable), passed to `dvc exp run -S`")] = None,
) -> None:
    """Run the pipeline: dvc repro (or dvc exp run -S with overrides), then promotion.

    Example: agentkiln run -S sft.epochs=2 -S rl.defaults.lr=1e-5"""
    root = project()
    check_overrides(root, set_ or [])
    run_module("flows.pipeline", *(["--force"] if force else []), *[a for o in set_ or [] for a in ("-S", o)])


@app.command()
def stage(name: Annotated[str, typer.Argument(help="a stage of dvc.yaml, e.g. sft, rl@main, evaluate")]) -> None:
    """Run one DVC stage (and the stages it needs, if stale): dvc repro NAME.

    Example: agentkiln stage evaluate"""
    root = project()
    names = dvc_stages(root)
    if name not in names:
        fail(f"no stage {name!r} in dvc.yaml; stages: {', '.join(names)}")
    run_module("dvc", "repro", name)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def eval(ctx: typer.Context) -> None:  # noqa: A001 (the command's name)
    """Evaluate policies on a frozen panel (the options of python -m agentkiln.evaluate; --help lists them).

    Example: agentkiln eval --model models:/agentkiln-policy@champion --panel test"""
    from agentkiln.evaluate.__main__ import main as evaluate_main

    try:
        code = evaluate_main(list(ctx.args))
    except SystemExit as e:  # argparse: --help or a usage error
        code = e.code
    raise typer.Exit(code or 0)


@app.command()
def play(
    model: Annotated[str, typer.Option(help="random, oracle, sft / rl / distilled, a model directory or models:/name@alias")] = "oracle",
    family: Annotated[str, typer.Option(help="an environment family (agentkiln.envs.FAMILIES)")] = "sokoban",
    level: Annotated[str, typer.Option(help="easy, medium or hard")] = "easy",
    seed: Annotated[int, typer.Option(help="the task's seed (same seed, same task)")] = 0,
    panel: Annotated[Optional[str], typer.Option(help="play a task of this split of data/tasks instead (with --task)")] = None,
    task: Annotated[Optional[str], typer.Option(help="task id within --panel")] = None,
    max_turns: Annotated[int, typer.Option(help="turn limit")] = 20,
    delay: Annotated[float, typer.Option(help="seconds between turns, for watching")] = 0.0,
) -> None:
    """Watch one episode turn by turn: observation, reply, reward.

    Example: agentkiln play --model sft --family gym-toytext --seed 3 --delay 0.5"""
    from agentkiln.play import PlayError, play_episode

    try:
        play_episode(model, family=family, level=level, seed=seed, panel=panel, task_id=task, max_turns=max_turns,
                     delay=delay, out=typer.echo)
    except PlayError as e:
        fail(str(e))


@app.command()
def replay(
    episodes: Annotated[Path, typer.Argument(help="an RL stage's reports/rl/<stage>/episodes.jsonl, or an MLflow "
                                             "run's episodes/iteration_NNNN.json")],
    model: Annotated[str, typer.Option(help="the checkpoint to re-score under: sft / rl / distilled, a model "
                                       "directory, an RL checkpoint or models:/name@alias")] = "rl",
    iteration: Annotated[Optional[int], typer.Option(help="only this iteration's episodes")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the rows as JSON here")] = None,
) -> None:
    """Re-score logged training episodes under another checkpoint: every reply's log-prob from the ids it was
    generated as, beside its behaviour log-prob and advantage.

    Example: agentkiln replay reports/rl/main/episodes.jsonl --model sft --iteration 1"""
    from agentkiln.evaluate.sources import resolve_policy
    from agentkiln.trainers.replay import ReplayError, load_records, replay as replay_rows, table

    try:
        records = load_records(episodes, iteration)
    except ReplayError as e:
        fail(str(e))
    try:
        # params.yaml names the pipeline's models and an RL checkpoint's starting model; nothing else needs it
        params = load_params() if model in ("sft", "rl", "distilled") or (Path(model) / "state.pt").is_file() else None
        policy = resolve_policy(model, params)
        if policy is None:
            fail(f"--model {model}: a baseline has no log-probs; give a trained model")
        rows = replay_rows(policy, records)
    except (ParamsError, FileNotFoundError, ReplayError, OSError) as e:
        fail(str(e))
    typer.echo(table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1) + "\n")
        typer.echo(f"wrote {json_out}")


@app.command()
def findings(
    publish: Annotated[bool, typer.Option("--publish", help="train nothing: copy the last report's "
                                          "findings.md to docs/ and merge its claims into docs/findings.json")] = False,
    claims: Annotated[str | None, typer.Option("--claims", metavar="ID[,ID...]", help="these claims only (their arms); "
                                                "--publish then replaces those of the published claims")] = None,
) -> None:
    """Reproduce the claims of params.yaml `findings` (python -m flows.findings): every arm x seed once,
    cached; writes reports/findings/findings.{md,json,png} (a profile's: reports/findings/<profile>/).

    Example: agentkiln findings && agentkiln findings --publish"""
    if publish and claims:
        raise typer.BadParameter("--claims runs claims, --publish copies the last report: one at a time")
    run_module("flows.findings", *(["--publish"] if publish else []), *(["--claims", claims] if claims else []))


# ---------------------------------------------------------------------------- the registry
@app.command()
def promote() -> None:
    """Register the best evaluated candidate and make it champion if it wins the gate (python -m flows.promote)."""
    run_module("flows.promote")


@app.command()
def rollback(name: Annotated[str, typer.Option(help="registered model name")] = "agentkiln-policy") -> None:
    """Make the previous champion champion again (the demoted version is tagged rolled_back)."""
    from agentkiln.registry.__main__ import main as registry_main

    raise typer.Exit(registry_main(["rollback", "--name", name]))


@registry_app.command("show")
def registry_show(name: Annotated[str, typer.Option(help="registered model name")] = "agentkiln-policy") -> None:
    """List versions with aliases, lineage and scores."""
    from agentkiln.registry.__main__ import main as registry_main

    raise typer.Exit(registry_main(["show", "--name", name]))


# ---------------------------------------------------------------------------- operations
@app.command()
def serve(
    cron: Annotated[str, typer.Option(help="cron schedule")] = "0 3 * * *",
    pool: Annotated[Optional[str], typer.Option(help="deploy to this Prefect work pool (run by `prefect worker start --pool NAME`) instead of serving")] = None,
    force: Annotated[bool, typer.Option("--force", help="scheduled runs re-run every stage")] = False,
) -> None:
    """Run the pipeline on a schedule: serve it (foreground) or deploy it to a work pool.

    Needs a Prefect server: `agentkiln ui`, then export PREFECT_API_URL as it says.
    Example: agentkiln serve --cron "0 3 * * *\""""
    if not os.environ.get("PREFECT_API_URL"):
        fail("PREFECT_API_URL is not set: a schedule needs a long-lived Prefect server. Start one (agentkiln ui, or "
             "prefect server start) and export PREFECT_API_URL=http://127.0.0.1:4200/api")
    run_module("flows.pipeline", *(["--pool", pool] if pool else ["--serve"]), "--cron", cron,
               *(["--force"] if force else []))


@app.command()
def ui(
    mlflow_port: Annotated[int, typer.Option(help="MLflow UI port")] = 5000,
    prefect_port: Annotated[int, typer.Option(help="Prefect UI port")] = 4200,
) -> None:
    """Start the MLflow and Prefect servers on loopback, print their URLs; Ctrl-C stops both."""
    from agentkiln.servers import ServerError
    from agentkiln.services import serve_uis

    root = project()
    try:
        serve_uis(root, mlflow_port, prefect_port, out=typer.echo)
    except ServerError as e:
        typer.echo(f"agentkiln ui: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def endpoint(
    model: Annotated[str, typer.Option(help="a registry URI (models:/<name>@<alias> is followed as the alias moves; "
                                       "models:/<name>/<version>) or a policy directory (e.g. models/rl)")]
    = "models:/agentkiln-policy@champion",
    host: Annotated[str, typer.Option(help="address to listen on (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    record: Annotated[Optional[Path], typer.Option(help="record every conversation as a token-in/token-out episode "
                                                   "in this directory (agentkiln collect seals them)")] = None,
    poll: Annotated[float, typer.Option(help="seconds between checks of the alias's version")] = 10.0,
    max_batch: Annotated[int, typer.Option(help="requests decoded together at most")] = 16,
    max_tokens: Annotated[int, typer.Option(help="reply budget of a request that sets no max_tokens")] = 64,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    backend: Annotated[str, typer.Option(help="hf (the in-process engine, CPU or GPU) or vllm (a vLLM engine: "
                                         "bash scripts/install_vllm.sh)")] = "hf",
    max_body_bytes: Annotated[int, typer.Option(help="one request body (413 past it)")] = Limits.body_bytes,
    max_inflight_bytes: Annotated[int, typer.Option(help="the bodies of all requests in progress together (503 "
                                                    "past it)")] = Limits.inflight_bytes,
    max_messages: Annotated[int, typer.Option(help="messages of one request")] = Limits.messages,
    max_message_chars: Annotated[int, typer.Option(help="characters of one message")] = Limits.message_chars,
    max_conversation_chars: Annotated[int, typer.Option(help="characters of all of a request's messages")]
    = Limits.conversation_chars,
    max_admissible: Annotated[int, typer.Option(help="admissible actions of one request")] = Limits.admissible,
    max_action_chars: Annotated[int, typer.Option(help="characters of one admissible action")] = Limits.action_chars,
    max_admissible_chars: Annotated[int, typer.Option(help="characters of all of a request's admissible actions")]
    = Limits.admissible_chars,
    max_prepare_seconds: Annotated[float, typer.Option(help="time to render a request's conversation and build its "
                                                       "admissible trie (422 past it)")] = Limits.prepare_seconds,
    max_kept_bytes: Annotated[int, typer.Option(help="memory for conversations kept to continue them token-in/"
                                                "token-out (least recently used dropped past it)")] = Limits.kept_bytes,
    max_record_bytes: Annotated[int, typer.Option(help="bytes of the --record directory (turns past it are served, "
                                                  "not recorded)")] = Limits.record_bytes,
) -> None:
    """Serve a policy behind an OpenAI-compatible API (/v1/models, /v1/chat/completions with tools and
    streaming): its chat template, agent format and constrained decoding, token ids and log-probs returned.
    Every request is bounded by the --max-* limits; a refusal is a 4xx error naming the field.

    Example: agentkiln endpoint --model models:/agentkiln-policy@champion --port 8000 --record data/recorded"""
    from agentkiln.evaluate.sources import source_problem

    if port < 1 or port > 65535:
        fail(f"--port {port}: expected 1-65535")
    if poll <= 0 or max_batch < 1 or max_tokens < 1:
        fail("--poll, --max-batch and --max-tokens must be positive")
    if backend not in ("hf", "vllm"):
        fail(f"--backend {backend}: expected hf or vllm")
    limits = Limits(body_bytes=max_body_bytes, inflight_bytes=max_inflight_bytes, messages=max_messages,
                    message_chars=max_message_chars, conversation_chars=max_conversation_chars,
                    admissible=max_admissible, action_chars=max_action_chars, admissible_chars=max_admissible_chars,
                    prepare_seconds=max_prepare_seconds, kept_bytes=max_kept_bytes, record_bytes=max_record_bytes)
    if bad := [OPTION[k] for k, v in vars(limits).items() if k in OPTION and not v > 0]:
        fail(f"{', '.join(bad)}: must be positive")
    if model in ("sft", "rl", "distilled"):  # the pipeline's models, where params.yaml puts them
        from agentkiln.paths import model_dirs

        model = str(model_dirs(load_params(project() / PARAMS_FILE))[model])
    if not model.startswith("models:/") and (problem := source_problem(model)):
        fail(f"--model {problem}")
    from agentkiln.servers import port_taken

    if port_taken(port, host):
        fail(f"port {port} on {host} is taken (another endpoint or program listens there); pick another with --port")
    if model.startswith("models:/"):
        project()  # the registry is the project's MLflow store
    from agentkiln.serving.app import serve as serve_endpoint

    try:
        serve_endpoint(model, host, port, str(record) if record else None, poll, max_batch, threads, max_tokens,
                       backend, limits, out=typer.echo)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e), 1)


@app.command()
def collect(
    record_dir: Annotated[Path, typer.Argument(help="the --record directory of `agentkiln endpoint`")],
    name: Annotated[str, typer.Option(help="the split's name: a new one each time (splits are never overwritten)")],
    out: Annotated[Path, typer.Option(help="where collected splits live")] = Path("data/collected"),
    rewarded_only: Annotated[bool, typer.Option("--rewarded-only", help="leave out episodes no reward was posted for")]
    = False,
    no_dvc: Annotated[bool, typer.Option("--no-dvc", help="do not `dvc add` the split")] = False,
    model: Annotated[Optional[Path], typer.Option(help="a policy directory: check the ids against its vocabulary, and "
                                                  "the replies its tokenizer served against their text")] = None,
) -> None:
    """Seal the episodes the endpoint recorded into a versioned split (manifest, pandera contract, dvc add),
    which SFT (sft.data.collected) and RL (rl.defaults.offline.split) train on by params. Every record is
    checked first; if one is not a valid recorded episode, each bad file is named and nothing is written.

    Example: agentkiln collect data/recorded --name harness-v1 --model models/rl/main"""
    from agentkiln.artifacts import ArtifactError
    from agentkiln.collected import collect as collect_split

    if model is not None and not (model / "config.json").is_file():
        fail(f"--model {model}: not a policy directory (no config.json)")
    try:
        collect_split(record_dir, out, name, rewarded_only=rewarded_only, dvc=not no_dvc, log=typer.echo, model=model)
    except (FileNotFoundError, FileExistsError, ArtifactError, ValueError) as e:
        fail(str(e))


@app.command()
def doctor() -> None:
    """Check this machine: versions, sandbox, params, project, MLflow store, Prefect API, GPU."""
    from agentkiln.doctor import run_checks

    ok = True
    for check in run_checks(Path.cwd()):
        typer.echo(f"[{check.status:>4}] {check.name}: {check.detail}" + (f"\n        -> {check.fix}" if check.fix else ""))
        ok &= check.status != "FAIL"
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
