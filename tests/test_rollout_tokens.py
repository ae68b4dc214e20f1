"""Token invariants: what is trained on is exactly what was generated; prompt tokens carry no loss;
constrained decoding only ever produces admissible actions."""

import torch

from agentkiln.config import ModelParams
from agentkiln.policy import AgentFormat, build_prompt, build_scratch_policy
from agentkiln.rollout.agents import AgentState, PolicyAgent, RandomAgent
from agentkiln.rollout.constrained import ActionTrie
from agentkiln.trainers.batch import Sample, make_batch, reply_logprobs

ACTIONS = ["go east", "go west", "take coin", "take coin from floor", "open door"]
TINY = ModelParams(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_context=128)


def tiny_policy(seed=0):
    corpus = [build_prompt(AgentFormat(), "find the coin", ["go east"], "a room with a door", ACTIONS)]
    return build_scratch_policy(TINY, corpus, AgentFormat(history=2), seed=seed)


def states(n):
    return [AgentState("find the coin", ["go east"] * (i % 3), "a room with a door", ACTIONS[: 2 + i % 4]) for i in range(n)]


def test_trie_allows_prefix_continuations_and_maps_back():
    trie = ActionTrie({"take coin": [5, 6, 3], "take coin from floor": [5, 6, 7, 8, 3], "go": [9, 3]})
    assert trie.allowed([]) == [5, 9]
    assert trie.allowed([5, 6]) == [3, 7]  # end here, or continue to the longer action
    assert trie.action([5, 6, 7, 8, 3]) == "take coin from floor"


def test_generated_actions_are_admissible_and_ids_are_kept():
    policy = tiny_policy()
    agent = PolicyAgent(policy, temperature=1.5, seed=1)
    st = states(12)
    gens = agent.act(st)
    for s, g in zip(st, gens):
        assert g.action in s.admissible
        assert g.ids == policy.encode_action(g.action)  # the exact ids, ending with EOS
        assert g.ids[-1] == policy.eos_id
        assert all(t in allowed for t, allowed in zip(g.ids, g.allowed))


def test_trained_logprobs_equal_rollout_logprobs_and_prompt_has_no_loss():
    policy = tiny_policy()
    gens = PolicyAgent(policy, temperature=1.0, seed=2).act(states(6))
    samples = [Sample(g.prompt_ids, g.ids, g.allowed) for g in gens]
    batch = make_batch(samples, policy.pad_id, len(policy.tokenizer))
    # the trained tokens are exactly the generated ones, in order
    assert batch.targets.tolist() == [t for g in gens for t in g.ids]
    for b, c, t in zip(batch.rows.tolist(), batch.cols.tolist(), batch.targets.tolist()):
        assert c + 1 >= len(samples[b].prompt_ids)  # only reply positions are targets
        assert batch.input_ids[b, c + 1] == t
    logp, _ = reply_logprobs(policy.model, batch)
    assert torch.allclose(logp, torch.tensor([x for g in gens for x in g.logprobs]), atol=1e-5)
    # prompt positions carry zero loss weight: the loss gradient w.r.t. their logits is exactly zero
    logits_grad = {}
    model = policy.model

    def keep_grad(module, inputs, output):
        output.register_hook(lambda grad: logits_grad.setdefault("g", grad))

    h = model.lm_head.register_forward_hook(keep_grad)
    logp, _ = reply_logprobs(model, batch)
    (-logp.mean()).backward()
    h.remove()
    g = logits_grad["g"]
    trained = torch.zeros(g.shape[:2], dtype=torch.bool)
    trained[batch.rows, batch.cols] = True
    assert g[~trained].abs().max() == 0


def test_same_seed_same_actions_and_greedy_is_deterministic():
    policy = tiny_policy()
    a = [g.action for g in PolicyAgent(policy, seed=7).act(states(16))]
    b = [g.action for g in PolicyAgent(policy, seed=7).act(states(16))]
    assert a == b
    g1 = [g.action for g in PolicyAgent(policy, greedy=True).act(states(8))]
    g2 = [g.action for g in PolicyAgent(policy, greedy=True, batch_size=3).act(states(8))]
    assert g1 == g2  # batching and padding do not change greedy choices


def test_random_agent_is_seeded_and_admissible():
    st = states(20)
    a = [g.action for g in RandomAgent(3).act(st)]
    assert a == [g.action for g in RandomAgent(3).act(st)]
    assert all(x in s.admissible for x, s in zip(a, st))


def test_free_generation_keeps_ids_and_trains_on_exactly_them():
    pol = tiny_policy()
    gens = PolicyAgent(pol, seed=3, decoding="free").act(states(6))
    for g in gens:
        assert g.allowed is None and 1 <= len(g.ids) <= 16 and len(g.logprobs) == len(g.ids)
        assert g.action == pol.tokenizer.decode([t for t in g.ids if t != pol.eos_id], skip_special_tokens=True).strip()
    batch = make_batch([Sample(g.prompt_ids, g.ids, g.allowed) for g in gens], pol.pad_id, len(pol.tokenizer))
    assert batch.allowed is None  # the whole vocabulary, as sampled
    logp, _ = reply_logprobs(pol.model, batch)
    assert torch.allclose(logp, torch.tensor([x for g in gens for x in g.logprobs]), atol=1e-5)
    assert batch.targets.tolist() == [t for g in gens for t in g.ids]
