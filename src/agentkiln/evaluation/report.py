"""The evaluation reports DVC tracks: metrics.json (`dvc metrics`), success.csv (`dvc plots`),
eval.md (a table for humans) and success.png (bar chart with Wilson intervals).

Every file is a pure function of the metrics: identical input gives identical bytes (floats are
rounded, keys sorted, the PNG carries no timestamp or software version).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

POLICY_ORDER = ("random", "sft", "rl", "distilled")
DECIMALS = 4
TITLE = "Success on the frozen test panel (95% Wilson CI)"


def _round(x):
    """Round floats (recursively) so that the JSON does not depend on the last bits of a sum.
    NaN and infinities become null: metrics.json stays strict JSON for `dvc metrics`."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, float):
        return round(x, DECIMALS) + 0.0 if math.isfinite(x) else None  # + 0.0: no "-0.0"
    if isinstance(x, int):
        return int(x)
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    if hasattr(x, "item"):  # numpy / torch scalars
        return _round(x.item())
    return x


def ordered_policies(metrics: dict) -> list[str]:
    """The usual pipeline order first (random, sft, rl, distilled), then any other name sorted."""
    known = [p for p in POLICY_ORDER if p in metrics]
    return known + sorted(p for p in metrics if p not in POLICY_ORDER)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def _params(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.1f}k"
    return str(n)


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(float(x), spec)


def summary_line(metrics: dict) -> str:
    """Which policy is best, and the gains sft over random and rl over sft in points."""
    names = ordered_policies(metrics)
    if not names:
        return "No policy was evaluated."
    # max() keeps the first of equal values: ties go to the earlier policy in pipeline order.
    best = max(names, key=lambda p: float(metrics[p].get("success", 0.0)))
    parts = [f"Best policy: **{best}** ({_pct(metrics[best].get('success'))} success)"]
    for new, old in (("sft", "random"), ("rl", "sft"), ("distilled", "rl")):
        if new in metrics and old in metrics:
            gain = 100 * (float(metrics[new]["success"]) - float(metrics[old]["success"]))
            parts.append(f"{new} vs {old}: {gain:+.1f} points")
    return "; ".join(parts) + "."


def markdown_table(metrics: dict) -> str:
    lines = [
        "| policy | success | 95% CI | n | mean turns | invalid rate | parameters |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for p in ordered_policies(metrics):
        m = metrics[p]
        ci = f"[{_pct(m.get('ci_low'))}, {_pct(m.get('ci_high'))}]"
        lines.append(
            f"| {p} | {_pct(m.get('success'))} | {ci} | {m.get('n_tasks', 'n/a')} | "
            f"{_fmt(m.get('mean_turns'), '.1f')} | {_pct(m.get('invalid_rate'))} | {_params(m.get('n_params'))} |"
        )
    return "\n".join(lines)


def family_table(metrics: dict, panel: str | None = None) -> str:
    """Success per family (rows) and policy (columns) on the test panel, or on `panel` (ood)."""
    names = [p for p in ordered_policies(metrics) if panel is None or panel in metrics[p]]
    if not names:
        return ""
    at = {p: metrics[p] if panel is None else metrics[p][panel] for p in names}
    families = sorted({f for p in names for f in at[p].get("by_family", {})})
    lines = ["| family | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for f in families + ["all"]:
        cells = []
        for p in names:
            m = at[p] if f == "all" else at[p].get("by_family", {}).get(f)
            cells.append("-" if m is None else f"{_pct(m.get('success'))} [{_pct(m.get('ci_low'))}, {_pct(m.get('ci_high'))}]")
        n = (at[names[0]] if f == "all" else at[names[0]].get("by_family", {}).get(f, {})).get("n_tasks", "-")
        lines.append(f"| {'**all**' if f == 'all' else f} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(metrics: dict) -> str:
    text = (
        "# Evaluation on the frozen test panel\n\n"
        + markdown_table(metrics)
        + "\n\n"
        + summary_line(metrics)
        + "\n\nSuccess = share of test tasks won; the interval is a Wilson score interval.\n"
    )
    if any(m.get("by_family") for m in metrics.values()):
        text += "\n## Per family (test panel)\n\n" + family_table(metrics) + "\n"
    if any("ood" in m for m in metrics.values()):
        text += ("\n## Out-of-distribution panel (held-out task types)\n\n" + family_table(metrics, "ood")
                 + "\n\nTask types of this panel never appear in training (sft, rl).\n")
    return text


def render_csv(metrics: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "success", "ci_low", "ci_high"])
    for p in ordered_policies(metrics):
        m = metrics[p]
        w.writerow([p, *(f"{float(m[k]):.{DECIMALS}f}" for k in ("success", "ci_low", "ci_high"))])
    return buf.getvalue()


def render_png(metrics: dict, path: Path) -> None:
    # The object API with an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = ordered_policies(metrics)
    panels = [("test", lambda m: m)] + ([("ood", lambda m: m["ood"])] if all("ood" in metrics[p] for p in names) else [])
    families = sorted({f for p in names for f in metrics[p].get("by_family", {})})
    fig = Figure(figsize=(6 + 4 * (len(families) > 1), 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1 + (len(families) > 1), 1)
    width = 0.8 / len(panels)
    for k, (panel, get) in enumerate(panels):
        succ = [float(get(metrics[p])["success"]) for p in names]
        lo = [max(0.0, s - float(get(metrics[p])["ci_low"])) for p, s in zip(names, succ)]
        hi = [max(0.0, float(get(metrics[p])["ci_high"]) - s) for p, s in zip(names, succ)]
        x = [i + (k - (len(panels) - 1) / 2) * width for i in range(len(names))]
        ax.bar(x, succ, width, yerr=[lo, hi], capsize=4, label=panel, color=["#4C72B0", "#DD8452"][k],
               edgecolor="black", linewidth=0.6)
        for xi, s, up in zip(x, succ, hi):
            ax.text(xi, min(s + up + 0.015, 0.95), f"{100 * s:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1)
    ax.set_xlabel("policy")
    ax.set_ylabel("success rate")
    ax.set_title(TITLE if len(panels) == 1 else "Success, test and OOD panels (95% Wilson CI)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if len(panels) > 1:
        ax.legend(loc="upper left", fontsize=8)
    if len(families) > 1:  # per family on the test panel: one group of bars per family
        ax2 = fig.add_subplot(1, 2, 2)
        width = 0.8 / len(names)
        for k, p in enumerate(names):
            by = metrics[p].get("by_family", {})
            x = [i + (k - (len(names) - 1) / 2) * width for i in range(len(families))]
            ax2.bar(x, [float(by[f]["success"]) if f in by else 0.0 for f in families], width, label=p,
                    edgecolor="black", linewidth=0.4)
        ax2.set_xticks(range(len(families)), families, rotation=20, fontsize=8)
        ax2.set_ylim(0, 1)
        ax2.set_title("Success per family (test panel)", fontsize=10)
        ax2.grid(axis="y", alpha=0.3)
        ax2.set_axisbelow(True)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    # No "Software" (matplotlib version) or creation time chunk: same metrics -> same bytes.
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})


def write_reports(metrics: dict, out_dir: Path) -> None:
    """Write metrics.json, eval.md, success.csv and success.png into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounded = _round(metrics)
    (out_dir / "metrics.json").write_text(json.dumps(rounded, indent=2, sort_keys=True) + "\n")
    (out_dir / "eval.md").write_text(render_markdown(rounded))
    (out_dir / "success.csv").write_text(render_csv(rounded))
    render_png(rounded, out_dir / "success.png")
