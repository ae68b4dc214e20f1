"""Partial fine-tuning (`top_layers`): only the last k decoder layers and the final norm train; the
embeddings and every layer below stay exactly as they were, and the stage after starts as given."""

import torch

from agentkiln.config import ModelParams
from agentkiln.policy import AgentFormat, build_scratch_policy, partial
from agentkiln.stages.sft import render_all
from agentkiln.trainers.supervised import OptimConfig, train_supervised

from tests.conftest import expert_episodes, task_texts


def test_sft_with_top_layers_moves_only_the_top_layers_and_the_norm(lake_pool):
    tasks, tasks_dir = lake_pool
    sizes = ModelParams(hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64, vocab_size=400)
    pol = build_scratch_policy(sizes, task_texts(tasks, tasks_dir), AgentFormat(), seed=0)
    before = {k: v.clone() for k, v in pol.model.state_dict().items()}
    episodes = render_all(pol, expert_episodes(tasks, tasks_dir))
    with partial.top_layers(pol, 1):
        assert {n for n, p in pol.model.named_parameters() if p.requires_grad} == {
            n for n, _ in pol.model.named_parameters() if n.startswith(("model.layers.2.", "model.norm."))}
        train_supervised(pol, episodes, OptimConfig(2, 2, 1e-2, 0.0, 0, 1.0), seed=0)
    after = pol.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith(("model.layers.2.", "model.norm.")) for k in moved), sorted(moved)
    assert all(p.requires_grad for p in pol.model.parameters())  # as given, for the next stage


def test_more_top_layers_than_the_model_has_is_refused_by_name(lake_pool):
    import pytest

    tasks, tasks_dir = lake_pool
    sizes = ModelParams(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, vocab_size=400)
    pol = build_scratch_policy(sizes, task_texts(tasks, tasks_dir), AgentFormat(), seed=0)
    with pytest.raises(ValueError, match="top_layers = 3: .* has 2 decoder layers"):
        with partial.top_layers(pol, 3):
            pass
