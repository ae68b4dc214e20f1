"""MLflow's python_function flavour of a logged policy: the agent, as `agentkiln endpoint` serves it.

`mlflow models serve -m models:/agentkiln-policy@champion --env-manager local` (or
`mlflow.pyfunc.load_model(uri).predict(request)`) takes an OpenAI chat request
({"messages": [...], "temperature": 0, "admissible": [...], "tools": [...]}) and answers with a chat
completion rendered in the policy's chat template and agent format, decoded as the endpoint decodes
(constrained to `admissible` when given), token ids included. A list of requests gets a list of
completions (decoded together); a plain string is one user message.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from agentkiln.registry.model_registry import assemble_policy
from agentkiln.serving.app import DEFAULT_REPLY_TOKENS, completion
from agentkiln.serving.requests import parse_job
from agentkiln.serving.source import ModelSource
from agentkiln.serving.worker import Worker


class AgentModel:
    def __init__(self, policy_dir: str | Path):
        self.source = ModelSource(str(policy_dir), log=lambda *_: None)
        self.worker = Worker(self.source)

    def close(self) -> None:
        """Stop the decoding thread (a served model lives as long as its process; a test's does not)."""
        self.worker.stop()

    def predict(self, model_input, params: dict | None = None):
        single = not isinstance(model_input, list)
        requests = [_request(r) | (params or {}) for r in ([model_input] if single else model_input)]
        futures = [self.worker.submit(parse_job(r, DEFAULT_REPLY_TOKENS)) for r in requests]
        out = [completion(f.result(), self.source.served_name, bool(r.get("logprobs"))) for f, r in zip(futures, requests)]
        return out[0] if single else out


def _request(item) -> dict:
    if isinstance(item, str):
        return {"messages": [{"role": "user", "content": item}]}
    if hasattr(item, "to_dict") and not isinstance(item, dict):  # a one-row DataFrame of a request's fields
        item = {k: v[0] for k, v in item.to_dict(orient="list").items()}
    if not isinstance(item, dict):
        raise TypeError(f"expected an OpenAI chat request (a dict with `messages`) or a string, got {type(item).__name__}")
    return dict(item)


def _load_pyfunc(path: str) -> AgentModel:
    """MLflow's entry point: `path` is the downloaded model's root (MLmodel, model/, agentkiln/)."""
    with tempfile.TemporaryDirectory(prefix="agentkiln-pyfunc-") as tmp:  # loaded into memory, then removed
        return AgentModel(assemble_policy(Path(path), Path(tmp) / "policy", path))
