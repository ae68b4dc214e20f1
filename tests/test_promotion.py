"""The pure promotion gate with hand-made numbers."""

import dataclasses

import pytest

from agentkiln.registry.promotion import Decision, Guard, gate, pick_candidate

# Per-task outcomes on a 100-task panel, made by hand.
CHAMP = [1] * 50 + [0] * 50  # 50%
BETTER = [1] * 50 + [1] * 30 + [0] * 20  # 80%: wins every task the champion wins, and 30 more
SLIGHTLY = [1] * 50 + [1] + [0] * 49  # 51%: one task more, far inside the noise
WORSE = [1] * 40 + [0] * 60


def test_no_champion_always_promotes():
    d = gate([0, 0, 1], None)
    assert d.promote and "no champion" in d.reason
    assert gate([0], None, margin=0.5).promote  # the margin only applies against a champion


def test_a_clearly_better_challenger_is_promoted_with_its_paired_ci():
    d = gate(BETTER, CHAMP)
    assert d.promote and d.diff == pytest.approx(0.30)
    assert 0 < d.ci_low < 0.30 < d.ci_high <= 0.45
    assert "0.8000" in d.reason and "0.5000" in d.reason and "+0.3000" in d.reason and "promoted" in d.reason


def test_identical_differences_give_a_degenerate_ci():
    d = gate([1] * 10, [0] * 10)  # every task +1: every bootstrap mean is exactly 1
    assert d.promote and (d.diff, d.ci_low, d.ci_high) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("challenger,why", [(CHAMP, "<= 0"), (WORSE, "<= 0"), (SLIGHTLY, "not above 0")])
def test_a_worse_tied_or_insignificant_challenger_is_refused(challenger, why):
    d = gate(challenger, CHAMP)
    assert not d.promote and why in d.reason and d.reason.endswith("not promoted")


def test_insignificant_gain_is_refused_even_though_it_is_higher():
    d = gate(SLIGHTLY, CHAMP)
    assert d.diff == pytest.approx(0.01) and d.ci_low <= 0 < d.ci_high and not d.promote


@pytest.mark.parametrize("margin,expected", [(0.0, True), (0.2, True), (0.3, True), (0.31, False)])
def test_margin(margin, expected):
    assert gate(BETTER, CHAMP, margin=margin).promote is expected  # diff is +0.30 (0.3 exactly passes)


def test_a_regressed_guard_blocks_promotion():
    guards = [Guard("ood_success", 0.20, 0.30, tolerance=0.05), Guard("invalid_rate", 0.01, 0.02, higher_is_better=False)]
    d = gate(BETTER, CHAMP, guards=guards)
    assert not d.promote and d.failed_guards == ("ood_success",) and "REGRESSED" in d.reason
    ok = [Guard("ood_success", 0.26, 0.30, tolerance=0.05), Guard("invalid_rate", 0.02, 0.02, higher_is_better=False)]
    assert gate(BETTER, CHAMP, guards=ok).promote
    assert not gate(BETTER, CHAMP, guards=[Guard("invalid_rate", 0.05, 0.02, higher_is_better=False)]).promote


def test_decision_is_frozen():
    d = Decision(True, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.promote = False


@pytest.mark.parametrize("kwargs", [dict(challenger=[1], champion=[1], margin=-0.1),
                                    dict(challenger=[float("nan")], champion=[1]),
                                    dict(challenger=[], champion=None),
                                    dict(challenger=[1, 0], champion=[1, 0, 1])])
def test_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        gate(**kwargs)


def test_pick_highest():
    m = {"sft": {"success": 0.5}, "rl": {"success": 0.7}, "distilled": {"success": 0.65}, "random": {"success": 0.9}}
    assert pick_candidate(m, ["rl", "distilled", "sft"]) == "rl"
    assert pick_candidate(m, ["sft", "distilled"]) == "distilled"
    # random is not a candidate even though it scores highest here
    assert pick_candidate(m, ["sft"]) == "sft"


def test_pick_tie_goes_to_the_first_listed():
    m = {"sft": {"success": 0.7}, "rl": {"success": 0.7}, "distilled": {"success": 0.7}}
    assert pick_candidate(m, ["rl", "distilled", "sft"]) == "rl"
    assert pick_candidate(m, ["distilled", "rl", "sft"]) == "distilled"
    m["sft"]["success"] = 0.71
    assert pick_candidate(m, ["rl", "distilled", "sft"]) == "sft"


def test_pick_skips_absent_candidates_and_uses_the_metric():
    m = {"distilled": {"success": 0.2, "other": 0.9}, "sft": {"success": 0.3, "other": 0.1}}
    assert pick_candidate(m, ["rl", "distilled", "sft"]) == "sft"
    assert pick_candidate(m, ["rl", "distilled", "sft"], metric="other") == "distilled"


def test_pick_none_present_is_a_clear_error():
    with pytest.raises(ValueError, match="none of the promotion candidates"):
        pick_candidate({"random": {"success": 0.1}}, ["rl", "sft"])
    with pytest.raises(ValueError, match="metric 'success' missing"):
        pick_candidate({"rl": {"ci_low": 0.1}}, ["rl"])


def test_module_is_pure():
    import sys
    import subprocess

    code = "import sys, agentkiln.registry.promotion; assert 'mlflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_floor_refuses_a_candidate_that_does_not_beat_random_champion_or_not():
    from agentkiln.config import EvaluateParams, PromoteParams
    from agentkiln.stages.promote import beats_random

    ids = [f"t{i}" for i in range(20)]
    ev = EvaluateParams()

    def outcomes(cand, rand):
        return {"sft": {"test": dict(zip(ids, cand))}, "random": {"test": dict(zip(ids, rand))}}

    # 0/20 against random's 1/20 (the case: a 0% policy became champion): refused
    d = beats_random(outcomes([0] * 20, [1] + [0] * 19), "sft", PromoteParams(), ev)
    assert not d.promote and d.diff == pytest.approx(-0.05) and "random" in d.reason and "champion" not in d.reason
    # 3/20 against 1/20: better on average, but the paired CI includes 0: refused
    d = beats_random(outcomes([1, 1, 1] + [0] * 17, [1] + [0] * 19), "sft", PromoteParams(), ev)
    assert not d.promote and d.diff == pytest.approx(0.10) and d.ci_low <= 0
    # 15/20 against 1/20: beats random clearly
    d = beats_random(outcomes([1] * 15 + [0] * 5, [0] * 19 + [1]), "sft", PromoteParams(), ev)
    assert d.promote and d.diff == pytest.approx(0.70) and d.ci_low > 0
    assert beats_random(outcomes([0] * 20, [1] * 20), "sft", PromoteParams(floor="none"), ev) is None
    with pytest.raises(ValueError, match="no `random` baseline"):
        beats_random({"sft": {"test": {"t0": 1}}}, "sft", PromoteParams(), ev)
