"""The findings report: each claim is arm b vs arm a over the same (seed, task) cells.

    runs[arm][seed] = {"outcomes": {panel: [0/1 per task]}, "seconds": s, "machine": ...}
        -> per claim: success of a and b (+ CI), the paired difference b - a (+ CI) on the first panel,
           its verdict, the same on the other panels, and per task type (a regression never hides
           behind a headline)

reports/findings/findings.json (deterministic: sorted keys, rounded numbers, timings only under
`meta`), findings.md (tables) and findings.png (the effects with their CIs).
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from agentkiln.stats import bootstrap_mean, paired_difference

DIGITS = 4  # rounding of every number in findings.json: the same runs give the same bytes
REGENERATE = "python -m flows.findings   # or: agentkiln findings; then --publish copies the summary to docs/"


def verdict(ci_low: float, ci_high: float) -> str:
    """`reproduced`: the CI of b - a lies above 0; `not reproduced`: it reaches no higher than 0;
    `inconclusive`: it straddles 0 (more seeds, tasks or budget would be needed to tell)."""
    if ci_low > 0:
        return "reproduced"
    if ci_high <= 0:
        return "not reproduced"
    return "inconclusive"


def _r(x: float) -> float:
    return round(float(x), DIGITS)


def _success(rows: list[list[int]], confidence: float, n_boot: int) -> dict:
    m, lo, hi = bootstrap_mean(rows, confidence, n_boot)
    return {"success": _r(m), "ci_low": _r(lo), "ci_high": _r(hi), "per_seed": [_r(sum(r) / len(r)) for r in rows]}


def _effect(b: list[list[int]], a: list[list[int]], confidence: float, n_boot: int) -> dict:
    d, lo, hi = paired_difference(b, a, confidence, n_boot)
    return {"diff": _r(d), "ci_low": _r(lo), "ci_high": _r(hi), "verdict": verdict(_r(lo), _r(hi))}


def compare(a: list[list[int]], b: list[list[int]], types: list[str], confidence: float, n_boot: int) -> dict:
    """Arm b vs arm a on one panel: outcomes [seeds, tasks] in the same seed and task order; `types`
    names each task's type. Success of each arm with CI, the paired effect b - a with CI and its
    verdict, and the same effect per task type."""
    if len({len(r) for r in a + b} | {len(types)}) != 1 or len(a) != len(b):
        raise ValueError(f"compare needs [seeds, tasks] outcomes of the same shape with a type per task, got "
                         f"{len(a)}x{len(a[0]) if a else 0}, {len(b)}x{len(b[0]) if b else 0}, {len(types)} types")
    by_type = {}
    for t in sorted(set(types)):
        cols = [i for i, x in enumerate(types) if x == t]
        sub_a, sub_b = [[r[i] for i in cols] for r in a], [[r[i] for i in cols] for r in b]
        by_type[t] = {"n_tasks": len(cols), "a": _r(sum(map(sum, sub_a)) / (len(a) * len(cols))),
                      "b": _r(sum(map(sum, sub_b)) / (len(b) * len(cols))),
                      **_effect(sub_b, sub_a, confidence, n_boot)}
    return {"n_seeds": len(a), "n_tasks": len(types), "a": _success(a, confidence, n_boot),
            "b": _success(b, confidence, n_boot), "effect": _effect(b, a, confidence, n_boot), "by_type": by_type}


def summarize(claims: list[dict], arms: dict[str, dict], runs: dict[str, dict[int, dict]], seeds: list[int],
              panels: dict[str, list[str]], confidence: float, n_boot: int) -> list[dict]:
    """Every claim ({id, claim, paper, a, b, expect}) against the finished runs. `arms`: name -> {spec,
    budget}; `panels`: panel -> each task's type, in the order the runs' outcomes list them."""
    out = []
    for c in claims:
        per_panel = {}
        for panel, types in panels.items():
            rows = {side: [runs[c[side]][s]["outcomes"][panel] for s in seeds] for side in ("a", "b")}
            per_panel[panel] = compare(rows["a"], rows["b"], types, confidence, n_boot)
        first = next(iter(panels))
        head = per_panel[first]
        regressions = sorted(f"{p}/{t}" for p, r in per_panel.items() for t, x in r["by_type"].items()
                             if x["ci_high"] < 0)
        out.append({
            "id": c["id"], "claim": c["claim"], "paper": c["paper"], "expect": c["expect"],
            "arms": {side: {"name": c[side], **arms[c[side]]} for side in ("a", "b")},
            "panel": first, "n_seeds": head["n_seeds"], "n_tasks": head["n_tasks"],
            "success": {"a": head["a"], "b": head["b"]}, **head["effect"],
            "panels": per_panel, "regressions": regressions,
        })
    return out


def to_json(result: dict) -> str:
    """Deterministic JSON: sorted keys, fixed indentation, a final newline."""
    return json.dumps(result, indent=1, sort_keys=True) + "\n"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _eff(e: dict) -> str:
    return f"{100 * e['diff']:+.1f} [{100 * e['ci_low']:+.1f}, {100 * e['ci_high']:+.1f}]"


def _spec(spec: dict) -> str:
    stages = " -> ".join(", ".join(f"{k}={v}" for k, v in s.items()) or "base" for s in spec["stages"]) or "no RL"
    sft = f" (sft: {spec['sft']})" if spec.get("sft") else ""
    return f"{spec['init']}{sft}; {stages}"


def render_markdown(r: dict) -> str:
    """findings.md: the claims, their other panels and task types, each arm's seeds, how to regenerate."""
    conf = int(round(100 * r["confidence"]))
    first = r["panels"][0]
    lines = [
        "# Findings",
        "",
        f"Each claim is a pair of arms at the same RL rollout budget, trained with seeds {r['seeds']} and played "
        f"greedily on the frozen panels {', '.join(f'`{p}`' for p in r['panels'])}. The effect is the paired "
        f"difference b - a in success points over (seed, task) cells of `{first}`, with a {conf}% bootstrap CI over "
        "seeds and tasks. Verdict: **reproduced** when the CI lies above 0, **not reproduced** when it reaches no "
        "higher than 0, **inconclusive** otherwise."
        + (f" Only {len(r['seeds'])} seed(s): too few to judge a claim by (use at least 3)." if len(r["seeds"]) < 3 else ""),
        "",
        f"| claim | paper | b vs a | a | b | effect on {first} [{conf}% CI] | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["claims"]:
        a, b = c["arms"]["a"]["name"], c["arms"]["b"]["name"]
        warn = f" (regressed: {', '.join(c['regressions'])})" if c["regressions"] else ""
        lines.append(f"| {c['id']}: {c['claim']} | {c['paper']} | {b} vs {a} | {_pct(c['success']['a']['success'])} "
                     f"| {_pct(c['success']['b']['success'])} | {_eff(c)} | **{c['verdict']}**{warn} |")
    if len(r["panels"]) > 1:
        lines += ["", "## Other panels", "", "| claim | panel | a | b | effect [CI] | verdict |", "|---|---|---|---|---|---|"]
        for c in r["claims"]:
            for p in r["panels"][1:]:
                x = c["panels"][p]
                lines.append(f"| {c['id']} | {p} | {_pct(x['a']['success'])} | {_pct(x['b']['success'])} "
                             f"| {_eff(x['effect'])} | {x['effect']['verdict']} |")
    lines += ["", "## Per task type", "", "A CI below 0 on any type is flagged, whatever the headline.", "",
              "| claim | panel | task type | tasks | a | b | effect [CI] |", "|---|---|---|---|---|---|---|"]
    for c in r["claims"]:
        for p in r["panels"]:
            for t, x in c["panels"][p]["by_type"].items():
                flag = " **regressed**" if x["ci_high"] < 0 else ""
                lines.append(f"| {c['id']} | {p} | {t} | {x['n_tasks']} | {_pct(x['a'])} | {_pct(x['b'])} "
                             f"| {_eff(x)}{flag} |")
    meta = r.get("meta", {})
    lines += ["", "## Arms", "", f"Success on `{first}` per seed ({', '.join(map(str, r['seeds']))}); minutes: "
              "the arm's wall time (SFT if any, RL, every panel) divided by its seeds (an arm that trains nothing "
              "plays once, for all of them).", "",
              "| arm | init; RL stages | RL episodes | per seed | minutes |", "|---|---|---|---|---|"]
    for name, arm in r["arms"].items():
        seeds = " / ".join(_pct(x) for x in r["per_seed"][name])
        minutes = meta.get("minutes", {}).get(name)
        lines.append(f"| {name} | {_spec(arm['spec'])} | {arm['budget']} | {seeds} | "
                     f"{'-' if minutes is None else f'{minutes:.1f}'} |")
    lines += ["", "## Regenerate", "", "    " + REGENERATE, "",
              f"Shared RL settings (findings.base over rl.defaults): `{json.dumps(r['base'], sort_keys=True)}`. "
              f"Machine: {meta.get('machine', 'unknown')}; {meta.get('runs', 0)} runs, "
              f"{meta.get('total_minutes', 0):.1f} minutes of run time in all.", "",
              "![effects with their CIs](findings.png)", ""]
    return "\n".join(lines)


def render_png(r: dict, path: Path) -> None:
    """Each claim's effect b - a with its CI, one marker per panel (the first filled)."""
    claims = r["claims"]
    fig = Figure(figsize=(8, 0.5 * len(claims) + 1.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"reproduced": "#2a9d3a", "not reproduced": "#c0392b", "inconclusive": "#7f7f7f"}
    for k, p in enumerate(r["panels"]):
        for i, c in enumerate(claims):
            e = c["panels"][p]["effect"]
            y = len(claims) - 1 - i + 0.18 * k
            ax.errorbar(100 * e["diff"], y, xerr=[[100 * (e["diff"] - e["ci_low"])], [100 * (e["ci_high"] - e["diff"])]],
                        fmt="o" if k == 0 else "s", mfc=colors[e["verdict"]] if k == 0 else "white",
                        color=colors[e["verdict"]], capsize=3, label=p if i == 0 else None)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(claims)), [c["id"] for c in reversed(claims)], fontsize=8)
    ax.set_xlabel(f"b - a, success points ({int(round(100 * r['confidence']))}% CI)")
    ax.set_title("Findings: effect of each claim's treatment", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if len(r["panels"]) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None, "Creation Time": None})


def write_reports(r: dict, out_dir: Path) -> None:
    """findings.json, findings.md and findings.png under out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "findings.json").write_text(to_json(r))
    (out_dir / "findings.md").write_text(render_markdown(r))
    render_png(r, out_dir / "findings.png")


def published_name(profile: str) -> str:
    """The stem of a profile's summary in docs/: findings (the default recipe), findings-<profile> (others)."""
    return "findings" if profile == "default" else f"findings-{profile}"


def with_claims(old: dict, new: dict) -> dict:
    """A profile's report with the claims of `new`, a run of some of its claims only (`python -m flows.findings
    --claims ...`), in place of the same claims of `old`; old's other claims, their arms and timings kept.
    Both must share the seeds, panels and shared RL settings: claims run otherwise do not compare."""
    for key in ("seeds", "panels", "base", "confidence", "n_boot"):
        if old.get(key) != new.get(key):
            raise ValueError(f"findings: the claims run ({', '.join(new['only'])}) have {key} = {new.get(key)!r}, "
                             f"the published {new.get('profile', 'default')!r} claims {old.get(key)!r}; run every "
                             "claim (python -m flows.findings, no --claims) to replace them all")
    fresh = {c["id"]: c for c in new["claims"]}
    claims = [fresh.pop(c["id"], c) for c in old["claims"]] + list(fresh.values())
    used = [name for c in claims for name in (c["arms"]["a"]["name"], c["arms"]["b"]["name"])]
    arms = {name: new["arms"].get(name) or old["arms"][name] for name in dict.fromkeys(used)}
    per_seed = {name: new["per_seed"].get(name) or old["per_seed"][name] for name in arms}
    minutes = {name: new["meta"]["minutes"].get(name, old["meta"]["minutes"].get(name)) for name in arms}
    machines = sorted({m for r in (old, new) for m in r["meta"].get("machine", "").split("; ") if m})
    meta = {"machine": "; ".join(machines), "runs": len(arms) * len(new["seeds"]), "minutes": minutes,
            "total_minutes": round(sum(m for m in minutes.values() if m) * len(new["seeds"]), 2)}
    return {k: v for k, v in old.items() if k != "only"} | {"claims": claims, "arms": arms, "per_seed": per_seed,
                                                            "meta": meta}


def merged(existing: dict | None, report: dict) -> dict:
    """docs/findings.json: every profile's claims in one list (each names its profile), and each profile's
    report without them under `profiles`; `report` replaces its own profile's, the others are kept (a run
    of some claims only, `only`, replaces those claims of its profile: with_claims)."""
    profiles = {}
    if existing:
        if "profiles" in existing:
            profiles = dict(existing["profiles"])
            claims = {}
            for c in existing.get("claims", []):
                claims.setdefault(c.get("profile", "default"), []).append(c)
            profiles = {name: r | {"claims": claims.get(name, [])} for name, r in profiles.items()}
        else:  # one profile's report, written before profiles
            profiles = {existing.get("profile", "default"): existing}
    name = report.get("profile", "default")
    if report.get("only") and name in profiles:
        report = with_claims(profiles[name], report)
    profiles[name] = {k: v for k, v in report.items() if k != "only"}
    order = sorted(profiles, key=lambda name: (name != "default", name))
    return {"claims": [c | {"profile": name} for name in order for c in profiles[name]["claims"]],
            "profiles": {name: {k: v for k, v in profiles[name].items() if k != "claims"} for name in order}}


def publish(out_dir: Path, docs_dir: Path) -> list[Path]:
    """Copy a findings run's summary to docs/: its claims merged into findings.json beside every other
    profile's, and that profile's markdown (findings.md for the default recipe, findings-<profile>.md for
    a profile's) and plot (under images/) rendered from what findings.json now holds for it."""
    out_dir, docs_dir = Path(out_dir), Path(docs_dir)
    missing = [n for n in ("findings.md", "findings.json", "findings.png") if not (out_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{out_dir}: no {', '.join(missing)}; run `python -m flows.findings` first")
    report = json.loads((out_dir / "findings.json").read_text())
    name = report.get("profile", "default")
    stem = published_name(name)
    (docs_dir / "images").mkdir(parents=True, exist_ok=True)
    written = [docs_dir / f"{stem}.md", docs_dir / "findings.json", docs_dir / "images" / f"{stem}.png"]
    previous = json.loads(written[1].read_text()) if written[1].is_file() else None
    now = merged(previous, report)
    mine = now["profiles"][name] | {"claims": [c for c in now["claims"] if c["profile"] == name]}
    written[0].write_text(render_markdown(mine).replace("](findings.png)", f"](images/{stem}.png)"))
    written[1].write_text(to_json(now))
    render_png(mine, written[2])
    return written
