"""Evaluation reports: every file written, JSON round-trips, identical input -> identical bytes."""

import csv
import json

import pytest

from agentkiln.evaluate.report import summary_line, write_reports


def _metrics():
    return {
        "random": {"success": 0.2, "ci_low": 0.1333333333, "ci_high": 0.2888888888, "n_tasks": 100,
                   "mean_turns": 12.345678, "invalid_rate": 0.0, "n_params": None},
        "sft": {"success": 0.55, "ci_low": 0.452, "ci_high": 0.644, "n_tasks": 100,
                "mean_turns": 8.1, "invalid_rate": 0.01234567, "n_params": 812345},
        "rl": {"success": 0.7, "ci_low": 0.604, "ci_high": 0.781, "n_tasks": 100, "mean_turns": 6.0,
               "invalid_rate": 0.0, "n_params": 812345, "rl_pool_success_before": 0.41},
        "distilled": {"success": 0.66, "ci_low": 0.563, "ci_high": 0.745, "n_tasks": 100,
                      "mean_turns": 6.5, "invalid_rate": 0.002, "n_params": 201234},
    }


def test_writes_every_file(tmp_path):
    write_reports(_metrics(), tmp_path / "reports")
    for f in ("metrics.json", "eval.md", "success.png", "success.csv"):
        assert (tmp_path / "reports" / f).stat().st_size > 0, f
    assert (tmp_path / "reports/success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_round_trips_rounded(tmp_path):
    m = _metrics()
    write_reports(m, tmp_path)
    back = json.loads((tmp_path / "metrics.json").read_text())
    assert set(back) == set(m)
    assert back["random"]["ci_low"] == 0.1333
    assert back["random"]["mean_turns"] == 12.3457
    assert back["random"]["n_params"] is None
    assert back["sft"]["n_params"] == 812345 and isinstance(back["sft"]["n_params"], int)
    assert back["rl"]["rl_pool_success_before"] == 0.41  # extra keys survive
    text = (tmp_path / "metrics.json").read_text()
    assert text.index('"distilled"') < text.index('"random"') < text.index('"rl"')  # sorted keys
    from agentkiln.evaluate.report import headline

    assert json.loads((tmp_path / "headline.json").read_text()) == headline(back)  # `dvc metrics show`'s file


def test_markdown_names_every_policy_and_the_gains(tmp_path):
    write_reports(_metrics(), tmp_path)
    md = (tmp_path / "eval.md").read_text()
    for p in ("random", "sft", "rl", "distilled"):
        assert f"| {p} |" in md
    assert "| policy | success | 95% CI | n | mean turns | invalid rate | parameters |" in md
    assert "Best policy: **rl**" in md
    assert "sft vs random: +35.0 points" in md  # 55 % - 20 %
    assert "rl vs sft: +15.0 points" in md  # 70 % - 55 %
    assert "[45.2%, 64.4%]" in md


def test_csv_for_dvc_plots(tmp_path):
    write_reports(_metrics(), tmp_path)
    rows = list(csv.DictReader((tmp_path / "success.csv").open()))
    assert [r["policy"] for r in rows] == ["random", "sft", "rl", "distilled"]
    assert set(rows[0]) == {"policy", "success", "ci_low", "ci_high"}
    assert float(rows[1]["success"]) == 0.55


def test_identical_input_identical_bytes(tmp_path):
    write_reports(_metrics(), tmp_path / "a")
    write_reports(_metrics(), tmp_path / "b")
    for f in ("metrics.json", "eval.md", "success.csv", "success.png"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_missing_policies_and_summary_edge_cases(tmp_path):
    m = {k: v for k, v in _metrics().items() if k in ("random", "distilled")}
    write_reports(m, tmp_path)
    md = (tmp_path / "eval.md").read_text()
    assert "| sft |" not in md and "| distilled |" in md
    assert "points" not in md  # no pair to compare
    assert summary_line({}) == "No policy was evaluated."
    tie = {"sft": {"success": 0.5}, "rl": {"success": 0.5}}
    assert summary_line(tie).startswith("Best policy: **sft**")  # tie -> earlier in pipeline order


def test_headline_never_crowns_a_policy_below_random():
    """The issue's case: 'Best policy: sft (0.0%)' while random scored 6%."""
    m = {"random": {"success": 0.06, "ci_low": 0.02, "ci_high": 0.15}, "sft": {"success": 0.0, "ci_low": 0.0, "ci_high": 0.07}}
    line = summary_line(m)
    assert line.startswith("No trained policy beats the random baseline (6.0%)") and "Best policy" not in line
    assert "**sft**, has 0.0% success, 95% CI [0.0%, 7.0%]" in line
    m["sft"] = {"success": 0.1, "ci_low": 0.04, "ci_high": 0.2}
    assert "above random (6.0%) but the 95% intervals overlap; sft vs random: +4.0 points" in summary_line(m)
    m["sft"] = {"success": 0.5, "ci_low": 0.4, "ci_high": 0.6}
    assert summary_line(m).startswith("Best policy: **sft** (50.0% success, 95% CI [40.0%, 60.0%]), above random (6.0%);")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_become_null(tmp_path, bad):
    m = _metrics()
    m["random"]["mean_turns"] = bad
    write_reports(m, tmp_path)
    text = (tmp_path / "metrics.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["random"]["mean_turns"] is None
    assert "| random | 20.0% |" in (tmp_path / "eval.md").read_text()


def _with_families():
    m = _metrics()
    for name, base in (("random", 0.1), ("sft", 0.5), ("rl", 0.6), ("distilled", 0.4)):
        fam = {"sokoban": {"success": base, "ci_low": 0.0, "ci_high": 1.0, "n_tasks": 40},
               "textworld": {"success": base + 0.25, "ci_low": 0.0, "ci_high": 1.0, "n_tasks": 60}}
        m[name]["by_family"] = fam
        m[name]["ood"] = {"success": base / 2, "ci_low": 0.0, "ci_high": 0.5, "n_tasks": 20,
                          "by_family": {"sokoban": {"success": base / 2, "ci_low": 0.0, "ci_high": 0.5, "n_tasks": 20}}}
    return m


def test_eval_md_breaks_success_down_per_family_and_ood(tmp_path):
    write_reports(_with_families(), tmp_path)
    md = (tmp_path / "eval.md").read_text()
    per_family, ood = md.split("## Per family (test panel)")[1].split("## Out-of-distribution panel")
    rows = {line.split("|")[1].strip(): line for line in per_family.splitlines() if line.startswith("| ")}
    assert rows["sokoban"].startswith("| sokoban | 40 | 10.0% [0.0%, 100.0%] | 50.0%")
    assert rows["textworld"].startswith("| textworld | 60 | 35.0%")
    assert rows["**all**"].startswith("| **all** | 100 | 20.0% [13.3%, 28.9%] | 55.0%")  # the panel's own row
    ood_rows = [line for line in ood.splitlines() if line.startswith("| sokoban")]
    assert ood_rows == ["| sokoban | 20 | 5.0% [0.0%, 50.0%] | 25.0% [0.0%, 50.0%] | 30.0% [0.0%, 50.0%] | 20.0% [0.0%, 50.0%] |"]
    assert (tmp_path / "success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_reports(_with_families(), tmp_path / "again")  # identical input, identical bytes
    for f in ("eval.md", "success.png", "metrics.json"):
        assert (tmp_path / f).read_bytes() == (tmp_path / "again" / f).read_bytes()


def test_every_rate_plot_carries_its_ci_and_the_page_its_provenance(tmp_path):
    """Per-family bars have error bars, pass@k and the RL success curve a band; eval.html names the
    commit, its date and the params hash (the commit's date, so the same inputs give the same bytes)."""
    from agentkiln.evaluate import report

    m = _metrics()
    for p in m.values():
        p["by_family"] = {"sokoban": {"success": 0.5, "ci_low": 0.3, "ci_high": 0.7, "n_tasks": 10},
                          "textworld": {"success": 0.2, "ci_low": 0.05, "ci_high": 0.5, "n_tasks": 10}}
    m["rl"]["pass_at_k"], m["rl"]["n_tasks"] = {"1": 0.5, "2": 0.7}, 20
    drawn = []
    from matplotlib.axes import Axes

    orig_bar, orig_fill = Axes.bar, Axes.fill_between

    def bar(self, *a, **k):
        drawn.append(("bar", self.get_title(), k.get("yerr") is not None))
        return orig_bar(self, *a, **k)

    def fill(self, *a, **k):
        drawn.append(("band", self.get_title(), True))
        return orig_fill(self, *a, **k)

    curve = tmp_path / "curve.csv"
    curve.write_text("iteration,success,kl,entropy,episodes\n1,0.25,0.0,1.0,8\n2,0.5,0.01,0.9,8\n")
    Axes.bar, Axes.fill_between = bar, fill
    try:
        meta = {"commit": "abc123", "commit date": "2026-11-23T10:00:00+00:00", "params.yaml": "p0"}
        report.write_reports(m, tmp_path / "a", curves={"main": curve}, meta=meta)
    finally:
        Axes.bar, Axes.fill_between = orig_bar, orig_fill
    assert drawn and all(has_ci for _, _, has_ci in drawn)
    assert sum(kind == "band" for kind, _, _ in drawn) == 2  # pass@k (rl) and the RL success curve
    assert sum(kind == "bar" for kind, _, _ in drawn) == 4 + 1  # per family x 4 policies, + the overall bars
    html = (tmp_path / "a" / "eval.html").read_text()
    assert "commit <code>abc123</code>" in html and "2026-11-23T10:00:00+00:00" in html and "<code>p0</code>" in html
    report.write_reports(m, tmp_path / "b", curves={"main": curve}, meta=meta)
    assert (tmp_path / "a" / "eval.html").read_bytes() == (tmp_path / "b" / "eval.html").read_bytes()


def test_headline_says_each_familys_change():
    """The issue's case: rl beat sft by 23 points overall while two of three families fell."""
    fam = lambda c, f, w: {"textworld": {"success": c}, "gym-toytext": {"success": f}, "python-tool": {"success": w}}  # noqa: E731
    m = {"sft": {"success": 0.331, "by_family": fam(0.388, 0.4, 0.15)},
         "rl": {"success": 0.562, "by_family": fam(1.0, 0.225, 0.025)}}
    assert "rl vs sft: +23.1 points (gym-toytext -17.5, python-tool -12.5, textworld +61.2)" in summary_line(m)


def test_the_run_summary_reads_what_exists(tmp_path):
    from agentkiln.stages.summary import pipeline_metrics, pipeline_summary

    assert pipeline_metrics(tmp_path, "main") == {}  # nothing ran: nothing said, nothing broken
    assert pipeline_summary(tmp_path, "main")[0].startswith("agentkiln: the pipeline finished")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/metrics.json").write_text(json.dumps({
        "sft": {"success": 0.5, "ood": {"success": 0.25}, "by_family": {"textworld": {"success": 0.75}}}}))
    (tmp_path / "reports/promotion.json").write_text(json.dumps({"candidate": "sft", "version": "3", "score": 0.5,
                                                                  "promoted": False, "reason": "the champion is better"}))
    lines = pipeline_summary(tmp_path, "main")
    assert "  evaluate  test panel: sft 50.0% (ood 25.0%)" in lines
    assert "  promote   sft (version 3, score 50.0%): not promoted: the champion is better" in lines
    assert pipeline_metrics(tmp_path, "main") == {"sft/test": 0.5, "sft/ood": 0.25, "sft/test_textworld": 0.75,
                                                  "promote/score": 0.5, "promote/promoted": 0.0}


def test_headline_metrics_are_success_per_policy_panel_and_family(tmp_path):
    from agentkiln.evaluate.report import headline

    m = {"rl": {"success": 0.6, "ood": {"success": 0.2}, "by_family": {"textworld": {"success": 0.9}},
                "by_level": {"easy": {"success": 0.6}}, "mean_turns": 4.0},
         "random": {"success": 0.0}}
    assert headline(m) == {"random": {"test": 0.0}, "rl": {"test": 0.6, "ood": 0.2}}
    assert headline(m, families=True)["rl"] == {"test": 0.6, "ood": 0.2, "test_textworld": 0.9}
