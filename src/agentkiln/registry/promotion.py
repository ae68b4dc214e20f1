"""The promotion gate, pure (no MLflow): which candidate to register, and whether it replaces the
champion. Kept apart from the registry side effects so the rule is tested with plain numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(challenger: float, champion: float | None, margin: float) -> Decision:
    """Promote iff there is no champion, or the challenger beats it by the margin:

    - margin > 0: challenger >= champion + margin
    - margin == 0: challenger > champion (a tie never replaces a champion)
    """
    challenger = float(challenger)
    margin = float(margin)
    if margin < 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    if not math.isfinite(challenger):
        raise ValueError(f"challenger score must be finite, got {challenger}")
    if champion is None:
        return Decision(True, f"no champion yet: challenger ({challenger:.4f}) becomes champion")
    champion = float(champion)
    if not math.isfinite(champion):
        raise ValueError(f"champion score must be finite or None, got {champion}")
    diff = challenger - champion
    if margin > 0:
        # Round the difference so that 0.7 - 0.6 >= 0.1 holds as it does on paper.
        ok = round(diff, 12) >= round(margin, 12)
        rule = f"at least {margin:.4f} better"
    else:
        ok = diff > 0
        rule = "strictly better (a tie keeps the champion)"
    verdict = "promoted" if ok else "not promoted"
    return Decision(
        ok,
        f"challenger {challenger:.4f} vs champion {champion:.4f} (difference {diff:+.4f}); "
        f"required: {rule}; {verdict}",
    )


def pick_candidate(metrics: dict, candidates: list[str], metric: str = "success") -> str:
    """The candidate present in `metrics` with the highest `metric`; ties go to the one listed
    first in `candidates`."""
    present = [c for c in candidates if c in metrics]
    if not present:
        raise ValueError(
            f"none of the promotion candidates {list(candidates)} was evaluated "
            f"(metrics has {sorted(metrics)}); check promote.candidates and evaluate.policies in params.yaml"
        )
    missing = [c for c in present if metric not in metrics[c] or metrics[c][metric] is None]
    if missing:
        raise ValueError(f"metric {metric!r} missing for candidate(s) {missing}")
    best = present[0]
    for c in present[1:]:
        if float(metrics[c][metric]) > float(metrics[best][metric]):  # strict: earlier wins ties
            best = c
    return best
