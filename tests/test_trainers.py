"""Trainers on a tiny model: SFT fits expert actions; one RL step moves probability toward the
positive-advantage action; save/load round-trips the policy and its prompt format."""

import torch

from agentkiln.config import ModelParams, RLParams
from agentkiln.policy import AgentFormat, build_prompt, build_scratch_policy, load_policy, save_policy
from agentkiln.rollout.agents import AgentState, PolicyAgent
from agentkiln.trainers.batch import Sample, make_batch, reply_logprobs
from agentkiln.trainers.rl import TurnSample, update
from agentkiln.trainers.supervised import OptimConfig, samples_from_states, train_supervised

ACTIONS = ["go east", "go west", "take coin"]
TINY = ModelParams(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_context=128)


def policy(seed=0):
    corpus = [build_prompt(AgentFormat(), "find the coin", ["go east"], f"room {w}", ACTIONS) for w in ("a", "b", "c")]
    return build_scratch_policy(TINY, corpus, AgentFormat(history=1), seed=seed)


def test_sft_learns_the_expert_mapping():
    torch.manual_seed(0)
    pol = policy()
    # observation word decides the action: a -> go east, b -> go west, c -> take coin
    pairs = [(AgentState("find the coin", [], f"room {w}", ACTIONS), a) for w, a in zip("abc", ACTIONS)] * 8
    samples = samples_from_states(pol, pairs)
    cfg = OptimConfig(epochs=30, batch_size=8, lr=1e-2, weight_decay=0.0, warmup_steps=2, max_grad_norm=1.0)
    hist = train_supervised(pol, samples, cfg, seed=0)
    assert hist[-1]["loss"] < 0.2 * hist[0]["loss"]
    states = [p[0] for p in pairs[:3]]
    assert [g.action for g in PolicyAgent(pol, greedy=True).act(states)] == ACTIONS


def test_rl_step_raises_logprob_of_positive_advantage_action():
    torch.manual_seed(0)
    pol, ref = policy(), policy()
    state = AgentState("find the coin", [], "room a", ACTIONS)
    gens = PolicyAgent(pol, seed=0, temperature=1.0).act([state] * 16)
    good = gens[0].action
    adv_per = [1.0 if g.action == good else -1.0 for g in gens]
    samples = [TurnSample(Sample(g.prompt_ids, g.ids, g.allowed), g.logprobs, [a] * len(g.ids)) for g, a in zip(gens, adv_per)]
    vocab = len(pol.tokenizer)
    batch = make_batch([samples[0].sample], pol.pad_id, vocab)
    before = float(reply_logprobs(pol.model, batch)[0].sum())
    opt = torch.optim.AdamW(pol.model.parameters(), lr=1e-2)
    stats = update(pol, ref, None, samples, RLParams(minibatch_size=16), opt, None, torch.Generator().manual_seed(0))
    after = float(reply_logprobs(pol.model, batch)[0].sum())
    assert after > before
    assert {"loss", "kl", "clip_frac", "entropy", "grad_norm"} <= set(stats)


def test_save_and_load_round_trip(tmp_path):
    pol = policy()
    save_policy(pol, tmp_path / "p")
    back = load_policy(tmp_path / "p")
    assert back.fmt == pol.fmt
    assert back.tokenizer.encode("go east") == pol.tokenizer.encode("go east")
    s = AgentState("find the coin", [], "room a", ACTIONS)
    a = PolicyAgent(pol, greedy=True).act([s])[0]
    b = PolicyAgent(back, greedy=True).act([s])[0]
    assert a.ids == b.ids and abs(a.logprobs[0] - b.logprobs[0]) < 1e-5
