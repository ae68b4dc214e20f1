"""reports/ablation.md and reports/ablation.png from an ablation result (agentkiln.stages.ablation)."""

from __future__ import annotations

from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _diff(d: dict | None) -> str:
    if d is None:
        return "baseline"
    flag = " **" if d["ci_low"] > 0 else (" (worse)" if d["ci_high"] < 0 else "")
    return f"{100 * d['diff']:+.1f} [{100 * d['ci_low']:+.1f}, {100 * d['ci_high']:+.1f}]{flag}"


def _stages(stages: list[dict]) -> str:
    return " -> ".join(", ".join(f"{k}={v}" for k, v in s.items() if k not in ("iterations",)) or "defaults"
                       for s in stages)


def render_markdown(r: dict) -> str:
    s, init, base = r["summary"], r["init"], r["baseline"]
    conf = int(round(100 * r["confidence"]))
    lines = [
        "# RL ablation",
        "",
        f"Every arm trains from `{init}` on the RL pool with seeds {r['seeds']} at the same rollout budget "
        f"({r['episode_budget']} episodes per run), then plays the frozen `{r['panel']}` panel ({r['n_tasks']} tasks) "
        f"greedily. Success in %, {conf}% CI by bootstrap over seeds and tasks; differences are paired "
        "(same seeds, same tasks); ** marks an interval above zero.",
        "",
        f"| arm | stages | success | {conf}% CI | per seed | vs {init} | vs {base} | minutes |",
        "|---|---|---|---|---|---|---|---|",
        f"| {init} (start) | - | {_pct(s[init]['success'])} | [{_pct(s[init]['ci_low'])}, {_pct(s[init]['ci_high'])}] "
        "| - | - | - | - |",
    ]
    for arm, stages in r["arms"].items():
        a = s[arm]
        seeds = " / ".join(_pct(x) for x in a["per_seed"])
        minutes = f"{r['seconds'].get(arm, 0) / 60:.1f}"
        lines.append(f"| {arm} | {_stages(stages)} | {_pct(a['success'])} | [{_pct(a['ci_low'])}, {_pct(a['ci_high'])}] "
                     f"| {seeds} | {_diff(a.get(f'vs_{init}'))} | {_diff(a.get(f'vs_{base}'))} | {minutes} |")
    best = max(r["arms"], key=lambda k: s[k]["success"])
    d = s[best][f"vs_{init}"]
    verdict = "beats" if d["ci_low"] > 0 else "does not significantly beat"
    lines += ["", f"Best arm: **{best}** ({_pct(s[best]['success'])}%), which {verdict} `{init}` "
              f"({_diff(d)} points).", "", "![learning curves and success](ablation.png)", ""]
    return "\n".join(lines)


def render_png(r: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s, arms = r["summary"], list(r["arms"])
    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    for arm in arms:  # mean over seeds of the training-rollout success, against episodes played
        curves = [c for c in r["curves"][arm] if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        xs = [sum(c[i]["episodes"] for c in curves) / len(curves) for i in range(n)]
        ys = [sum(c[i]["success"] for c in curves) / len(curves) for i in range(n)]
        ax.plot(xs, ys, marker=".", label=arm)
    ax.set_xlabel("episodes played")
    ax.set_ylabel("rollout success (mean over seeds)")
    ax.set_title("Learning curves", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    names = [r["init"]] + arms
    succ = [s[k]["success"] for k in names]
    err = [[max(0.0, s[k]["success"] - s[k]["ci_low"]) for k in names],
           [max(0.0, s[k]["ci_high"] - s[k]["success"]) for k in names]]
    ax2.bar(range(len(names)), succ, yerr=err, capsize=4, color=["#999999"] + ["#4C72B0"] * len(arms),
            edgecolor="black", linewidth=0.6)
    ax2.set_xticks(range(len(names)), names, rotation=25, fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel(f"{r['panel']} success")
    ax2.set_title(f"Held-out success ({int(round(100 * r['confidence']))}% CI)", fontsize=10)
    ax2.grid(axis="y", alpha=0.3)
    ax2.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})


def write_ablation_reports(r: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    (out_dir / "ablation.md").write_text(render_markdown(r))
    render_png(r, out_dir / "ablation.png")
