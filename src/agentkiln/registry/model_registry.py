"""The MLflow model registry side of promotion: a training run logs its policy (log_policy); promotion
registers that run's model as a new version tagged with its lineage, moves the `challenger` / `champion` / `previous` aliases.

Serving: `mlflow.pyfunc.load_model("models:/<name>@champion").predict(pd.DataFrame({"prompt": [...]}))`
returns the greedy continuation of each prompt.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from importlib import metadata
from pathlib import Path

import mlflow
import pandas as pd
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


class PolicyModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper of a policy directory saved with `save_pretrained` (model + tokenizer).

    predict: a DataFrame with a `prompt` column (or a list of strings) -> list of greedy
    continuations (up to `max_new_tokens` new tokens each, special tokens removed)."""

    def __init__(self, max_new_tokens: int = 8):
        self.max_new_tokens = max_new_tokens
        self.policy_dir: str | None = None
        self._model = None
        self._tokenizer = None

    def load_context(self, context):
        self.policy_dir = context.artifacts["policy"]
        self._model = self._tokenizer = None  # loaded on the first predict

    def _load(self):
        if self._model is None:
            import torch  # torch-heavy imports only where a model is loaded (the registry CLI stays light)
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from agentkiln.policy.model import saved_meta

            saved_meta(Path(self.policy_dir))  # the manifest's checks: every file present, hashes match
            self._tokenizer = AutoTokenizer.from_pretrained(self.policy_dir)
            self._model = AutoModelForCausalLM.from_pretrained(self.policy_dir, dtype=torch.float32).eval()
        return self._model, self._tokenizer

    @staticmethod
    def _prompts(model_input) -> list[str]:
        if isinstance(model_input, str):
            return [model_input]
        if hasattr(model_input, "columns"):  # pandas DataFrame
            if "prompt" not in model_input.columns:
                raise ValueError(f"model input needs a 'prompt' column, got {list(model_input.columns)}")
            return [str(p) for p in model_input["prompt"].tolist()]
        if isinstance(model_input, dict):
            return [str(p) for p in model_input["prompt"]]
        return [str(p) for p in model_input]

    # The pd.DataFrame hint tells MLflow "no schema inferred from hints" (it warns without one).
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        import torch

        model, tok = self._load()
        max_new = int((params or {}).get("max_new_tokens", self.max_new_tokens))
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        out = []
        with torch.no_grad():
            for prompt in self._prompts(model_input):  # one at a time: no padding subtleties
                ids = tok(prompt, return_tensors="pt")["input_ids"]
                if ids.shape[1] == 0:  # generate needs at least one token
                    start = tok.bos_token_id if tok.bos_token_id is not None else (eos if eos is not None else 0)
                    ids = torch.tensor([[start]])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=eos,
                )
                out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip())
        return out


def signature() -> ModelSignature:
    """Input: a `prompt` string column; output: one string per row; param max_new_tokens."""
    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
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


def _log_pyfunc(model_dir: Path):
    with warnings.catch_warnings():
        # An input example would make MLflow run the model at logging time: deliberately none.
        warnings.filterwarnings("ignore", message=".*input example was not provided.*")
        return mlflow.pyfunc.log_model(
            name="policy",
            python_model=PolicyModel(),
            artifacts={"policy": str(model_dir)},
            pip_requirements=pip_requirements(),
            signature=signature(),
        )


def log_policy(model_dir: Path) -> str | None:
    """Log the policy a training run just saved as that run's model (MLflow's Models tab) and tag
    the run with the directory's digest, so promotion registers *this* run's model and the registry
    version points at the run that trained it. Nothing without an active run; returns the model URI.

    The flavour is a pyfunc holding the policy directory, not mlflow.transformers: a policy is more
    than weights + tokenizer (agent.json: its action format and context; manifest.json: the file
    checksums that load_policy verifies), and the transformers flavour re-saves the model and drops
    both. `mlflow.pyfunc.load_model(uri).predict` still serves it, and agentkiln loads the directory."""
    if mlflow.active_run() is None:
        return None
    model_dir = Path(model_dir)
    info = _log_pyfunc(model_dir)
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
            uri = _log_pyfunc(model_dir).model_uri
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
        if current is None or not restored:
            raise RuntimeError(f"registered model {name!r} has no champion and previous to roll back between "
                               f"(aliases: {found}); nothing was changed")
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
    `models:/<name>/<version>`), downloaded from the registry's artifact store."""
    import tempfile

    dst = Path(dst or tempfile.mkdtemp(prefix="agentkiln-model-"))
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst))
    except MlflowException as e:
        raise FileNotFoundError(f"{uri}: not found in the registry at {mlflow.get_tracking_uri()} ({e.message})") from e
    import yaml

    mlmodel = yaml.safe_load((Path(local) / "MLmodel").read_text())
    try:  # where log_model put the `policy` artifact (artifacts/<directory name>)
        policy = Path(local) / mlmodel["flavors"]["python_function"]["artifacts"]["policy"]["path"]
    except (KeyError, TypeError):
        raise FileNotFoundError(f"{uri}: not an agentkiln policy model (its MLmodel has no `policy` artifact)") from None
    if not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{uri}: the downloaded model has no policy directory at {policy}")
    return policy


def aliases(name: str) -> dict[str, str]:
    """{alias: version} of a registered model."""
    return {a: str(v) for a, v in (_client().get_registered_model(name).aliases or {}).items()}
