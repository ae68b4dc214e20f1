"""Real chat models by params: tiny random-init Qwen2- and Llama-architecture models with a byte-level
BPE tokenizer and their families' chat templates, built in a temporary directory (nothing from a hub).

Token-in/token-out across several turns: the ids trained on are exactly the ids generated plus the
observation ids as appended; re-tokenizing the rendered conversation instead drifts (non-canonical
BPE of sampled text; templates that strip <think> from past turns). Then SFT -> RL -> evaluate
through the stage functions with free-form replies, and the tokenizer check at load."""

import json

import pytest
import torch

from agentkiln.envs import env_class
from agentkiln.policy import AgentFormat, load_policy
from agentkiln.policy.prompt import observation_text, parse_reply, render_action
from agentkiln.policy.tokenizer import TokenizerError
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.sequence import render
from agentkiln.stages.common import load_split
from agentkiln.stages.evaluate import run_evaluate
from agentkiln.stages.rl import run_rl
from agentkiln.stages.sft import run_sft
from agentkiln.trainers.batch import build_batch, token_logprobs

from tests.conftest import (QWEN3_LIKE_TEMPLATE, expert_episodes, make_chat_model, params_with, task_texts,
                            tiny_dataset)

MIX = {"frozenlake_easy": 1.0, "sql_easy": 1.0}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tasks_dir = tiny_dataset(root / "tasks", {"sft": MIX, "rl": MIX, "test": MIX}, {"sft": 8, "rl": 4, "test": 4})
    texts = task_texts(load_split(tasks_dir, "sft"), tasks_dir)
    models = {arch: make_chat_model(root / arch, arch, texts) for arch in ("qwen2", "llama")}
    return root, tasks_dir, models


def messages(policy, ep: Episode) -> list[dict]:
    """The conversation of `ep` as chat messages (what a re-rendering pipeline would keep)."""
    out = [{"role": "system", "content": policy.fmt.system_prompt}] if policy.fmt.system_prompt else []
    for k, t in enumerate(ep.turns):
        out.append({"role": "user", "content": observation_text(policy.fmt, t.observation, t.admissible,
                                                                  ep.goal if k == 0 else None)})
        out.append({"role": "assistant", "content": policy.chat.decode(ep.ids[t.start : t.end])})
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_token_in_token_out_across_turns_on_a_bpe_chat_model(world, arch):
    _, tasks_dir, models = world
    policy = load_policy(models[arch])
    tasks = load_split(tasks_dir, "rl")
    eps = run_episodes(PolicyAgent(policy, temperature=1.0, seed=0, decoding={"default": "free"}, max_reply_tokens=6),
                       tasks, tasks_dir, max_turns=4, group_size=2)
    assert max(len(ep.turns) for ep in eps) >= 3  # several turns (a random model's replies are invalid)
    batch = build_batch(eps, policy.pad_id)
    generated = [tok for ep in eps for t in ep.turns for tok in ep.ids[t.start : t.end]]
    assert batch.flat(batch.input_ids).tolist() == generated  # the trained ids are the generated ids
    logp, _ = token_logprobs(policy.model, batch)
    assert torch.allclose(logp, batch.flat(batch.old_logp), atol=1e-5)
    drift = 0
    for ep in eps:
        # the sequence is the pieces appended turn by turn, and nothing else
        pieces = policy.chat.start(observation_text(policy.fmt, ep.turns[0].observation, ep.turns[0].admissible, ep.goal))
        for k, t in enumerate(ep.turns):
            if k:
                prev = ep.ids[ep.turns[k - 1].end - 1]
                pieces += ([] if prev in policy.chat.stop_ids else [policy.chat.end_id])
                pieces += policy.chat.observation(observation_text(policy.fmt, t.observation, t.admissible))
            pieces += ep.ids[t.start : t.end]
        assert pieces == ep.ids
        # as text, the sequence is the template's rendering of the same conversation (a reply cut at its
        # budget gets the end-of-turn token the template writes; Llama's template trims contents)
        rendered = policy.tokenizer.apply_chat_template(messages(policy, ep), tokenize=False)
        closed = ep.ids + ([] if ep.ids[-1] in policy.chat.stop_ids else [policy.chat.end_id])
        text = policy.tokenizer.decode(closed)
        if arch == "qwen2":
            assert text == rendered.removesuffix("\n")
        else:
            assert " ".join(text.split()) == " ".join(rendered.split())
        drift += policy.tokenizer.encode(rendered, add_special_tokens=False) != ep.ids
    assert drift, "re-tokenizing sampled text should differ from the generated ids somewhere"


def test_a_template_that_strips_reasoning_would_change_history_but_not_our_ids(world, tmp_path):
    root, tasks_dir, _ = world
    texts = task_texts(load_split(tasks_dir, "sft"), tasks_dir)
    policy = load_policy(make_chat_model(tmp_path / "q3", "qwen2", texts, template=QWEN3_LIKE_TEMPLATE))
    task = next(t for t in load_split(tasks_dir, "sft") if t.family == "gym-toytext")
    from agentkiln.envs import make

    env = make(task, tasks_dir)
    obs = env.reset()
    text = Episode(task.task_id, task.family, 0, goal=env.goal)
    for _ in range(3):  # replies reason first, then act
        action = env.expert_action()
        text.turns.append(Turn(obs.text, obs.admissible, obs.anchor, action=f"<think>go to the goal</think>{action}"))
        obs = env.step(action).observation
    ep = render(policy, text, 32)
    assert [parse_reply(t.action) for t in text.turns] == [parse_reply(policy.chat.decode(ep.ids[t.start:t.end]))
                                                          for t in ep.turns]
    for t in ep.turns:  # every turn keeps its reasoning tokens
        assert "<think>" in policy.tokenizer.decode(ep.ids[t.start : t.end])
    msgs = messages(policy, ep)
    rerendered = policy.tokenizer.encode(policy.tokenizer.apply_chat_template(msgs, tokenize=False),
                                         add_special_tokens=False)
    assert rerendered != ep.ids and len(rerendered) < len(ep.ids)  # history re-rendered without <think>


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sft_rl_evaluate_on_a_local_chat_model(world, arch, tmp_path):
    root, tasks_dir, models = world
    params = params_with({
        "sft": {"model": {"source": str(models[arch]), "max_context": 1024}, "epochs": 2, "batch_size": 4},
        "rl": {"defaults": {"algorithm": "grpo", "iterations": 2, "tasks_per_iter": 2, "group_size": 2, "max_turns": 3,
                            "episode_budget": None, "dynamic_sampling": False, "decoding": {"default": "free"},
                            "max_reply_tokens": 8, "minibatch_size": 4, "micro_batch_size": 2,
                            "select": {"panel": None}},  # these splits have no val: the last weights
               "stages": {"main": {"init": "sft"}}},
        "evaluate": {"policies": ["random", "sft", "rl"], "compare": [["rl", "sft"]], "max_turns": 3,
                     "decoding": {"default": "free"}, "max_reply_tokens": 8,
                     "pass_k": {"samples": 2, "policies": ["rl"]}},
        "promote": {"candidates": ["rl", "sft"]},  # only evaluated policies can be candidates
    })
    sft = run_sft(params, tasks_dir, tmp_path / "sft")
    assert sft["n_episodes_clean"] == 8 and sft["final_loss"] > 0
    saved = json.loads((tmp_path / "sft" / "agent.json").read_text())
    assert saved["context"] == 1024
    rl = run_rl(params, "main", tasks_dir, tmp_path / "sft", tmp_path / "rl", tmp_path / "reports")
    assert rl["iterations"] == 2 and rl["episodes"] == 8
    assert (tmp_path / "reports" / "curve.csv").is_file()
    metrics = run_evaluate(params, tasks_dir, {"sft": tmp_path / "sft", "rl": tmp_path / "rl"}, tmp_path / "eval")
    assert set(metrics) == {"random", "sft", "rl"} and metrics["rl"]["n_tasks"] == 4
    assert metrics["rl"]["tokens_per_episode"] > 0 and "1" in metrics["rl"]["pass_at_k"]
    back = load_policy(tmp_path / "rl")  # the trained directory loads as the same kind of model
    assert type(back.model).__name__ == type(load_policy(models[arch]).model).__name__


def test_a_tokenizer_that_cannot_encode_the_task_text_stops_the_run(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # the trap seen with transformers 5.17-5.23: a word-level tokenizer.json under a qwen2 config
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["go north take the key"], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(tmp_path / "trap")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "trap")
    with pytest.raises(TokenizerError, match=str(tmp_path / "trap")):
        load_policy(tmp_path / "trap")


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        load_policy(tmp_path / "nope")


def test_native_tool_calls_and_reasoning_are_parsed_into_the_familys_actions(world):
    _, tasks_dir, models = world
    policy = load_policy(models["qwen2"], fmt=AgentFormat(native_tools=True))
    tools = env_class("sql").tool_specs()
    reply = render_action(policy.fmt, "sql[SELECT name FROM employees]", tools)
    assert reply.startswith("<tool_call>") and '"query": "SELECT name FROM employees"' in reply
    assert parse_reply(reply) == "sql[SELECT name FROM employees]"
    assert parse_reply(f"<think>the name is in employees</think>{reply}") == "sql[SELECT name FROM employees]"
    assert parse_reply("<think>still thinking") == ""  # an unclosed thought carries no action
    assert parse_reply('<tool_call>{"name": "answer", "arguments": {"value": 42}}</tool_call>') == "answer[42]"
    assert parse_reply("<tool_call>not json</tool_call>") == "<tool_call>not json</tool_call>"  # left to the env
    # the template renders the family's tool schemas into the system prompt of the first message
    start = policy.tokenizer.decode(policy.chat.start("How many employees?", tools))
    assert "<tools>" in start and '"name": "sql"' in start
    # an SQL expert episode rendered with native tool calls: the replies are the template's tool calls
    task = next(t for t in load_split(tasks_dir, "sft") if t.family == "sql")
    ep = render(policy, expert_episodes([task], tasks_dir)[0], 96, tools)
    replies = [policy.chat.decode(ep.ids[t.start : t.end]) for t in ep.turns]
    assert all(r.startswith("<tool_call>") for r in replies)
    assert [parse_reply(r) for r in replies] == [t.action for t in ep.turns]
