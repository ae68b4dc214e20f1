"""Checkpoint selection (trainers.select): the rule by hand, what the selector keeps when real agents
play a real two-family panel, and an RL run that selects: the weights it ends with are the kept
look's, its choice follows the rule, and a killed run resumes to the same choice."""

import pytest
import torch

from agentkiln.config import ModelParams, RLParams, SelectParams
from agentkiln.evaluate.baselines import OracleAgent
from agentkiln.policy import AgentFormat, build_scratch_policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.stages.common import load_split
from agentkiln.trainers import rl as trainer
from agentkiln.trainers.select import Selector, admissible, family_success

from tests.conftest import task_texts, tiny_dataset

TINY = ModelParams(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=400, max_context=1024)


def test_success_per_family_and_the_guard_by_hand():
    s = family_success([("lake", True), ("lake", False), ("words", True), ("words", True), ("words", False)])
    assert s == pytest.approx({"lake": 0.5, "words": 2 / 3, "all": 0.6})
    start = {"lake": 0.5, "words": 0.7, "all": 0.62}
    assert admissible({"lake": 0.9, "words": 0.7, "all": 0.8}, start, 0.0)
    assert not admissible({"lake": 0.9, "words": 0.65, "all": 0.8}, start, 0.0)  # words lost 0.05
    assert admissible({"lake": 0.9, "words": 0.65, "all": 0.8}, start, 0.05)
    assert not admissible({"lake": 0.9, "all": 0.8}, start, 0.0)  # a family never won counts as 0


class FamilyAgent:
    """The expert's move on the families in `wins`; an empty reply (invalid, so the task is lost) elsewhere."""

    batch_size = None

    def __init__(self, wins: set[str]):
        self.wins, self.oracle = wins, OracleAgent()

    def act(self, episodes, envs):
        expert = self.oracle.act(episodes, envs)
        return [a if ep.family in self.wins else "" for a, ep in zip(expert, episodes)]


class Holder:
    """What the selector needs of a policy: its model (weights copied, restored)."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 2)

    def set(self, value: float):
        with torch.no_grad():
            for t in self.model.parameters():
                t.fill_(value)


@pytest.fixture(scope="module")
def two_families(tmp_path_factory):
    """A panel of 6 FrozenLake tasks and 4 word problems."""
    mix = {"frozenlake_easy": 0.6, "python_words": 0.4}
    out = tiny_dataset(tmp_path_factory.mktemp("select"), {"sft": mix, "rl": mix, "test": mix},
                       n={"sft": 1, "rl": 1, "test": 10})
    return load_split(out, "test"), out


def test_selector_keeps_the_best_look_that_lost_no_family_and_restores_it(two_families):
    tasks, tasks_dir = two_families
    looks = {0: {"gym-toytext"}, 2: {"python-tool", "gym-toytext"}, 4: {"python-tool"}, 6: {"gym-toytext"}}
    sel = Selector(SelectParams(panel="val", every=2), tasks, tasks_dir, None,
                   agent=lambda pol: FamilyAgent(looks[pol.look]))
    pol = Holder()
    kept = []
    for it, wins in looks.items():
        pol.look = it
        pol.set(float(it))
        kept.append(sel.observe(it, pol)["select/kept"])
    # 0: lakes only (0.6, kept: the start); 2: both (1.0, kept); 4: words only (0.4, lost the lakes);
    # 6: lakes only again (0.6 < 1.0)
    assert kept == [1.0, 1.0, 0.0, 0.0]
    assert sel.scores[0] == pytest.approx({"gym-toytext": 1.0, "python-tool": 0.0, "all": 0.6})
    assert sel.scores[4] == pytest.approx({"gym-toytext": 0.0, "python-tool": 1.0, "all": 0.4})
    pol.set(-1.0)
    assert sel.restore(pol) == 2
    assert all(torch.all(t == 2.0) for t in pol.model.parameters())
    r = sel.report()
    assert (r["selected_iteration"], r["select_success_start"], r["select_success_selected"],
            r["select_success_last"]) == (2, 0.6, 1.0, 0.6)


def test_a_look_that_buys_one_family_with_another_is_not_kept_even_when_it_scores_more(two_families):
    tasks, tasks_dir = two_families
    looks = {0: {"python-tool"}, 2: {"gym-toytext"}}  # 0.4 at the start, then 0.6 with every word problem lost
    sel = Selector(SelectParams(panel="val"), tasks, tasks_dir, None, agent=lambda pol: FamilyAgent(looks[pol.look]))
    pol = Holder()
    for it in looks:
        pol.look = it
        pol.set(float(it))
        sel.observe(it, pol)
    assert sel.scores[2]["all"] > sel.scores[0]["all"]
    assert sel.restore(pol) == 0 and all(torch.all(t == 0.0) for t in pol.model.parameters())
    loose = Selector(SelectParams(panel="val", guard=1.0), tasks, tasks_dir, None,
                     agent=lambda pol: FamilyAgent(looks[pol.look]))
    for it in looks:  # with the guard at 1 only the success counts
        pol.look = it
        pol.set(float(it))
        loose.observe(it, pol)
    assert loose.restore(pol) == 2


@pytest.fixture(scope="module")
def lake_texts(lake_pool):
    return task_texts(*lake_pool)


def run_selecting(lake_pool, lake_texts, every=1, log=None, ckpt=None):
    tasks, tasks_dir = lake_pool
    p = RLParams(iterations=4, tasks_per_iter=2, group_size=3, max_turns=5, lr=2e-2, minibatch_size=3,
                 select={"panel": "val", "every": every})
    pol, ref = (build_scratch_policy(TINY, lake_texts, AgentFormat(), seed=0) for _ in range(2))
    sel = Selector(p.select, tasks, tasks_dir, 5, agent=lambda pol: PolicyAgent(pol, greedy=True))
    hist = trainer.train_rl(pol, ref, tasks, tasks_dir, p, seed=3, log=log, ckpt_dir=ckpt, ckpt_key="k", select=sel)
    return hist, pol, sel


def test_rl_with_selection_ends_on_the_kept_weights_chosen_by_the_rule(lake_pool, lake_texts):
    hist, pol, sel = run_selecting(lake_pool, lake_texts)
    assert sorted(sel.scores) == [0, 1, 2, 3, 4]
    assert [row["select/success"] for row in hist] == [sel.scores[i]["all"] for i in (1, 2, 3, 4)]
    best = max(sel.scores, key=lambda i: (sel.scores[i]["all"], i))  # one family: the best, ties to the later
    assert sel.best == best
    for name, t in pol.model.state_dict().items():
        assert torch.equal(t, sel.best_weights[name])
    # played again with the weights it ended on, the panel gives the kept look's success
    again = Selector(sel.p, *lake_pool, 5, agent=lambda pol: PolicyAgent(pol, greedy=True))
    assert again.observe(0, pol)["select/success"] == sel.scores[best]["all"]
    # every 3 iterations: the start, iteration 3 and the last
    _, _, sparse = run_selecting(lake_pool, lake_texts, every=3)
    assert sorted(sparse.scores) == [0, 3, 4]


class Killed(Exception):
    pass


def test_a_killed_run_that_selects_resumes_to_the_same_choice(lake_pool, lake_texts, tmp_path):
    straight, pol_a, sel_a = run_selecting(lake_pool, lake_texts)

    def kill_at_3(row, step):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        run_selecting(lake_pool, lake_texts, log=kill_at_3, ckpt=tmp_path / "ckpt")
    resumed, pol_b, sel_b = run_selecting(lake_pool, lake_texts, ckpt=tmp_path / "ckpt")
    assert resumed == straight and sel_b.scores == sel_a.scores and sel_b.best == sel_a.best
    for a, b in zip(pol_a.model.parameters(), pol_b.model.parameters()):
        assert torch.equal(a, b)


def test_train_rl_without_a_selector_trains_to_its_last_weights(lake_pool, lake_texts):
    tasks, tasks_dir = lake_pool
    p = RLParams(iterations=1, tasks_per_iter=2, group_size=2, max_turns=4, select={"panel": "val"})
    pol = build_scratch_policy(TINY, lake_texts, AgentFormat(), seed=0)
    hist = trainer.train_rl(pol, None, tasks, tasks_dir, p, seed=0)  # select.panel is the stage's to read
    assert len(hist) == 1 and not any(k.startswith("select/") for k in hist[0])


def test_params_refuse_selecting_on_the_panel_that_reports_or_on_a_missing_one():
    from pydantic import ValidationError

    from tests.conftest import params_with

    assert params_with({}).rl.stage("main").select.panel == "val"  # the default
    for panel, said in [("test", "the headline panel"), ("holdout", "no such split")]:
        with pytest.raises(ValidationError, match=rf"rl.stages.main.select.panel = '{panel}'.*{said}"):
            params_with({"rl": {"stages": {"main": {"init": "sft", "select": {"panel": panel}}}}})


def test_ablation_and_findings_arms_train_to_their_last_weights_whatever_select_says(lake_pool, lake_texts):
    from agentkiln.stages.ablation import train_stages

    tasks, tasks_dir = lake_pool
    p = RLParams(iterations=1, tasks_per_iter=2, group_size=2, max_turns=4, select={"panel": "val"})
    pol = build_scratch_policy(TINY, lake_texts, AgentFormat(), seed=0)
    curve = train_stages(pol, [p], 0, tasks, tasks_dir)  # no panel is played, none is asked for
    assert [row["iteration"] for row in curve] == [1]
