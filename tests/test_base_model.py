"""The base stage: a model source (a GGUF file, a packaged model, a Hugging Face directory, scratch)
becomes models/base, an ordinary Hugging Face directory with the agent format and a manifest naming
the source with its digests; every unusable source is refused by name before anything is written.

The GGUF files are written here with the `gguf` package (tests/gguf_support.py); one slow test
converts the real packaged SmolLM2 when setup has fetched it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from agentkiln.config import PACKAGED_MODELS, ParamsError, load_params
from agentkiln.policy import load_policy
from agentkiln.policy import packaged
from agentkiln.policy.gguf import GGUFError
from agentkiln.stages.base import SourceError, run_base
from agentkiln.stages.common import load_split
from agentkiln.stages.sft import render_all

from tests.conftest import ROOT, expert_episodes, make_chat_model, params_with, task_texts, tiny_dataset
from tests.gguf_support import write_tiny_gguf

MIX = {"frozenlake_easy": 1.0, "python_words": 1.0}
PROMPTS = {"gym-toytext": "Reply with one move from the list.", "python-tool": "Use python[...] then answer[...]."}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("base") / "tasks", {"sft": MIX, "rl": MIX, "test": MIX},
                        {"sft": 6, "rl": 4, "test": 4})


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def base_params(source: str, sha256: str | None = None, **sft):
    return params_with({"sft": {"model": {"source": str(source), "sha256": sha256, "max_context": 2048},
                                "agent": {"system_prompts": PROMPTS}, **sft}})


def test_a_gguf_file_becomes_the_base_policy_with_its_source_and_format(tasks_dir, tmp_path):
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "base"
    metrics = run_base(base_params(gguf_file, sha(gguf_file)), tasks_dir, out)
    assert metrics["source"] == "gguf" and metrics["architecture"] == "LlamaForCausalLM" and metrics["context"] == 2048
    manifest = json.loads((out / "agentkiln_manifest.json").read_text())["meta"]
    assert manifest["source"]["kind"] == "gguf" and manifest["source"]["sha256"] == sha(gguf_file)
    assert manifest["source"]["file"] == "tiny.gguf"
    policy = load_policy(out)  # an ordinary saved policy: manifest checked, agent.json read
    assert policy.fmt.system_prompts == PROMPTS and policy.context == 2048
    assert policy.tokenizer.chat_template and policy.chat.end_id == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (out / "model.safetensors").is_file() and "quantization_config" not in json.loads((out / "config.json").read_text())
    # each family's episodes start with its own system prompt; the rest of the sequence is the same pieces
    tasks = load_split(tasks_dir, "sft")
    for ep in render_all(policy, expert_episodes(tasks, tasks_dir)):
        head = policy.tokenizer.decode(ep.ids[: ep.prompt_len])
        assert head.startswith("<|im_start|>system\n" + PROMPTS[ep.family]), head[:80]
    # the same source and params give the same bytes
    again = tmp_path / "again"
    run_base(base_params(gguf_file, sha(gguf_file)), tasks_dir, again)
    assert {f.name: sha(f) for f in out.iterdir()} == {f.name: sha(f) for f in again.iterdir()}


def _truncated(tmp_path: Path) -> Path:
    full = write_tiny_gguf(tmp_path / "full.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return cut


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n")
    return path


BAD = {
    "not GGUF": (_text, None, GGUFError, "not a GGUF file"),
    "truncated": (_truncated, None, GGUFError, "damaged or truncated"),
    "unknown architecture": (lambda t: write_tiny_gguf(t / "odd.gguf", architecture="zebra"), None, GGUFError,
                             "transformers cannot load this GGUF model (architecture 'zebra'"),
    "no chat template": (lambda t: write_tiny_gguf(t / "plain.gguf", chat_template=None), None, GGUFError,
                         "no chat template"),
    "wrong digest": (lambda t: write_tiny_gguf(t / "tiny.gguf"), "0" * 64, SourceError, "is not sft.model.sha256"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_an_unusable_source_is_refused_by_name_before_anything_is_written(case, tasks_dir, tmp_path):
    make, digest, error, message = BAD[case]
    path = make(tmp_path)
    out = tmp_path / "base"
    with pytest.raises(error) as e:
        run_base(base_params(path, digest), tasks_dir, out)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)
    assert not out.exists()


def test_a_hugging_face_directory_is_a_source_with_the_digests_of_its_files(tasks_dir, tmp_path):
    texts = task_texts(load_split(tasks_dir, "sft"), tasks_dir)
    model_dir = make_chat_model(tmp_path / "qwen", "qwen2", texts)
    out = tmp_path / "base"
    run_base(base_params(model_dir), tasks_dir, out)
    source = json.loads((out / "agentkiln_manifest.json").read_text())["meta"]["source"]
    assert source["kind"] == "directory" and source["sha256"]["config.json"] == sha(model_dir / "config.json")
    assert source["sha256"]["model.safetensors"] == sha(model_dir / "model.safetensors")
    a, b = load_policy(model_dir), load_policy(out)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_the_scratch_source_is_the_scratch_policy_sft_used_to_build(tasks_dir, tmp_path):
    from agentkiln.stages.base import base_policy

    p = params_with({"sft": {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                                       "vocab_size": 400}}})
    out = tmp_path / "base"
    assert run_base(p, tasks_dir, out)["source"] == "scratch"
    saved, built = load_policy(out), base_policy(p, tasks_dir)[0]
    assert saved.tokenizer.get_vocab() == built.tokenizer.get_vocab()
    assert all(torch.equal(x, y) for x, y in zip(saved.model.state_dict().values(), built.model.state_dict().values()))


def test_packaged_models_are_fetched_by_setup_and_checked_where_they_are_read(tmp_path, monkeypatch):
    from agentkiln.config import Params

    assert PACKAGED_MODELS == tuple(packaged.CATALOG)  # config's names and the catalog agree
    monkeypatch.setenv("AGENTKILN_CACHE", str(tmp_path / "cache"))
    name = "smollm2-135m-instruct"
    with pytest.raises(packaged.PackagedModelError, match=f"`python -m agentkiln.policy.packaged fetch {name}`"):
        packaged.locate(name)
    where = packaged.cached_file(name)
    where.parent.mkdir(parents=True)
    where.write_bytes(b"GGUF" + b"\0" * 100)  # the right name, other bytes
    with pytest.raises(packaged.PackagedModelError, match="sha256 is not the pinned"):
        packaged.locate(name)
    with pytest.raises(packaged.PackagedModelError, match="not a packaged model"):
        packaged.entry("gpt-5")
    raw = params_with({}).model_dump()
    raw["sft"]["model"]["source"] = name  # a packaged name needs no file at params load: setup fetches it
    assert Params.model_validate(raw).sft.model.source == name


def test_params_refuse_a_missing_gguf_file_and_a_digest_without_one(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    bad = tmp_path / "params.yaml"
    bad.write_text(text.replace("    source: scratch      #", f"    source: {tmp_path / 'nope.gguf'}      #", 1))
    with pytest.raises(ParamsError, match="sft.model.source.*GGUF file .*nope.gguf does not exist"):
        load_params(bad)
    bad.write_text(text.replace("    sha256: null         # a .gguf", "    sha256: " + "a" * 64 + "  # a .gguf", 1))
    with pytest.raises(ParamsError, match="sha256 is checked for a .gguf source only"):
        load_params(bad)


@pytest.mark.slow
def test_the_packaged_smollm2_converts_and_acts_zero_shot(tasks_dir, tmp_path):
    """The real wheel's GGUF (when `python -m agentkiln.policy.packaged fetch` has run): a 134.5M-parameter
    Llama with its ChatML template, whose constrained greedy reply to a lake is an admissible move."""
    from agentkiln.rollout.agents import PolicyAgent
    from agentkiln.rollout.engine import run_episodes

    name = "smollm2-135m-instruct"
    if not packaged.cached_file(name).is_file():
        pytest.skip(f"{name} is not fetched (python -m agentkiln.policy.packaged fetch {name})")
    out = tmp_path / "base"
    metrics = run_base(base_params(name), tasks_dir, out)
    assert metrics["n_params"] == 134_515_008 and metrics["vocab_size"] == 49_152
    assert metrics["sha256"] == packaged.CATALOG[name].sha256
    policy = load_policy(out)
    assert policy.tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in policy.tokenizer.chat_template
    lakes = [t for t in load_split(tasks_dir, "test") if t.family == "gym-toytext"][:2]
    eps = run_episodes(PolicyAgent(policy, greedy=True), lakes, tasks_dir, max_turns=2)
    assert all(t.action in t.admissible for ep in eps for t in ep.turns)
    shutil.rmtree(out)
