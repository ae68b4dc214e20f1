"""The MLflow model registry side of promotion: a training run logs its policy (log_policy); promotion
registers that run's model as a new version tagged with its lineage, moves the `challenger` / `champion` / `previous` aliases.

A logged policy is MLflow's transformers flavour (weights + tokenizer, raw text generation through
mlflow.transformers.load_model) plus the policy's own files (agent.json, the manifest) under
`agentkiln/`, and its python_function flavour is the agent (agentkiln.serving.pyfunc): `mlflow models
serve -m models:/<name>@champion --env-manager local` answers an OpenAI chat request in the policy's
chat template, agent format and decoding, as `agentkiln endpoint` does. agentkiln itself loads the
policy directory again (download_policy), checked by its manifest.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import mlflow
from huggingface_hub import ModelCard
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from agentkiln.registry.lock import registry_lock

CHALLENGER, CHAMPION, PREVIOUS = "challenger", "champion", "previous"
DESCRIPTION = (
    "agentkiln policy: a causal LM agent for multi-turn text and tool tasks (TextWorld, Sokoban, FrozenLake/Taxi, "
    "a web store, ...), trained by the agentkiln pipeline "
    "(SFT on expert walkthroughs -> multi-stage RL -> distillation). Aliases: champion = serving, "
    "challenger = latest candidate, previous = the champion before the last promotion. "
    "Version tags hold lineage (git commit, params hash, DVC data hashes) and evaluation scores."
)
MAX_TAG_VALUE = 5000
MODEL_DIGEST_TAG = "agentkiln.model_digest"  # on a training run: the digest of the policy it saved
MODEL_URI_TAG = "agentkiln.model_uri"  # ... and the URI of its logged model
PYFUNC_LOADER = "agentkiln.serving.pyfunc"  # the logged model's python_function flavour: the agent, not raw text
POLICY_FILES = "agentkiln"  # in a logged model: the policy directory's files, less its weights
WEIGHTS_SUFFIX = ".safetensors"  # the policy's weight files: the transformers flavour holds those


def _requirement(dist: str, fallback: str) -> str:
    """`dist==<installed version>` (local version suffix such as +cpu dropped), else `fallback`.
    Read from package metadata: nothing is imported, nothing is inferred by running the model."""
    try:
        version = re.sub(r"\+.*$", "", metadata.version(dist))
    except metadata.PackageNotFoundError:
        return fallback
    return f"{dist}=={version}"


def pip_requirements() -> list[str]:
    return [
        _requirement("mlflow", "mlflow"),
        _requirement("torch", "torch"),
        _requirement("transformers", "transformers>=5,<6"),
        _requirement("tokenizers", "tokenizers"),
        "pandas",
    ]


def signature() -> ModelSignature:
    """Input: one prompt string per row; output: its generated text; param max_new_tokens (passed to
    `generate`). Declared, so that MLflow infers nothing by running the model at logging time."""
    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 8)]),
    )


def _client() -> MlflowClient:
    return MlflowClient()


def model_digest(model_dir: Path) -> str:
    """sha256 over the policy directory's files (relative path + bytes): which training run wrote
    this model, without writing a run id into the (DVC-versioned, byte-deterministic) directory."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(model_dir)).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _model_card(model_dir: Path) -> ModelCard:
    """The card MLflow stores with the model (given, so that MLflow does not look one up on a hub)."""
    return ModelCard(f"---\nlicense: other\nlibrary_name: transformers\npipeline_tag: text-generation\n---\n"
                     f"# agentkiln policy `{model_dir.name}`\n\n{DESCRIPTION}\n")


def _log_transformers(model_dir: Path):
    """Log `model_dir` as MLflow's transformers flavour (weights + tokenizer, a text-generation
    pipeline), then the policy's other files under POLICY_FILES: MLflow re-saves the model and
    tokenizer (tokenizer_config.json comes out with other bytes) and has no place for agent.json (the
    action format and context) or the manifest. download_policy puts the directory back together from
    the two and its manifest checks every byte."""
    import torch  # torch-heavy imports only where a model is loaded (the registry CLI stays light)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # An absolute path is never a hub repo id: MLflow's license lookup (keyed by the model's
    # name_or_path) fails on it locally, with nothing sent, whether or not HF_HUB_OFFLINE is set.
    src = Path(model_dir).resolve()
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    with warnings.catch_warnings():
        # An input example would make MLflow run the model at logging time: deliberately none.
        warnings.filterwarnings("ignore", message=".*input example was not provided.*")
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name="policy",
            task="text-generation",
            pip_requirements=pip_requirements(),
            signature=signature(),
            model_card=_model_card(src),
        )
    with tempfile.TemporaryDirectory(prefix="agentkiln-policy-files-") as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(f"*{WEIGHTS_SUFFIX}"))
        _client().log_model_artifacts(info.model_id, tmp, POLICY_FILES)
    with tempfile.TemporaryDirectory(prefix="agentkiln-mlmodel-") as tmp:
        _client().log_model_artifacts(info.model_id, _agent_pyfunc(info.model_uri, Path(tmp)), None)
    return info


def _agent_pyfunc(model_uri: str, tmp: Path) -> Path:
    """The logged model's MLmodel with its python_function flavour turned into the agent's
    (agentkiln.serving.pyfunc: chat requests in the policy's template, agent format and decoding, as
    `agentkiln endpoint` answers them); the transformers flavour stays for raw text generation
    (mlflow.transformers.load_model). No signature: the input is an OpenAI chat request."""
    from mlflow.models import Model

    model = Model.load(model_uri)
    conf = model.flavors["python_function"]
    model.flavors["python_function"] = {"loader_module": PYFUNC_LOADER, "env": conf.get("env"),
                                        "python_version": conf.get("python_version")}
    model.signature = None
    tmp.mkdir(parents=True, exist_ok=True)
    model.save(tmp / "MLmodel")
    return tmp


def log_policy(model_dir: Path) -> str | None:
    """Log the policy a training run just saved as that run's model (MLflow's Models tab, the
    transformers flavour) and tag the run with the directory's digest, so promotion registers *this*
    run's model and the registry version points at the run that trained it. Nothing without an
    active run; returns the model URI. Seconds for the default tiny policy."""
    if mlflow.active_run() is None:
        return None
    model_dir = Path(model_dir)
    info = _log_transformers(model_dir)
    mlflow.set_tags({MODEL_DIGEST_TAG: model_digest(model_dir), MODEL_URI_TAG: info.model_uri})
    return info.model_uri


def trained_model_uri(model_dir: Path) -> str | None:
    """The model URI logged by the newest training run whose model has `model_dir`'s digest."""
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list", max_results=1,
                              filter_string=f"tags.`{MODEL_DIGEST_TAG}` = '{model_digest(model_dir)}'",
                              order_by=["attributes.start_time DESC"])
    return runs[0].data.tags.get(MODEL_URI_TAG) if runs else None


def register_candidate(model_dir: Path, name: str, tags: dict[str, str], metrics: dict[str, float]) -> str:
    """Register the model of the training run that wrote `model_dir` (found by digest) as a new
    version of `name`, tag it (lineage + `metric.<k>`), alias it `challenger`. A directory no
    tracked run trained (e.g. copied in) is logged in the active run instead, and tagged so.
    Returns the version number as a string."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such model directory (run the pipeline first)")
    uri = trained_model_uri(model_dir)
    tags = dict(tags, **{"model_source": "training run" if uri else "logged at registration (no training run has it)"})
    if mlflow.active_run() is not None:
        mlflow.log_metrics({f"candidate/{k}": float(v) for k, v in metrics.items()})
    if uri is None:
        started = mlflow.active_run() is None
        if started:
            mlflow.start_run(run_name="register", log_system_metrics=False)
        try:
            uri = _log_transformers(model_dir).model_uri
        finally:
            if started:
                mlflow.end_run()
    return register_version(uri, name, tags, metrics)


def describe(version, tags: dict[str, str]) -> str:
    """The version page's description: its lineage and scores, readable (the tags hold the same for machines)."""
    data = "\n".join(f"  - `{k.removeprefix('lineage.data.')}`: `{v}`" for k, v in sorted(tags.items())
                     if k.startswith("lineage.data."))
    lines = [
        f"**{tags.get('candidate', '?')}** from stage `{tags.get('stage', '?')}`, trained in run "
        f"`{version.run_id or '?'}` ({tags.get('model_source', '?')})",
        f"- git commit: `{tags.get('lineage.git_commit', '?')}`",
        f"- params.yaml hash: `{tags.get('lineage.params_hash', '?')}`",
        f"- data and models (dvc.lock):\n{data}" if data else "- data: (no dvc.lock)",
        f"- panel `{tags.get('eval.panel', '?')}`: success {tags.get('eval.success', '?')} "
        f"(CI {tags.get('eval.ci_low', '?')} to {tags.get('eval.ci_high', '?')})",
    ]
    if "eval.vs_random" in tags:
        lines.append(f"- against random: {tags['eval.vs_random']}")
    return "\n".join(lines)


def register_version(model_uri: str, name: str, tags: dict[str, str], metrics: dict[str, float]) -> str:
    """Register a logged model as a new version of `name` (created if absent), tag it (lineage +
    `metric.<k>`) and alias it `challenger`, all under the registry lock. Returns the version."""
    all_tags = {str(k): str(v)[:MAX_TAG_VALUE] for k, v in tags.items()}
    all_tags.update({f"metric.{k}": f"{float(v):.6g}" for k, v in metrics.items()})
    client = _client()
    with registry_lock():
        try:
            client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            client.create_registered_model(name, description=DESCRIPTION)
        mv = mlflow.register_model(model_uri, name, tags=all_tags)
        client.update_model_version(name, mv.version, description=describe(mv, all_tags))
        client.set_registered_model_alias(name, CHALLENGER, mv.version)
    return str(mv.version)


def champion(name: str) -> tuple[str, dict[str, str]] | None:
    """(version, tags) of the version aliased `champion`, or None when the model or alias is absent."""
    client = _client()
    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    if CHAMPION not in (model.aliases or {}):
        return None
    mv = client.get_model_version_by_alias(name, CHAMPION)
    return str(mv.version), dict(mv.tags)


def promote(name: str, version: str) -> None:
    """Alias `version` as champion; the old champion (if any, and different) becomes `previous`.
    The new champion's tag `promoted_over` remembers the version it replaced (rollback's chain).
    Under the registry lock, the champion read here: callers that decide *whether* to promote from
    the champion's scores hold the lock around their read too (stages.promote.challenge)."""
    client = _client()
    with registry_lock():
        current = champion(name)
        if current is not None and current[0] != str(version):
            # the chain link first: a process killed between these calls leaves `promoted_over` on a
            # version that is not champion (harmless), never a champion missing from the chain
            client.set_model_version_tag(name, str(version), "promoted_over", current[0])
            client.set_registered_model_alias(name, CHAMPION, str(version))
            client.set_registered_model_alias(name, PREVIOUS, current[0])
        else:
            client.set_registered_model_alias(name, CHAMPION, str(version))


def rollback(name: str) -> tuple[str, str]:
    """Make `previous` the champion again. The demoted version is tagged `rolled_back`; `previous`
    moves one step back along the `promoted_over` chain (or is removed at its start).
    Returns (demoted version, restored version). The champion's `promoted_over` tag is the chain's
    source of truth (`previous` mirrors it); all under the registry lock."""
    client = _client()
    with registry_lock():
        current = champion(name)
        found = aliases(name) if current is not None else {}
        restored = (current[1].get("promoted_over") or found.get(PREVIOUS)) if current is not None else None
        if current is None:
            raise RuntimeError(f"registered model {name!r} has no champion: nothing to roll back (a version becomes "
                               f"champion with `agentkiln promote`); nothing was changed")
        if not restored:
            raise RuntimeError(f"registered model {name!r}: its champion, version {current[0]}, was the first one "
                               f"promoted: there is no earlier champion to restore; nothing was changed")
        demoted = current[0]
        client.set_model_version_tag(name, demoted, "rolled_back", "true")
        client.set_registered_model_alias(name, CHAMPION, restored)
        before = dict(client.get_model_version(name, restored).tags).get("promoted_over")
        if before:
            client.set_registered_model_alias(name, PREVIOUS, before)
        elif PREVIOUS in found:
            client.delete_registered_model_alias(name, PREVIOUS)
    return demoted, restored


def download_policy(uri: str, dst: str | Path | None = None) -> Path:
    """The policy directory of a registered model version (`models:/<name>@<alias>` or
    `models:/<name>/<version>`), downloaded from the registry's artifact store and put back together:
    the flavour's weights (model/) + the policy's other files (POLICY_FILES/). The caller's
    load_policy checks the result against the policy's manifest."""
    dst = Path(dst or tempfile.mkdtemp(prefix="agentkiln-model-"))
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst / "logged")))
    except MlflowException as e:
        raise FileNotFoundError(f"{uri}: not found in the registry at {mlflow.get_tracking_uri()} ({e.message})") from e
    return assemble_policy(local, dst / "policy", uri)


@contextmanager
def downloaded_policy(uri: str) -> Iterator[Path]:
    """download_policy into a temporary directory that is removed on exit: load the policy inside the
    `with` (its weights and tokenizer are then in memory) and nothing is left behind in /tmp."""
    with tempfile.TemporaryDirectory(prefix="agentkiln-model-") as tmp:
        yield download_policy(uri, tmp)


def assemble_policy(local: Path, dst: Path, what: str) -> Path:
    """The policy directory of a downloaded logged model (`local`: its root, with MLmodel), put together
    at `dst` (or found inside `local`, for a version logged by an earlier agentkiln)."""
    import yaml

    flavors = yaml.safe_load((Path(local) / "MLmodel").read_text()).get("flavors") or {}
    if "transformers" in flavors and (local / POLICY_FILES).is_dir():
        policy = Path(dst)
        shutil.copytree(local / POLICY_FILES, policy)
        weights = local / flavors["transformers"].get("model_binary", "model")
        for f in sorted(weights.glob(f"*{WEIGHTS_SUFFIX}")):
            shutil.copy2(f, policy / f.name)
    else:  # a version logged by an earlier agentkiln: a pyfunc holding the directory as its `policy` artifact
        try:
            policy = local / flavors["python_function"]["artifacts"]["policy"]["path"]
        except (KeyError, TypeError):
            raise FileNotFoundError(f"{what}: not an agentkiln policy model (no {POLICY_FILES}/ beside a "
                                    "transformers flavour, no `policy` artifact)") from None
    if not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{what}: the downloaded model has no policy directory at {policy}")
    return policy


def aliases(name: str) -> dict[str, str]:
    """{alias: version} of a registered model."""
    return {a: str(v) for a, v in (_client().get_registered_model(name).aliases or {}).items()}
