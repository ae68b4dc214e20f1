"""The pure promotion gate with hand-made numbers."""

import dataclasses

import pytest

from agentkiln.registry.promotion import Decision, decide, pick_candidate


def test_no_champion_always_promotes():
    d = decide(0.0, None, 0.0)
    assert d.promote and "no champion" in d.reason
    assert decide(0.1, None, 0.5).promote  # the margin only applies against a champion


@pytest.mark.parametrize(
    "challenger,champion,margin,expected",
    [
        (0.70, 0.60, 0.0, True),  # better
        (0.60, 0.60, 0.0, False),  # tie keeps the champion
        (0.59, 0.60, 0.0, False),  # worse
        (0.70, 0.60, 0.05, True),  # +0.10 >= 0.05
        (0.70, 0.60, 0.10, True),  # +0.10 >= 0.10 exactly (despite 0.7 - 0.6 = 0.0999...)
        (0.69, 0.60, 0.10, False),  # +0.09 < 0.10
        (0.60, 0.60, 0.01, False),
        (1.00, 0.00, 1.00, True),
        (0.3 + 0.3, 0.5, 0.1, True),  # 0.6000000000000001 - 0.5 >= 0.1
    ],
)
def test_gate(challenger, champion, margin, expected):
    assert decide(challenger, champion, margin).promote is expected


def test_reason_states_the_numbers():
    d = decide(0.6875, 0.625, 0.0)
    assert d.promote
    assert "0.6875" in d.reason and "0.6250" in d.reason and "+0.0625" in d.reason
    d = decide(0.5, 0.5, 0.0)
    assert not d.promote and "tie" in d.reason and "not promoted" in d.reason
    d = decide(0.65, 0.6, 0.1)
    assert not d.promote and "0.1000" in d.reason and "+0.0500" in d.reason


def test_decision_is_frozen():
    d = Decision(True, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.promote = False


@pytest.mark.parametrize("args", [(0.5, 0.4, -0.1), (float("nan"), 0.4, 0.0), (0.5, float("nan"), 0.0)])
def test_rejects_nonsense(args):
    with pytest.raises(ValueError):
        decide(*args)


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
