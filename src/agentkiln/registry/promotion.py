"""The promotion gate, pure (no MLflow): which candidate to register, and whether it replaces the
champion (better by a margin, paired CI above zero, no guard metric regressed). Kept apart from the
registry side effects so the rule is tested with plain numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentkiln.stats import paired_difference


@dataclass(frozen=True)
class Guard:
    """A metric that must not regress: the challenger may be worse than the champion by at most
    `tolerance` (in the metric's units) in the bad direction."""

    name: str
    challenger: float
    champion: float
    tolerance: float = 0.0
    higher_is_better: bool = True

    def ok(self) -> bool:
        worse_by = (self.champion - self.challenger) if self.higher_is_better else (self.challenger - self.champion)
        return round(worse_by, 12) <= round(self.tolerance, 12)


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    diff: float | None = None  # challenger - champion on the target metric
    ci_low: float | None = None
    ci_high: float | None = None
    failed_guards: tuple[str, ...] = ()


def gate(challenger: list[int] | list[float], champion: list[int] | list[float] | None, margin: float = 0.0,
         guards: list[Guard] = (), confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> Decision:
    """Promote the challenger iff there is no champion, or all of
      1. the target metric (the mean of the per-task outcomes) beats the champion's by >= margin
         (strictly, when margin is 0: a tie never replaces a champion),
      2. the paired bootstrap CI of the difference (same panel, same tasks) lies above zero,
      3. no guard metric regresses beyond its tolerance.
    `challenger` and `champion` are per-task outcomes on the same frozen panel, in the same order."""
    margin = float(margin)
    if margin < 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    if len(challenger) == 0:
        raise ValueError("the challenger has no per-task outcomes")
    if any(not math.isfinite(float(x)) for x in challenger):
        raise ValueError("challenger outcomes must be finite numbers")
    if champion is None:
        return Decision(True, f"no champion yet: the challenger ({sum(challenger) / len(challenger):.4f}) becomes champion")
    if len(champion) != len(challenger):
        raise ValueError(f"challenger and champion must be scored on the same tasks, got {len(challenger)} and "
                         f"{len(champion)} outcomes: re-evaluate the champion on this panel")
    diff, lo, hi = paired_difference(challenger, champion, confidence, n_boot, seed)
    a, b = sum(challenger) / len(challenger), sum(champion) / len(champion)
    checks = []
    beats = round(diff, 12) >= round(margin, 12) if margin > 0 else diff > 0
    checks.append(f"difference {diff:+.4f} {'>=' if beats else '<'} margin {margin:.4f}" if margin > 0
                  else f"difference {diff:+.4f} {'>' if beats else '<='} 0")
    above = lo > 0
    checks.append(f"{int(confidence * 100)}% paired CI [{lo:+.4f}, {hi:+.4f}] {'above' if above else 'not above'} 0")
    failed = tuple(g.name for g in guards if not g.ok())
    for g in guards:
        checks.append(f"guard {g.name}: {g.challenger:.4f} vs {g.champion:.4f} (tolerance {g.tolerance:.4f}) "
                      f"{'ok' if g.ok() else 'REGRESSED'}")
    ok = beats and above and not failed
    reason = (f"challenger {a:.4f} vs champion {b:.4f}: " + "; ".join(checks)
              + ("; promoted" if ok else "; not promoted"))
    return Decision(ok, reason, diff, lo, hi, failed)


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
