"""Corrupt artefacts are refused where they are read, naming the file and the stage to rerun:
policies are checked against their manifest (sha256 of every file, format, training format) and
JSON files go through one reader that names the file on parse and schema errors."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentkiln.artifacts import ArtifactError, MissingArtifactError, read_json, write_manifest
from agentkiln.config import ModelParams
from agentkiln.policy import AgentFormat, build_scratch_policy, load_policy, save_policy
from agentkiln.policy.model import AGENT_FILE, MANIFEST_FILE, POLICY_FORMAT, POLICY_KIND

TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=512)
TEXTS = ["go north", "go south", "take the red key from the table", "open the door"] * 10


def E(p) -> str:  # a path inside a pattern
    return re.escape(str(p))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A policy saved where the pipeline keeps it (models/sft), trained with a non-default format."""
    root = tmp_path_factory.mktemp("repo")
    pol = build_scratch_policy(TINY, TEXTS, AgentFormat(show_admissible=False, system_prompt="Play."), seed=0)
    save_policy(pol, root / "models" / "sft")
    return root / "models" / "sft"


def copy(saved, tmp_path):
    dst = tmp_path / "models" / "sft"
    shutil.copytree(saved, dst)
    return dst


def test_a_saved_policy_carries_a_manifest_and_loads(saved):
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    assert manifest["kind"] == POLICY_KIND and manifest["format_version"] == POLICY_FORMAT
    files = {f.name for f in saved.iterdir()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == files and {"agent.json", "config.json", "model.safetensors"} <= files
    assert all(len(h) == 64 for h in manifest["files"].values())
    assert manifest["meta"]["agent"] == json.loads((saved / AGENT_FILE).read_text())  # the training format
    back = load_policy(saved)
    assert back.fmt == AgentFormat(show_admissible=False, system_prompt="Play.") and back.context == 512


def test_garbage_agent_json_is_refused_naming_it(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / AGENT_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match=rf"{E(d / AGENT_FILE)}: content changed since it was saved.*dvc repro sft"):
        load_policy(d)
    # even with a manifest that agrees (rewritten by hand), the parse error names the file
    write_manifest(d, MANIFEST_FILE, POLICY_KIND, POLICY_FORMAT, json.loads((saved / MANIFEST_FILE).read_text())["meta"])
    with pytest.raises(ArtifactError, match=rf"{E(d / AGENT_FILE)}: agent format file is not valid JSON \(.*line 1 column 2\)"):
        load_policy(d)
    (d / AGENT_FILE).write_text(json.dumps({"format": {"version": "v2"}, "context": 512}))
    write_manifest(d, MANIFEST_FILE, POLICY_KIND, POLICY_FORMAT, {})
    with pytest.raises(ArtifactError, match=rf"{E(d / AGENT_FILE)}: agent format file does not match its schema "
                                            r"\(format\.system_prompt: Field required"):
        load_policy(d)


def test_a_deleted_agent_json_is_refused_not_defaulted(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / AGENT_FILE).unlink()
    with pytest.raises(MissingArtifactError, match=rf"{E(d / AGENT_FILE)}: missing \(listed in .*{MANIFEST_FILE}\); "
                                                   "rebuild it with `dvc repro sft`"):
        load_policy(d)
    (d / MANIFEST_FILE).unlink()  # and without its manifest: config.json still marks it as agentkiln's
    with pytest.raises(FileNotFoundError, match=rf"{E(d / MANIFEST_FILE)}: missing: .* saved agentkiln policy"):
        load_policy(d)


def test_weights_overwritten_with_finite_garbage_are_refused(saved, tmp_path):
    d = copy(saved, tmp_path)
    weights = load_file(d / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=gen) for k, v in weights.items()}, d / "model.safetensors",
              metadata={"format": "pt"})  # same names, shapes, dtype: it would load and train on silently
    with pytest.raises(ArtifactError, match=rf"{E(d / 'model.safetensors')}: content changed since it was saved"):
        load_policy(d)


def test_a_damaged_manifest_is_named(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / MANIFEST_FILE).write_text("[1, 2")
    with pytest.raises(ArtifactError, match=rf"{E(d / MANIFEST_FILE)}: manifest of .* is not valid JSON"):
        load_policy(d)
    m = json.loads((saved / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps(m | {"format_version": 99}))
    with pytest.raises(ArtifactError, match=rf"{E(d)}: saved in agentkiln-policy format 99, this agentkiln reads format 1"):
        load_policy(d)


def test_a_plain_hugging_face_directory_still_loads_with_the_given_format(tmp_path):
    pol = build_scratch_policy(TINY, TEXTS, AgentFormat(), seed=0)
    pol.model.save_pretrained(tmp_path / "hf")
    pol.tokenizer.save_pretrained(tmp_path / "hf")
    assert load_policy(tmp_path / "hf", AgentFormat(native_tools=True)).fmt.native_tools


def test_report_json_is_read_through_one_checked_reader(tmp_path):
    from agentkiln.stages.promote import read_reports

    reports = tmp_path / "reports"
    reports.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{E(reports / 'metrics.json')}: evaluation metrics missing; "
                                                r"run the evaluate stage first \(dvc repro evaluate\)"):
        read_reports(reports)
    (reports / "metrics.json").write_text('{"rl": {"success": 0.5,')
    (reports / "outcomes.json").write_text(json.dumps({"panels": {"test": "abc"}, "outcomes": {"rl": {"test": {"t1": 1}}}}))
    with pytest.raises(ArtifactError, match=rf"{E(reports / 'metrics.json')}: evaluation metrics is not valid JSON"):
        read_reports(reports)
    (reports / "metrics.json").write_text(json.dumps({"rl": {"success": 2.0, "n_tasks": 3}}))
    with pytest.raises(ArtifactError, match=r"metrics\.json: evaluation metrics does not match its schema "
                                            r"\(rl\.success = 2\.0: Input should be less than or equal to 1"):
        read_reports(reports)
    metrics = {"rl": {"success": 0.5, "ci_low": 0.2, "ci_high": 0.8, "n_tasks": 3, "by_family": {}}}
    (reports / "metrics.json").write_text(json.dumps(metrics))
    assert read_reports(reports)[0] == metrics  # the file as written, not a re-dumped model
    (reports / "outcomes.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ArtifactError, match=rf"{E(reports / 'outcomes.json')}: per-task outcomes is not valid JSON"):
        read_reports(reports)


def test_read_json_names_the_file_and_line(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{\n  "a": 1,\n  "b": \n}')
    with pytest.raises(ArtifactError, match=rf"{E(f)}: JSON file is not valid JSON \(Expecting value at line 4 column 1\)"):
        read_json(f)


def test_a_damaged_training_checkpoint_is_refused_naming_it(tmp_path):
    from agentkiln.trainers import checkpoint

    ckpt = tmp_path / "models" / "checkpoints" / "sft"
    checkpoint.save(ckpt, "run-key", {"done": 1})
    assert checkpoint.load(ckpt, "run-key")["done"] == 1
    assert checkpoint.load(ckpt, "another-run") is None  # another run's checkpoint is not resumed
    (ckpt / checkpoint.STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match=rf"{E(ckpt / checkpoint.STATE_FILE)}: unreadable checkpoint.*delete"):
        checkpoint.load(ckpt, "run-key")
