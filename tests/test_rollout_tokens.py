"""Token invariants of episodes as sequences: what is trained on is exactly what was generated, plus
the observation ids as appended; the KV cache kept across turns gives the same logits as a full
forward; reply tokens alone carry loss; constrained decoding only produces admissible actions;
the window rule for episodes longer than the context."""

import torch

from agentkiln.config import ModelParams
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.rollout.agents import PolicyAgent, RandomAgent, decoding_mode
from agentkiln.rollout.decoding import ActionTrie, sample
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.kv import KVRows, plan_groups
from agentkiln.rollout.sequence import render
from agentkiln.trainers.batch import build_batch, token_logprobs

from tests.conftest import task_texts

TINY = ModelParams(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, vocab_size=400, max_context=1024)


def policy(tasks, tasks_dir, context=1024, seed=0):
    params = TINY.model_copy(update={"max_context": context})
    return build_scratch_policy(params, task_texts(tasks, tasks_dir), AgentFormat(), seed=seed)


def test_trie_allows_prefix_continuations_and_maps_back():
    trie = ActionTrie({"take coin": [5, 6, 3], "take coin from floor": [5, 6, 7, 8, 3], "go": [9, 3]})
    assert trie.allowed([]) == [5, 9]
    assert trie.allowed([5, 6]) == [3, 7]  # end here, or continue to the longer action
    assert trie.action([5, 6, 7, 8, 3]) == "take coin from floor"
    assert trie.action([5, 6]) is None  # a prefix is not an action


def test_kv_rows_match_a_full_forward_through_regrouping_and_restarts():
    torch.manual_seed(0)
    pol = build_scratch_policy(TINY, ["a b c d e f g h"], AgentFormat(), seed=0)
    model = pol.model.eval()
    seqs = [list(range(5, 5 + n)) for n in (30, 3, 9, 1, 17, 2, 25, 4, 11, 6)]
    kv = KVRows(model, pol.pad_id, len(seqs))
    rows = list(range(len(seqs)))
    kv.prepare(rows, [len(s) for s in seqs])
    kv.restarted.add(0)  # force a repack at the next prepare

    def full(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1]

    out = kv.feed({r: s for r, s in enumerate(seqs)})
    assert max((out[r] - full(s)).abs().max() for r, s in enumerate(seqs)) < 1e-5
    live = [r for r in rows if r % 3]  # rows 0, 3, 6, 9 finish; the others decode one more token
    out = kv.step({r: 40 + r for r in live})
    for r in live:
        seqs[r] = seqs[r] + [40 + r]
        assert (out[r] - full(seqs[r])).abs().max() < 1e-5
    kv.restart(4)  # row 4 starts a new window: only its new tokens count
    seqs[4] = []
    kv.prepare(live, [2] * len(live))
    out = kv.feed({r: [60, 61] for r in live})
    for r in live:
        seqs[r] = seqs[r] + [60, 61]
        assert (out[r] - full(seqs[r])).abs().max() < 1e-5


def test_groups_keep_a_long_block_apart_from_short_ones():
    # one restarted window (600 new tokens) among 70-token observations: padding them all to 600
    # would cost more than a second forward call
    groups = plan_groups([600] + [70] * 20, [0] + [900] * 20, hidden=128)
    assert [0] in groups and sorted(j for g in groups for j in g) == list(range(21))
    assert len(plan_groups([70] * 20, [900] * 20, hidden=128)) == 1  # alike rows share one call


def test_episode_ids_are_generated_ids_plus_observation_pieces(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    eps = run_episodes(PolicyAgent(pol, temperature=1.3, seed=1), tasks, tasks_dir, max_turns=5, group_size=2)
    chat = pol.chat
    for ep in eps:
        assert len(ep.windows) == 1 and ep.ids[: ep.prompt_len] == ep.ids[: ep.turns[0].start]
        rebuilt = list(ep.ids[: ep.prompt_len])
        for k, t in enumerate(ep.turns):
            if k:  # the observation piece exactly as the chat template appends it
                rebuilt += chat.observation(f"{t.observation}\nActions: {' | '.join(t.admissible)}")
            assert t.start == len(rebuilt)
            reply = ep.ids[t.start : t.end]
            assert reply == chat.reply(t.action)  # constrained: the admissible action's own ids, end token included
            assert t.action in t.admissible and all(tok in a for tok, a in zip(reply, t.allowed))
            assert len(t.logprobs) == len(reply) == len(t.allowed)
            rebuilt += reply
        assert rebuilt == ep.ids


def test_trained_ids_and_logprobs_are_the_rollouts_and_only_replies_get_gradient(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    for decoding in ({}, {"gym-toytext": "free"}):
        eps = run_episodes(PolicyAgent(pol, temperature=1.0, seed=2, decoding=decoding), tasks, tasks_dir, 4, 2)
        batch = build_batch(eps, pol.pad_id)
        generated = [tok for ep in eps for t in ep.turns for tok in ep.ids[t.start : t.end]]
        assert batch.flat(batch.input_ids).tolist() == generated
        assert batch.flat(batch.old_logp).tolist() == [x for ep in eps for t in ep.turns for x in t.logprobs]
        logp, _ = token_logprobs(pol.model, batch)
        assert torch.allclose(logp, batch.flat(batch.old_logp), atol=1e-5)
        if decoding:  # free: replies are whatever was sampled, up to the family's budget
            assert all(t.allowed is None for ep in eps for t in ep.turns) and batch.allowed.shape[-1] == 0
    # observation and prompt positions carry zero loss weight: their gradient is exactly zero
    emb = pol.model.get_input_embeddings()
    grads = {}

    def keep_grad(module, inputs, output):
        output.last_hidden_state.register_hook(lambda g: grads.setdefault("g", g))

    h = pol.model.get_decoder().register_forward_hook(keep_grad)
    logp, _ = token_logprobs(pol.model, batch)
    (-logp.mean()).backward()
    h.remove()
    g = grads["g"]
    predicts = torch.zeros(g.shape[:2], dtype=torch.bool)
    pos = batch.loss_mask[:, : g.shape[1]].nonzero()
    predicts[pos[:, 0], pos[:, 1] - 1] = True  # hidden state at t-1 predicts reply token t
    assert g[~predicts].abs().max() == 0 and g[predicts].abs().max() > 0
    assert emb.weight.grad is not None


def test_same_seed_same_episodes_and_greedy_does_not_depend_on_batching(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    a = run_episodes(PolicyAgent(pol, seed=7), tasks, tasks_dir, 6, 3)
    b = run_episodes(PolicyAgent(pol, seed=7), tasks, tasks_dir, 6, 3)
    assert [e.ids for e in a] == [e.ids for e in b]
    g1 = run_episodes(PolicyAgent(pol, greedy=True, batch_size=64), tasks, tasks_dir, 6)
    g2 = run_episodes(PolicyAgent(pol, greedy=True, batch_size=2), tasks, tasks_dir, 6)
    assert [e.ids for e in g1] == [e.ids for e in g2]  # chunks, groups and padding change nothing


def test_window_rule_keeps_every_reply_in_the_context_it_was_sampled_in(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir, context=400)
    eps = run_episodes(PolicyAgent(pol, temperature=1.5, seed=3), tasks, tasks_dir, 12, 2)
    multi = [ep for ep in eps if len(ep.windows) > 1]
    assert multi, "the small context should force new windows"
    for ep in multi:
        for w in range(1, len(ep.windows)):
            row = ep.window_ids(w)
            start, stop = ep.windows[w]
            assert row[: ep.prompt_len] == ep.ids[: ep.prompt_len] and row[ep.prompt_len:] == ep.ids[start:stop]
            assert len(row) <= pol.max_context
            first = next(t for t in ep.turns if t.window == w)
            kept = [t for t in ep.turns if t.start >= start and t.window < w]
            assert kept and kept[0].start == start  # it carries whole earlier turns, the latest at least
            assert ep.turns.index(first) == ep.turns.index(kept[-1]) + 1  # then the next reply is generated
    batch = build_batch(eps, pol.pad_id)
    assert batch.rows == sum(len(ep.windows) for ep in eps)
    assert batch.flat(batch.input_ids).tolist() == [tok for ep in eps for t in ep.turns for tok in ep.ids[t.start:t.end]]
    logp, _ = token_logprobs(pol.model, batch, temperature=1.5)
    assert torch.allclose(logp, batch.flat(batch.old_logp), atol=1e-5)  # scored in its own window


def test_an_observation_that_cannot_fit_cuts_the_episode(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    first = max(len(run_episodes(PolicyAgent(pol, greedy=True), [t], tasks_dir, 1)[0].ids) for t in tasks[:2])
    pol.context = first + 16 + 8  # the first message and a reply fit; no observation after them does
    eps = run_episodes(PolicyAgent(pol, seed=0), tasks[:2], tasks_dir, 30)
    assert all(ep.cut and ep.truncated and not ep.won and len(ep.turns) == 1 for ep in eps)
    assert all(len(ep.window_ids(0)) <= pol.max_context for ep in eps)


def test_expert_episode_rendering_uses_the_rollout_layout(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    played = run_episodes(PolicyAgent(pol, greedy=True), tasks[:3], tasks_dir, 5)
    for ep in played:  # constrained replies are canonical: rendering the text gives the same ids
        assert render(pol, ep, 16).ids == ep.ids


def test_decoding_is_chosen_per_family():
    assert decoding_mode({}, "textworld", ["go north"]) == "constrained"
    assert decoding_mode({}, "sql", None) == "free"
    assert decoding_mode({"textworld": "free"}, "textworld", ["go north"]) == "free"
    assert decoding_mode({"default": "free", "sokoban": "constrained"}, "sokoban", ["up"]) == "constrained"
    assert decoding_mode({"default": "constrained"}, "sql", None) == "free"  # nothing to constrain to


def test_random_agent_is_seeded_and_admissible(lake_pool):
    tasks, tasks_dir = lake_pool
    a = run_episodes(RandomAgent(3), tasks, tasks_dir, 8)
    b = run_episodes(RandomAgent(3), tasks, tasks_dir, 8)
    assert [[t.action for t in e.turns] for e in a] == [[t.action for t in e.turns] for e in b]
    assert all(t.action in t.admissible and not t.invalid for e in a for t in e.turns)


def test_guided_episodes_play_the_expert_from_their_turn_with_the_policys_logprobs(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    eps = run_episodes(PolicyAgent(pol, temperature=1.0, seed=4), tasks, tasks_dir, 20, group_size=4, guided=2, seed=9)
    for g in range(len(tasks)):
        group = eps[4 * g : 4 * g + 4]
        assert [ep.guide_at is None for ep in group] == [True, True, False, False]  # the group's last two
        for ep in group[2:]:
            # the drawn turn lies below the expert's distance from the start (6 steps or more on these lakes)
            assert 0 <= ep.guide_at < 20
            for k, t in enumerate(ep.turns):
                assert t.guided == (k >= ep.guide_at)
            if len(ep.turns) > ep.guide_at:  # the policy lived to the drawn turn: the expert wins from there
                assert ep.won
    # the expert's replies are its actions' reply ids, scored by the policy as the trainer will score them
    batch = build_batch(eps, pol.pad_id)
    logp, _ = token_logprobs(pol.model, batch)
    assert torch.allclose(logp, batch.flat(batch.old_logp), atol=1e-5)
    guided_turns = [(ep, t) for ep in eps for t in ep.turns if t.guided]
    assert guided_turns
    for ep, t in guided_turns:
        env_action = t.action
        assert ep.ids[t.start : t.end] == pol.chat.reply(env_action)
    # the same seeds draw the same turns and play the same episodes; guidance off leaves no trace
    again = run_episodes(PolicyAgent(pol, temperature=1.0, seed=4), tasks, tasks_dir, 20, group_size=4, guided=2, seed=9)
    assert [e.ids for e in again] == [e.ids for e in eps] and [e.guide_at for e in again] == [e.guide_at for e in eps]
    plain = run_episodes(PolicyAgent(pol, temperature=1.0, seed=4), tasks, tasks_dir, 20, group_size=4)
    assert all(e.guide_at is None and not e.guided for e in plain)


def test_a_forced_token_keeps_its_logprob_and_the_other_rows_draws():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    allowed = [[1, 2, 3], None, [4, 5]]
    gen = torch.Generator().manual_seed(5)
    free = sample(logits, allowed, 0.7, False, gen)
    gen = torch.Generator().manual_seed(5)
    tok, lp, ent = sample(logits, allowed, 0.7, False, gen, forced=[3, None, None])
    assert tok[0] == 3 and tok[1:] == free[0][1:] and lp[1:] == free[1][1:] and ent == free[2]
    z = (logits[0] / 0.7)[[1, 2, 3]].log_softmax(-1)
    assert abs(lp[0] - float(z[2])) < 1e-6  # the forced token's log-prob under the masked, tempered policy


def test_a_groups_shared_first_prompt_is_prefilled_once_with_the_same_episodes(lake_pool):
    """G episodes of a task start from the same prompt: the first forward pass computes it once per task
    and copies its keys and values to the group's other rows; the episodes are the ones each row would
    get computing its own prompt (same seed, same ids, log-probs to float rounding)."""
    import agentkiln.rollout.kv as kv

    tasks, tasks_dir = lake_pool
    pol = policy(tasks, tasks_dir)
    rows_run = []
    run = kv.KVRows._run

    def counting(self, ids, mask, pos, cache):
        rows_run.append(len(ids))
        return run(self, ids, mask, pos, cache)

    kv.KVRows._run = counting
    try:
        grouped = run_episodes(PolicyAgent(pol, seed=3, batch_size=64), tasks[:3], tasks_dir, 4, group_size=4)
        first = rows_run[0]
        rows_run.clear()

        def separately(self, group, ids, pos, real):  # every row its own prefill, as before the sharing
            if group.cache is None:
                group.cache = kv.Cache(layer_class_to_replicate=kv._SlotLayer)
            group.mask = torch.cat([group.mask, real.to(self.device)], dim=1)
            return self._run(ids, group.mask, pos, group.cache)

        shared = kv.KVRows._forward
        kv.KVRows._forward = separately
        try:
            alone = run_episodes(PolicyAgent(pol, seed=3, batch_size=64), tasks[:3], tasks_dir, 4, group_size=4)
        finally:
            kv.KVRows._forward = shared
    finally:
        kv.KVRows._run = run
    assert first == 3 and rows_run[0] == 12  # one prefill per task, against one per episode
    assert [e.ids for e in grouped] == [e.ids for e in alone]
    lp = lambda eps: torch.tensor([x for e in eps for t in e.turns for x in t.logprobs])  # noqa: E731
    assert torch.allclose(lp(grouped), lp(alone), atol=1e-5)  # a batch of another size: float rounding only
