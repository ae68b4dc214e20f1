"""A real model on real hardware is a change of params (issue 14): the GPU bench, one RL iteration on
the device, and the GPU params profile.

- bench/gpu_rl.py (writing every number it promises) and bench/async_speed.py --shape run end to end
  on a CPU at the tiny shape, in this process through their `main`, so the scripts cannot rot;
- one RL iteration (collect -> prepare -> update through `train_rl`) of a tiny Qwen2 model in bf16
  with gradient checkpointing: on the CPU always, on CUDA where there is one (`gpu` marker, skipped
  automatically without a CUDA device);
- scripts/apply_profile.py applies profiles/gpu-qwen2.5.yaml to params.yaml: the result loads with
  agentkiln.config, every override landed, everything else and every comment is kept, and a result
  that does not validate is never written.
"""

import importlib.util
import json
import math

import pytest
import torch

from agentkiln.config import ComputeParams, RLParams, load_params, read_yaml
from agentkiln.policy import load_policy
from agentkiln.trainers.rl import train_rl
from tests.conftest import ROOT, apply_profile_script, make_chat_model, task_texts

PROFILE = ROOT / "profiles" / "gpu-qwen2.5.yaml"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


def _bench(name: str):
    """A script of bench/ as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- the bench
def test_gpu_bench_runs_on_cpu_at_the_tiny_shape_and_reports_every_number(tmp_path):
    out = tmp_path / "gpu_rl_tiny_cpu.json"
    threads = torch.get_num_threads()
    try:  # in this process (torch already imported), as `python bench/gpu_rl.py ...` runs it
        _bench("gpu_rl").main(["--shape", "tiny", "--device", "cpu", "--dtype", "bf16", "--threads", "2", "--tasks", "2",
                               "--group-size", "2", "--max-turns", "2", "--max-reply-tokens", "4", "--batch", "2",
                               "--prompt-len", "16", "--new-tokens", "4", "--train-len", "32", "--micro-batch", "2",
                               "--steps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["settings"]["device"] == "cpu" and r["settings"]["dtype"] == "bf16"
    assert r["machine"]["torch"] == torch.__version__ and r["machine"]["device_name"]
    assert r["model"]["params"] > 0 and r["model"]["vocab_size"] >= r["model"]["tokenizer_vocab"]
    ro, up = r["agentkiln"]["rollout"], r["agentkiln"]["update"]
    gen, train = r["raw_hf"]["generate"], r["raw_hf"]["train"]
    # free decoding: a reply ends at its 4-token budget (or, rarely, at a sampled end-of-turn token)
    assert ro["episodes"] == 4 and ro["turns"] == 4 * 2 and ro["turns"] <= ro["generated_tokens"] <= 4 * 2 * 4
    for phase, keys in [(ro, ["tokens_per_s", "generated_tokens_per_s", "peak_mem_gb"]),
                        (up, ["tokens_per_s", "reply_tokens_per_s", "peak_mem_gb"]),
                        (gen, ["new_tokens_per_s", "tokens_per_s", "peak_mem_gb"]),
                        (train, ["tokens_per_s", "peak_mem_gb"])]:
        for k in keys:
            assert phase[k] > 0, (k, phase)
        assert phase["mfu"] is None  # no peak FLOPs on a CPU
    assert math.isfinite(up["loss"]) and math.isfinite(train["loss"]) and r["update_vs_raw_train"] > 0
    assert r["reference"]["device"].startswith("NVIDIA H100")


def test_async_bench_runs_at_a_model_shape_on_cpu(tmp_path):
    """bench/async_speed.py's GPU mode (random-init shape, PPO, rollout thread) at the tiny shape."""
    out = tmp_path / "async_tiny.json"
    threads = torch.get_num_threads()
    try:  # in this process (torch already imported): the bench's own params.yaml from the repository root
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ROOT)
            _bench("async_speed").main(["--shape", "tiny", "--device", "cpu", "--iterations", "2", "--tasks-per-iter", "1",
                        "--max-reply-tokens", "4", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["algorithm"] == "ppo" and r["worker"] == "thread"
    modes = r["modes"]
    assert set(modes) == {"sync", "async", "async_none"}
    for m in modes.values():
        assert m["iterations"] == 2 and m["episodes"] == 2 * 8 and m["episodes_per_s"] > 0
    assert "staleness" not in modes["sync"] and modes["async"]["staleness"] == [0, 1]
    assert r["speedup"] == pytest.approx(modes["async"]["episodes_per_s"] / modes["sync"]["episodes_per_s"], abs=1e-3)


def test_mfu_peak_table_and_reference_numbers():
    bench = _bench("gpu_rl")
    peak = dict(bench.PEAK_BF16_TFLOPS)
    assert next(v for k, v in bench.PEAK_BF16_TFLOPS if k in "NVIDIA H100 80GB HBM3") == 989.0
    assert next(v for k, v in bench.PEAK_BF16_TFLOPS if k in "NVIDIA H100 PCIe") == peak["H100 PCIe"]
    # the reference's MFU is 6 N tokens/s over 989 TFLOP/s with N the 0.5B shape's parameters (494M)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**bench.SHAPES["0.5b"], **bench.QWEN_COMMON))
    n = sum(p.numel() for p in model.parameters())
    assert 494e6 < n < 494.1e6
    ref = bench.REFERENCE["0.5b"]["raw_train"]
    assert bench.mfu(6 * n, ref["tokens_per_s"], 989.0) == pytest.approx(ref["mfu"], abs=0.005)


# --------------------------------------------------------------------------- one RL iteration on the device
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_one_rl_iteration_in_bf16_on_the_device(device, lake_pool, tmp_path):
    tasks, tasks_dir = lake_pool
    model_dir = make_chat_model(tmp_path / "qwen2", "qwen2", task_texts(tasks, tasks_dir))
    compute = ComputeParams(device=device, dtype="bf16", gradient_checkpointing=True)
    policy = load_policy(model_dir, compute=compute)
    assert policy.device.type == device and policy.dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    # a random policy on FrozenLake: some episodes fall in a hole, some run out of turns (penalised),
    # a few win, so GRPO's groups carry signal
    p = RLParams(algorithm="grpo", iterations=1, tasks_per_iter=4, group_size=8, max_turns=6, episode_budget=None,
                 reward={"truncation": {"weight": 0.5}}, minibatch_size=16, micro_batch_size=8, lr=1e-3, kl_coef=0.0,
                 checkpoint_every=0)
    history = train_rl(policy, None, tasks, tasks_dir, p, seed=0)
    assert len(history) == 1 and history[0]["episodes"] == 32
    row = history[0]
    assert "loss" in row, f"no update ran (every group flat?): {row}"
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in policy.model.named_parameters())
    assert moved > 0
    assert all(p.dtype == torch.float32 and p.device.type == device for p in policy.model.parameters())


# --------------------------------------------------------------------------- the GPU profile
def _dotted(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def test_the_gpu_profile_applies_to_params_yaml_validated_with_comments_kept(tmp_path):
    ap = apply_profile_script()
    model_dir = make_chat_model(tmp_path / "Qwen2.5-0.5B-Instruct", "qwen2", ["go north", "take the red key"])
    original = (ROOT / "params.yaml").read_text()
    params = tmp_path / "params.yaml"
    params.write_text(original)
    assert ap.main([str(PROFILE), "--set", f"sft.model.source={model_dir}", "--params", str(params)]) == 0
    loaded = load_params(params)  # validated by the pipeline's own loader
    assert loaded.compute.device == "cuda" and loaded.compute.dtype == "bf16" and loaded.compute.gradient_checkpointing
    assert loaded.sft.model.source == str(model_dir) and loaded.rl.stage("main").lora.enabled
    # every override of the profile landed (the --set one after it), and nothing else changed
    profile = read_yaml(PROFILE.read_text())
    overrides = ap.leaves(profile) + [(("sft", "model", "source"), str(model_dir))]
    dumped = loaded.model_dump()
    for path, value in overrides:
        if path != ("sft", "model", "source"):  # the profile's placeholder, replaced by --set
            assert _dotted(dumped, path) == value, path
    expected = read_yaml(original)
    for path, value in overrides:
        ap.set_path(expected, path, value)
    assert read_yaml(params.read_text()) == expected
    # comments and layout kept: every comment of params.yaml is still there, and lines not overridden are unchanged
    text = params.read_text()
    comments = [line.split("#", 1)[1] for line in original.splitlines() if "#" in line]
    assert all(c in text for c in comments)
    assert len(text.splitlines()) == len(original.splitlines())
    assert "device: cuda                 # auto (cuda when there is one, else cpu)" in text


def test_a_profile_result_that_does_not_validate_is_not_written(tmp_path, capsys):
    ap = apply_profile_script()
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    before = params.read_text()
    # the profile's placeholder model directory is not there: named, and params.yaml is unchanged
    assert ap.main([str(PROFILE), "--set", f"sft.model.source={tmp_path / 'no-model'}", "--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "sft.model.source" in err and "does not exist" in err and params.read_text() == before
    assert ap.main(["--set", "compute.devcie=cuda", "--params", str(params)]) == 1
    assert "compute.devcie: unknown key" in capsys.readouterr().err and params.read_text() == before
    assert ap.main(["--set", "compute.device", "--params", str(params)]) == 2  # no `=`


def test_set_overrides_inside_flow_mappings_new_keys_and_the_whole_file_fallback(tmp_path, monkeypatch):
    ap = apply_profile_script()
    original = (ROOT / "params.yaml").read_text()
    sets = [ap.parse_set(s) for s in ["rl.stages.main.max_turns=8", "synthesize.task_types.coin_easy.level=medium",
                                      "rl.defaults.decoding={default: free}", "rl.defaults.lr=1e-4"]]
    text, merged, kept = ap.apply(original, sets)
    assert kept and read_yaml(text) == merged
    assert "    main: {init: sft, mix: {cooking: 1, frozenlake_easy: 1, frozenlake_5: 1}, max_turns: 8}" in text
    assert merged["rl"]["defaults"]["lr"] == 1e-4
    # a key the section lacks is added to it
    text, merged, kept = ap.apply(original.replace("    tis_cap: null", "    # (tis_cap left out)"),
                                  [ap.parse_set("rl.defaults.tis_cap=2.0")])
    assert kept and merged["rl"]["defaults"]["tis_cap"] == 2.0 and read_yaml(text) == merged
    # when an edit cannot be made in place, the file is written whole under a header that says so
    monkeypatch.setattr(ap, "edit", lambda *a: (_ for _ in ()).throw(ap.ProfileError("no")))
    text, merged, kept = ap.apply(original, sets)
    assert not kept and text.startswith(ap.HEADER) and read_yaml(text) == merged
