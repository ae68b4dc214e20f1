"""The evaluation reports DVC tracks: headline.json (`dvc metrics`: success per policy and panel),
metrics.json (every breakdown), success.csv and passk.csv
(`dvc plots`), eval.md (tables for humans), eval.html (tables and plots in one page) and the
plots success.png (success per policy with Wilson intervals, per family), passk.png and curves.png.

Every file is a pure function of the metrics: identical input gives identical bytes (floats are
rounded, keys sorted, the PNG carries no timestamp or software version).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from agentkiln.artifacts import ArtifactError, MissingArtifactError, rebuild_hint
from agentkiln.config import OPTIONAL_PANELS
from agentkiln.stats import wilson_interval

POLICY_ORDER = ("random", "oracle", "base", "sft", "rl", "distilled")
DECIMALS = 4
BASELINES = ("random", "oracle")
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
    """The usual pipeline order first (random, oracle, base, sft, rl, distilled), then any other name sorted."""
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
    # The baselines are references, not candidates; max() keeps the first of equal values: ties go
    # to the earlier policy in pipeline order.
    trained = [p for p in names if p not in BASELINES] or names
    best = max(trained, key=lambda p: float(metrics[p].get("success", 0.0)))
    b, rand = metrics[best], metrics.get("random")
    ci = f", 95% CI [{_pct(b['ci_low'])}, {_pct(b['ci_high'])}]" if b.get("ci_low") is not None else ""
    if best in BASELINES or rand is None:
        parts = [f"Best policy: **{best}** ({_pct(b.get('success'))} success{ci})"]
    elif float(b.get("success", 0.0)) <= float(rand.get("success", 0.0)):
        # never crown a policy that does no better than acting at random
        parts = [f"No trained policy beats the random baseline ({_pct(rand.get('success'))}): the best, "
                 f"**{best}**, has {_pct(b.get('success'))} success{ci}"]
    else:
        clear = b.get("ci_low") is not None and rand.get("ci_high") is not None and b["ci_low"] > rand["ci_high"]
        parts = [f"Best policy: **{best}** ({_pct(b.get('success'))} success{ci}), above random "
                 f"({_pct(rand.get('success'))}){'' if clear else ' but the 95% intervals overlap'}"]
    for new, old in (("sft", "random"), ("rl", "sft"), ("distilled", "rl")):
        if new in metrics and old in metrics:
            gain = 100 * (float(metrics[new]["success"]) - float(metrics[old]["success"]))
            parts.append(f"{new} vs {old}: {gain:+.1f} points{_by_family(metrics[new], metrics[old])}")
    return "; ".join(parts) + "."


def _by_family(new: dict, old: dict) -> str:
    """Each family's change in points, in brackets: a headline never hides a family that fell."""
    a, b = new.get("by_family") or {}, old.get("by_family") or {}
    common = [f for f in sorted(a) if f in b]
    if len(common) < 2:
        return ""
    return " (" + ", ".join(f"{f} {100 * (float(a[f]['success']) - float(b[f]['success'])):+.1f}" for f in common) + ")"


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
    """Success per family (rows) and policy (columns) on the test panel, or on `panel` (val, ood)."""
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
    if any("val" in m for m in metrics.values()):
        text += ("\n## Second draw (val panel: the test panel's kind of tasks, its own seed)\n\n" + family_table(metrics, "val")
                 + "\n\nA margin on test that does not hold here is the test panel's draw of tasks, not the policy's.\n")
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
            succ = [float(by[f]["success"]) if f in by else 0.0 for f in families]
            lo = [max(0.0, v - float(by[f]["ci_low"])) if f in by else 0.0 for f, v in zip(families, succ)]
            hi = [max(0.0, float(by[f]["ci_high"]) - v) if f in by else 0.0 for f, v in zip(families, succ)]
            ax2.bar(x, succ, width, yerr=[lo, hi], capsize=2, label=p, edgecolor="black", linewidth=0.4,
                    error_kw={"elinewidth": 0.8})
        ax2.set_xticks(range(len(families)), families, rotation=30, ha="right", fontsize=8)
        ax2.set_ylim(0, 1)
        ax2.set_title("Success per family, test panel (95% Wilson CI)", fontsize=10)
        ax2.grid(axis="y", alpha=0.3)
        ax2.set_axisbelow(True)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    # No "Software" (matplotlib version) or creation time chunk: same metrics -> same bytes.
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})


def _verdict(c: dict) -> str:
    return {"a": f"**{c['a']} better**", "b": f"**{c['b']} better**"}.get(c.get("better"), "no significant difference")


def _ci(c: dict) -> str:
    return f"{100 * c['diff']:+.1f} | [{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}]"


def comparison_table(comparisons: list[dict]) -> str:
    """Each pair over a whole panel (greedy on every panel, sampled on the test panel)."""
    lines = ["| a vs b | panel | play | tasks | a - b (points) | 95% CI (paired bootstrap over tasks) | verdict |",
             "|---|---|---|---:|---:|---|---|"]
    for c in comparisons:
        if c.get("family") is None:
            lines.append(f"| {c['a']} vs {c['b']} | {c.get('panel', 'test')} | {c.get('decoding', 'greedy')} | "
                         f"{c.get('n_tasks', '-')} | {_ci(c)} | {_verdict(c)} |")
    return "\n".join(lines)


def family_comparison_table(comparisons: list[dict]) -> str:
    """Each pair within each family of each panel (greedy); empty when no panel has several families."""
    rows = [c for c in comparisons if c.get("family") is not None]
    if not rows:
        return ""
    lines = ["| a vs b | panel | family | tasks | a - b (points) | 95% CI | verdict |", "|---|---|---|---:|---:|---|---|"]
    lines += [f"| {c['a']} vs {c['b']} | {c.get('panel', 'test')} | {c['family']} | {c['n_tasks']} | {_ci(c)} | "
              f"{_verdict(c)} |" for c in rows]
    return "\n".join(lines)


def regressions(comparisons: list[dict]) -> list[str]:
    """Every comparison, whole panel or one family, where a is below b beyond the CI."""
    return [f"{c['a']} below {c['b']} on {c.get('panel', 'test')}{'/' + c['family'] if c.get('family') else ''} "
            f"({c.get('decoding', 'greedy')}): {100 * c['diff']:+.1f} [{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}]"
            for c in comparisons if c.get("better") == "b"]


def regression_line(comparisons: list[dict]) -> str:
    found = regressions(comparisons)
    if not found:
        return "No comparison has its first policy below its second beyond the 95% CI, on any panel or family."
    return "**Below beyond the 95% CI:** " + "; ".join(found) + "."


def breakdown_table(metrics: dict, key: str) -> str:
    """Success per value of a breakdown (`by_level`, `by_task_type`) and policy, test panel."""
    names = [p for p in ordered_policies(metrics) if metrics[p].get(key)]
    if not names:
        return ""
    values = sorted({v for p in names for v in metrics[p][key]})
    lines = [f"| {key[3:]} | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for v in values:
        cells = [_pct(metrics[p][key][v]["success"]) if v in metrics[p][key] else "-" for p in names]
        lines.append(f"| {v} | {metrics[names[0]][key].get(v, {}).get('n_tasks', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def efficiency_table(metrics: dict) -> str:
    lines = ["| policy | turns / episode | generated tokens / episode | invalid-action rate | tool calls / episode |",
             "|---|---:|---:|---:|---:|"]
    for p in ordered_policies(metrics):
        m = metrics[p]
        lines.append(f"| {p} | {_fmt(m.get('mean_turns'), '.2f')} | {_fmt(m.get('tokens_per_episode'), '.1f')} | "
                     f"{_pct(m.get('invalid_rate'))} | {_fmt(m.get('tool_calls_per_episode'), '.2f')} |")
    return "\n".join(lines)


def pass_k_table(metrics: dict) -> str:
    names = [p for p in ordered_policies(metrics) if metrics[p].get("pass_at_k")]
    if not names:
        return ""
    ks = sorted({int(k) for p in names for k in metrics[p]["pass_at_k"]})
    lines = ["| policy | n samples | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---|---:|" + "---:|" * len(ks)]
    for p in names:
        pk = metrics[p]["pass_at_k"]
        lines.append(f"| {p} | {metrics[p].get('pass_at_k_samples', '-')} | " + " | ".join(_pct(pk.get(str(k))) for k in ks) + " |")
    return "\n".join(lines)


def render_full_markdown(metrics: dict, comparisons: list[dict], panels: dict | None) -> str:
    text = render_markdown(metrics)
    if panels:
        text += "\nPanels (manifest digests): " + ", ".join(f"{k} `{v}`" for k, v in sorted(panels.items())) + "\n"
    if comparisons:
        text += ("\n## Paired comparisons\n\n" + regression_line(comparisons) + "\n\n" + comparison_table(comparisons)
                 + "\n\ngreedy: one greedy episode per task. sampled: each task's success rate over its pass@k samples, "
                 "the quantity RL optimises. A verdict needs the 95% CI to exclude 0.\n")
        if table := family_comparison_table(comparisons):
            text += "\n## Paired comparisons per family\n\n" + table + "\n"
    for key, title in (("by_level", "Per difficulty level"), ("by_task_type", "Per task type")):
        if table := breakdown_table(metrics, key):
            text += f"\n## {title} (test panel)\n\n" + table + "\n"
    text += "\n## Efficiency (test panel, greedy)\n\n" + efficiency_table(metrics) + "\n"
    if table := pass_k_table(metrics):
        text += ("\n## pass@k (test panel, sampled)\n\n" + table
                 + "\n\nUnbiased estimator 1 - C(n-c, k) / C(n, k) from n sampled episodes per task.\n")
    return text


def render_pass_k_csv(metrics: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "k", "pass_at_k"])
    for p in ordered_policies(metrics):
        for k, v in sorted((metrics[p].get("pass_at_k") or {}).items(), key=lambda kv: int(kv[0])):
            w.writerow([p, int(k), f"{float(v):.{DECIMALS}f}"])
    return buf.getvalue()


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})


def _note_png(path: Path, text: str) -> bool:
    """A small image that says why there is no plot (DVC expects every declared output)."""
    fig = _figure(5, 1.2)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10)
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})
    return False


def render_pass_k_png(metrics: dict, path: Path) -> bool:
    names = [p for p in ordered_policies(metrics) if metrics[p].get("pass_at_k")]
    if not names:
        return _note_png(path, "pass@k is off (evaluate.pass_k.policies is empty)")
    fig = _figure(5, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for p in names:
        pts = sorted((int(k), float(v)) for k, v in metrics[p]["pass_at_k"].items())
        line, = ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=p)
        # band: a Wilson 95% interval over the panel's tasks (pass@k is a per-task rate averaged over them)
        n = int(metrics[p].get("n_tasks") or 0)
        if n:
            band = [wilson_interval(round(v * n), n) for _, v in pts]
            ax.fill_between([k for k, _ in pts], [b[0] for b in band], [b[1] for b in band], alpha=0.2,
                            color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (sampled episodes per task)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1)
    ax.set_title("pass@k on the test panel (band: 95% Wilson CI)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


CURVE_COLUMNS = ("iteration", "success")  # in every RL curve with rows; kl, entropy, episodes: when logged


def curve_hint(stage: str | None, path: Path) -> str:
    if stage is None:
        return rebuild_hint(path)
    return f"re-run the stage that writes it: `agentkiln stage rl@{stage}` (or `dvc repro rl@{stage}`)"


def read_curve(path: Path, stage: str | None = None) -> list[dict]:
    """The rows of an RL stage's curve.csv (stages.rl.write_curve), checked for what curves.png reads:
    a header with `iteration` and `success`; per row a positive, increasing integer iteration, a
    success rate in [0, 1], and numbers (or blanks) for kl, entropy and episodes. Anything else raises
    ArtifactError naming the file, the line and the column, and the RL stage to re-run (`stage`)."""
    path = Path(path)
    hint = curve_hint(stage, path)

    def bad(problem: str) -> ArtifactError:
        return ArtifactError(f"{path}: {problem}; {hint}")

    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            rows = [(reader.line_num, r) for r in reader]
    except FileNotFoundError:
        raise MissingArtifactError(f"{path}: RL learning curve missing; {hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"RL learning curve cannot be read ({type(e).__name__}: {e})") from None
    except csv.Error as e:
        raise bad(f"not a CSV file ({e})") from None
    if not header:
        raise bad("empty: no header row (an RL curve starts with `iteration,...`)")
    if "iteration" not in header:
        raise bad(f"missing column 'iteration' (header: {','.join(header)[:120]!r})")
    if rows and (missing := [c for c in CURVE_COLUMNS if c not in header]):
        raise bad(f"missing column {', '.join(repr(c) for c in missing)} (header: {','.join(header)[:120]!r})")
    last = 0
    for line, r in rows:
        if None in r:
            raise bad(f"line {line} has {len(header) + len(r[None])} values for {len(header)} columns")

        def number(col: str, kind=float, blank_ok: bool = True):
            v = r.get(col)
            if v is None or v.strip() == "":
                if blank_ok:
                    return None
                raise bad(f"line {line}: no value in column {col!r}")
            try:
                return kind(v)
            except ValueError:
                raise bad(f"line {line}: column {col!r} is not {'an integer' if kind is int else 'a number'} "
                          f"({v[:40]!r})") from None

        it = number("iteration", int, blank_ok=False)
        if it < 1 or it <= last:
            raise bad(f"line {line}: iteration {it} after {last or 'the header'} (iterations count up from 1)")
        last = it
        success = number("success", blank_ok=False)
        if not 0.0 <= success <= 1.0:
            raise bad(f"line {line}: success {success} is not a rate in [0, 1]")
        for col in ("kl", "entropy"):
            number(col)
        if (episodes := number("episodes", int)) is not None and episodes < 0:
            raise bad(f"line {line}: episodes {episodes} is negative")
    return [r for _, r in rows]


def render_curves_png(curves: dict[str, Path], path: Path) -> bool:
    """RL learning curves, stage after stage: rollout success, KL to the reference, entropy."""
    rows = {name: read_curve(p, name) for name, p in (curves or {}).items() if Path(p).is_file()}
    rows = {k: v for k, v in rows.items() if v}
    if not rows:
        return _note_png(path, "no RL learning curve was given")
    fig = _figure(11, 3.4)
    offset = 0
    axes = [fig.add_subplot(1, 3, i + 1) for i in range(3)]
    for name, rs in rows.items():
        x = [offset + int(r["iteration"]) for r in rs]
        for ax, col in zip(axes, ("success", "kl", "entropy")):
            line, = ax.plot(x, [float(r[col]) if r.get(col) not in (None, "") else math.nan for r in rs], label=f"rl@{name}")
            if col == "success" and all(r.get("episodes") for r in rs):  # the iteration's episodes: a Wilson band
                band = [wilson_interval(round(float(r["success"]) * int(r["episodes"])), int(r["episodes"])) for r in rs]
                ax.fill_between(x, [b[0] for b in band], [b[1] for b in band], alpha=0.2, color=line.get_color())
        offset = x[-1]
    for ax, title in zip(axes, ("rollout success (band: 95% Wilson CI)", "KL to the reference", "entropy of actions")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL iteration")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    _save(fig, path)
    return True


def _html_table(md: str) -> str:
    """A markdown pipe table (as rendered above) as an HTML table."""
    import html

    rows = [r.strip().strip("|").split("|") for r in md.strip().splitlines()]
    head, body = rows[0], rows[2:]
    cell = lambda c, t: f"<{t}>{html.escape(c.strip()).replace('**', '')}</{t}>"  # noqa: E731
    out = ["<table>", "<tr>" + "".join(cell(c, "th") for c in head) + "</tr>"]
    out += ["<tr>" + "".join(cell(c, "td") for c in r) + "</tr>" for r in body]
    return "\n".join(out + ["</table>"])


def render_html(metrics: dict, comparisons: list[dict], panels: dict | None, images: list[Path],
                meta: dict | None = None) -> str:
    import base64
    import html

    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>agentkiln evaluation</title><style>",
             "body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}",
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}",
             "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}",
             "</style></head><body>", "<h1>agentkiln evaluation</h1>", f"<p>{html.escape(summary_line(metrics)).replace('**', '')}</p>"]
    if meta:  # what produced this page: commit, params, the commit's date (not the wall clock: same bytes)
        parts.append("<p class='meta'>" + " &middot; ".join(f"{html.escape(k)} <code>{html.escape(str(v))}</code>"
                                                           for k, v in meta.items()) + "</p>")
    if comparisons:
        parts.append(f"<p>{html.escape(regression_line(comparisons)).replace('**', '')}</p>")
    if images and (Path(images[0]).parent / "trajectories.html").is_file():  # written just before
        parts.append("<p><a href='trajectories.html'>Episodes turn by turn</a> (the trajectory viewer)</p>")
    if panels:
        parts.append("<p>Panels: " + ", ".join(f"{html.escape(k)} <code>{html.escape(v)}</code>" for k, v in sorted(panels.items())) + "</p>")
    for img in images:
        parts.append(f"<img alt='{img.stem}' src='data:image/png;base64,{base64.b64encode(img.read_bytes()).decode()}'>")
    sections = [("Success on the test panel (95% Wilson CI)", markdown_table(metrics)),
                ("Paired comparisons (bootstrap over tasks)", comparison_table(comparisons) if comparisons else ""),
                ("Paired comparisons per family", family_comparison_table(comparisons)),
                ("Per family (test)", family_table(metrics)),
                ("Second draw (val)", family_table(metrics, "val") if any("val" in m for m in metrics.values()) else ""),
                ("Out of distribution", family_table(metrics, "ood") if any("ood" in m for m in metrics.values()) else ""),
                ("Per difficulty level (test)", breakdown_table(metrics, "by_level")),
                ("Per task type (test)", breakdown_table(metrics, "by_task_type")),
                ("Efficiency (test, greedy)", efficiency_table(metrics)),
                ("pass@k (test, sampled)", pass_k_table(metrics))]
    for title, table in sections:
        if table:
            parts += [f"<h2>{html.escape(title)}</h2>", _html_table(table)]
    return "\n".join(parts + ["</body></html>"]) + "\n"


def headline(metrics: dict, families: bool = False) -> dict:
    """The few numbers `dvc metrics show` prints (metrics.json's breakdowns made ~600 columns; DVC
    prints one row per file, a column per number): per policy, success on the test, val and ood panels;
    with `families`, on the test panel per family too (the parent MLflow run's)."""
    out = {}
    for policy in ordered_policies(metrics):
        m = metrics[policy]
        row = {"test": m.get("success")}
        for panel in OPTIONAL_PANELS:
            if isinstance(m.get(panel), dict):
                row[panel] = m[panel].get("success")
        if families:
            row |= {f"test_{family}": f.get("success") for family, f in sorted((m.get("by_family") or {}).items())}
        out[policy] = row
    return out


def write_reports(metrics: dict, out_dir: Path, comparisons: list[dict] | None = None,
                  curves: dict[str, Path] | None = None, panels: dict | None = None,
                  meta: dict | None = None) -> list[Path]:
    """Write metrics.json, eval.md, eval.html, success.csv, passk.csv and the PNGs into `out_dir`;
    comparisons.json when comparisons are given. Returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounded = _round(metrics)
    comparisons = _round(comparisons or [])
    (out_dir / "metrics.json").write_text(json.dumps(rounded, indent=2, sort_keys=True) + "\n")
    (out_dir / "headline.json").write_text(json.dumps(headline(rounded), indent=2, sort_keys=True) + "\n")
    (out_dir / "comparisons.json").write_text(json.dumps(comparisons, indent=2, sort_keys=True) + "\n")
    (out_dir / "eval.md").write_text(render_full_markdown(rounded, comparisons, panels))
    (out_dir / "success.csv").write_text(render_csv(rounded))
    (out_dir / "passk.csv").write_text(render_pass_k_csv(rounded))
    render_png(rounded, out_dir / "success.png")
    images = [out_dir / "success.png"]
    for name, render in (("passk.png", lambda p: render_pass_k_png(rounded, p)), ("curves.png", lambda p: render_curves_png(curves, p))):
        if render(out_dir / name):  # always written (a note when there is nothing to plot)
            images.append(out_dir / name)
    (out_dir / "eval.html").write_text(render_html(rounded, comparisons, panels, images, meta))
    return [out_dir / n for n in ("metrics.json", "headline.json", "comparisons.json", "eval.md", "eval.html", "success.csv", "passk.csv",
                                  "success.png", "passk.png", "curves.png")]
