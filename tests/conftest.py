"""Test-wide settings: offline, no telemetry, Prefect and MLflow state in a temporary directory.

Set before any library import (pytest imports conftest first)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Processes a test spawns (DeepSpeed ranks, rollout processes, findings workers) import this module
# again to unpickle what they run: they keep the session's directory and the Prefect / MLflow settings
# their parent handed them, instead of making (and leaking) a directory of their own.
# Under pytest-xdist (scripts/test.sh runs two workers) each worker owns its own directory, so its
# Prefect server's database and its MLflow store are its own: workers inherit the controller's
# environment, hence a variable per worker.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_TMP_VAR = "AGENTKILN_TESTS_TMP" + (f"_{_WORKER.upper()}" if _WORKER else "")
_OWNER = _TMP_VAR not in os.environ
_TMP = Path(tempfile.mkdtemp(prefix="agentkiln-tests-")) if _OWNER else Path(os.environ[_TMP_VAR])
os.environ.update(
    {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TQDM_DISABLE": "1",
    }
)
if _OWNER:
    os.environ.update({_TMP_VAR: str(_TMP), "PREFECT_HOME": str(_TMP / "prefect"),
                       "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}"})
# One CPU instruction set for torch's kernels on every x86 machine (AVX2, as on the machines the
# learning tests were calibrated on): AVX-512 kernels round differently, and a tiny model's RL
# trajectory then takes another path. Read before torch's first kernel runs.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# Idle OpenMP threads sleep instead of spinning: two xdist workers, each at the 2 torch threads the
# learning tests pin, on a 2-core machine would otherwise burn each other's cores (measured: two copies
# of one RL test at once, 251 s spinning, 79 s passive). The thread count, and so every result, is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Prefect's temporary API server gets 20 s to start by default: not enough on a loaded 2-core machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.pop("AGENTKILN_PARENT_RUN_ID", None)


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(_TMP, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The long modules first (`e2e`, then `slow`; stable otherwise): scripts/test.sh hands whole
    modules to two xdist workers in this order, and a long module dealt last would run alone at the
    end. `gpu`-marked tests run where torch sees a CUDA device and are skipped, saying so, elsewhere."""
    import torch

    rank: dict = {}  # per module, so that a module's tests stay together (its fixtures are set up once)
    for item in items:
        r = 0 if "e2e" in item.keywords else 1 if "slow" in item.keywords else 2
        rank[item.module.__name__] = min(r, rank.get(item.module.__name__, r))
    items.sort(key=lambda item: rank[item.module.__name__])
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------- shared fixtures
import pytest  # noqa: E402

QWEN2_TEMPLATE = (  # Qwen2.5's chat template (tools, tool calls and tool responses included)
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-style: reasoning (<think>...</think>) is stripped from assistant turns before the last user
# message when the conversation is rendered again; a re-tokenised history then differs from the
# ids the model generated (prime-rl#1334)
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _bpe(texts, specials, vocab_size=600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def make_chat_model(out_dir, arch: str, texts, template: str | None = None, seed: int = 0):
    """A tiny random-init Qwen2- or Llama-architecture model with a byte-level BPE tokenizer trained on
    `texts` and a real chat template, saved as a Hugging Face directory (nothing from a hub)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if arch == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
        tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(texts, specials), eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
        tok.chat_template = template or QWEN2_TEMPLATE
        config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        cls = Qwen2ForCausalLM
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(texts, specials), bos_token="<|begin_of_text|>",
                                      eos_token="<|eot_id|>", additional_special_tokens=specials[2:])
        tok.chat_template = template or LLAMA3_TEMPLATE
        config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
        cls = LlamaForCausalLM
    torch.manual_seed(seed)
    cls(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def lake_pool(tmp_path_factory):
    """Six easy FrozenLake tasks (no task files) and their directory."""
    from agentkiln.synthesis.generate import generate

    out = tmp_path_factory.mktemp("lake")
    return generate("gym-toytext", 6, seed=3, level="easy", out_dir=out, game="frozenlake"), out


def task_texts(tasks, tasks_dir) -> list[str]:
    """What an agent is shown at the start of each task, and the valid actions (a tokenizer's corpus)."""
    from agentkiln.envs import make
    from agentkiln.policy import AgentFormat, observation_text

    texts = []
    for t in tasks:
        env = make(t, tasks_dir)
        obs = env.reset()
        texts.append(observation_text(AgentFormat(), obs.text, obs.admissible, env.goal))
        texts += obs.admissible or []
        while (a := env.expert_action()) is not None:
            texts.append(a)
            texts.append(env.step(a).observation.text)
    return texts


ROOT = Path(__file__).resolve().parents[1]


def apply_profile_script():
    """scripts/apply_profile.py as a module (scripts/ is no package): profiles applied as the command does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("apply_profile", ROOT / "scripts" / "apply_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def copy_worktree(dst: Path) -> Path:
    """The repository's files (tracked, and untracked but not ignored) copied to `dst`: a clean checkout
    of the working tree, for tests that run git/DVC on their own copy."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    return dst


def merge(base: dict, over: dict) -> dict:
    """params.yaml-style deep merge: mappings merge key by key, except split mixes and RL stages."""
    for k, v in over.items():
        base[k] = merge(base.get(k, {}), v) if isinstance(v, dict) and k not in ("mix", "stages", "decoding") else v
    return base


def params_with(overrides: dict):
    """The repository's params.yaml with `overrides` merged in, validated."""
    import yaml

    from agentkiln.config import Params

    return Params.model_validate(merge(yaml.safe_load((ROOT / "params.yaml").read_text()), overrides))


def tiny_dataset(out_dir, mixes: dict[str, dict], n: dict[str, int] | None = None, task_types: dict | None = None):
    """Synthesize small sft / rl / test splits of the given task-type mixes under `out_dir` (task
    types of params.yaml, plus `task_types`)."""
    from agentkiln.synthesis.stage import synthesize

    import yaml

    from agentkiln.config import SynthesizeParams

    n = n or {"sft": 8, "rl": 4, "test": 4}
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())["synthesize"]
    raw["workers"] = 1
    raw["task_types"] |= task_types or {}
    raw["splits"] = {name: {"n_tasks": n[name], "seed": 50 + i, "mix": mix} for i, (name, mix) in enumerate(mixes.items())}
    synthesize(SynthesizeParams.model_validate(raw), out_dir, progress=False)
    return out_dir


def expert_episodes(tasks, tasks_dir):
    """Each task's expert walkthrough as a text episode (rollout.sequence.render gives its ids)."""
    from agentkiln.envs import make
    from agentkiln.rollout.episode import Episode, Turn

    out = []
    for g, t in enumerate(tasks):
        env = make(t, tasks_dir)
        obs = env.reset()
        ep = Episode(t.task_id, t.family, g, t.task_type, goal=env.goal)
        while (a := env.expert_action()) is not None:
            ep.turns.append(Turn(obs.text, obs.admissible, obs.anchor, reply=a, action=a))
            obs = env.step(a).observation
        ep.won = env.won
        out.append(ep)
    return out


def scratch_policy(tasks, tasks_dir, seed: int = 0, **sizes):
    """A tiny random-init scratch policy whose tokenizer is trained on the tasks' text."""
    from agentkiln.config import ModelParams
    from agentkiln.policy import AgentFormat, build_scratch_policy

    params = ModelParams(**({"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                             "vocab_size": 400, "max_context": 1024} | sizes))
    return build_scratch_policy(params, task_texts(tasks, tasks_dir), AgentFormat(), seed=seed)


@pytest.fixture(autouse=True)
def _pinned_threads():
    """Every test starts at 2 torch threads, whatever an earlier test set: CPU results (and so the
    learning tests' outcomes) depend on the thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# What points MLflow at a store, process-wide: mlflow.set_tracking_uri / set_registry_uri / set_experiment
# export these for subprocesses, and tracking.setup() reads MLFLOW_TRACKING_URI.
_MLFLOW_STORE_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
                     "MLFLOW_RUN_ID", "AGENTKILN_PARENT_RUN_ID")


def _mlflow_globals() -> tuple | None:
    """MLflow's process-wide store choice and tracking.setup()'s memo, or None while neither module is loaded."""
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    registry = sys.modules.get("mlflow.tracking._model_registry.utils")
    fluent = sys.modules.get("mlflow.tracking.fluent")
    ours = sys.modules.get("agentkiln.tracking")
    if utils is None or registry is None or fluent is None:
        return None
    return (utils._tracking_uri, registry._registry_uri, fluent._active_experiment_id,
            getattr(ours, "_setup_state", None))


@pytest.fixture(autouse=True)
def _mlflow_store_stays_put():
    """Every test ends with MLflow pointing where it pointed when the test began. A test that calls
    mlflow.set_tracking_uri on a store it then stops (the e2e pipeline's MLflow server on CI) would
    otherwise send every later test of its xdist worker to that dead server ("connection refused" in an
    unrelated test, CI of 2026-11-28)."""
    env = {k: os.environ.get(k) for k in _MLFLOW_STORE_ENV}
    before = _mlflow_globals()
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    after = _mlflow_globals()
    if after is not None and after != before:
        tracking_uri, registry_uri, experiment_id, setup_state = before or (None, None, None, None)
        sys.modules["mlflow.tracking._tracking_service.utils"]._tracking_uri = tracking_uri
        sys.modules["mlflow.tracking._model_registry.utils"]._registry_uri = registry_uri
        sys.modules["mlflow.tracking.fluent"]._active_experiment_id = experiment_id
        if "agentkiln.tracking" in sys.modules:
            sys.modules["agentkiln.tracking"]._setup_state = setup_state


def ablation_repo(root):
    """A FrozenLake rl/test split (3 tasks each, sealed manifests) under root/data/tasks and a scratch
    `sft` policy under root/models/sft: what an ablation run reads. Returns the tasks directory."""
    import dataclasses
    import json

    from agentkiln.panels import seal
    from agentkiln.policy import save_policy
    from agentkiln.synthesis.generate import env_version, generate

    tasks_dir = root / "data" / "tasks"
    for split, seed in (("rl", 5), ("test", 6)):
        tasks = generate("gym-toytext", 3, seed=seed, level="easy", out_dir=tasks_dir, game="frozenlake")
        (tasks_dir / split).mkdir(parents=True, exist_ok=True)
        (tasks_dir / split / "manifest.json").write_text(json.dumps(seal(
            {"tasks": [dataclasses.asdict(t) for t in tasks], "env_versions": {"gym-toytext": env_version("gym-toytext")}})))
    save_policy(scratch_policy(tasks, tasks_dir), root / "models" / "sft")
    return tasks_dir


@pytest.fixture(scope="session")
def endpoint_world(tmp_path_factory):
    """FrozenLake (admissible actions) and SQL (a tool family) tasks, and a policy briefly trained on
    their expert episodes (so it wins some and loses some), saved as a policy directory: what the
    endpoint's tests serve."""
    from agentkiln.policy import save_policy
    from agentkiln.stages.sft import render_all
    from agentkiln.synthesis.generate import generate
    from agentkiln.trainers.supervised import OptimConfig, train_supervised

    out = tmp_path_factory.mktemp("endpoint")
    tasks = generate("gym-toytext", 6, seed=3, level="easy", out_dir=out, game="frozenlake") \
        + generate("sql", 3, seed=11, level="easy", out_dir=out)
    policy = scratch_policy(tasks, out, hidden_size=64)
    train_supervised(policy, render_all(policy, expert_episodes(tasks[:4] + tasks[6:8], out)),
                     OptimConfig(40, 2, 3e-3, 0.0, 0, 1.0), seed=0)
    save_policy(policy, out / "policy")
    return tasks, out, out / "policy"
