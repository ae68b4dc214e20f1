"""The findings: claims validated at load (arms exist, same budget), the summary math against hand-computed
paired differences, verdicts, the report files (deterministic JSON), resume from cached runs, one tiny
end-to-end run."""

import json

import pytest
import torch
import yaml

from agentkiln.config import ParamsError, load_params
from agentkiln.evaluate.findings_report import compare, publish, verdict
from agentkiln.stats import paired_difference
from agentkiln.stages import findings
from agentkiln.stages.common import load_split
from tests.test_config import ROOT, write
from tests.conftest import apply_profile_script

TINY_BASE = {"iterations": 100, "episode_budget": 8, "tasks_per_iter": 2, "group_size": 2, "max_turns": 4,
             "rollout_batch": 8}
ARMS = {"grpo": {"stages": [{"algorithm": "grpo"}]}, "gigpo": {"stages": [{"algorithm": "gigpo"}]},
        "clip_sym": {"stages": [{"algorithm": "gigpo", "clip_high": 0.2}]}}
CLAIMS = [{"id": "gigpo", "claim": "GiGPO beats GRPO", "paper": "Feng et al. 2025", "a": "grpo", "b": "gigpo"},
          {"id": "clip_higher", "claim": "clip-higher beats a symmetric clip", "paper": "Yu et al. 2025",
           "a": "clip_sym", "b": "gigpo"}]


def tiny_params(tmp_path, arms=ARMS, claims=CLAIMS, seeds=(0, 1)):
    """params.yaml with a findings section of existing RL keys only, at a tiny budget, panel test."""
    def mutate(raw):
        raw["findings"] = {"seeds": list(seeds), "workers": 1, "panels": ["test"], "base": TINY_BASE,
                           "arms": arms, "claims": claims}
        raw["evaluate"]["max_turns"] = 4
    return load_params(write(tmp_path, mutate))


# ------------------------------------------------------------------------------------------ config
def test_repository_claims_compare_arms_at_one_budget():
    p = load_params(ROOT / "params.yaml")
    assert len(p.findings.claims) >= 10 and len(p.findings.seeds) >= 3
    for c in p.findings.claims:
        assert p.findings_budget(c.a) == p.findings_budget(c.b), c.id
    # ScalingInter: a horizon growing from 8 turns to each task's own limit (null), against that limit from the start
    assert [s.max_turns for s in p.findings_stages("scaling")] == [8, None]
    assert [s.max_turns for s in p.findings_stages("gigpo")] == [None]
    assert p.findings.arms["scratch"].init == "scratch"


def params_of(profile: str, tmp_path):
    """params.yaml as a profile's findings run it: as it is for the default, profiles/<name>.yaml applied
    (by scripts/apply_profile.py, validated) otherwise."""
    if profile == "default":
        return load_params(ROOT / "params.yaml")
    ap = apply_profile_script()
    out = tmp_path / f"params-{profile}.yaml"
    assert ap.main([str(ROOT / "profiles" / f"{profile}.yaml"), "--params", str(ROOT / "params.yaml"),
                    "--out", str(out)]) == 0
    return load_params(out)


def test_published_claims_were_measured_with_the_arms_params_define_today(tmp_path):
    """docs/findings.json is what the README's findings tables quote: a claim whose arm runs otherwise
    today (its stages and SFT as findings.resolved spells them out), whose budget, seeds, panels or
    shared RL settings (findings.base) have changed in params.yaml or its profile is stale and must be
    run again (`python -m flows.findings --claims ID`, then `--publish`)."""
    published = json.loads((ROOT / "docs" / "findings.json").read_text())
    assert set(published["profiles"]) == {c["profile"] for c in published["claims"]} >= {"default", "smollm2"}
    for profile, meta in published["profiles"].items():
        f = (p := params_of(profile, tmp_path)).findings
        assert (f.profile, meta["base"], meta["seeds"], meta["panels"]) == (profile, f.base, f.seeds, f.panels)
        claims = {c.id: c for c in f.claims}
        for c in (c for c in published["claims"] if c["profile"] == profile):
            assert c["id"] in claims, f"{profile}: published claim {c['id']} is no longer in params"
            for side in ("a", "b"):
                arm = c["arms"][side]
                assert arm["name"] == getattr(claims[c["id"]], side), (profile, c["id"], side)
                then = p.model_copy(deep=True)  # the arm as published, merged with today's defaults
                then.findings.arms[arm["name"]] = type(f.arms[arm["name"]]).model_validate(arm["spec"])
                assert findings.resolved(then, arm["name"]) == findings.resolved(p, arm["name"]), (
                    f"{profile}: claim {c['id']}'s arm {arm['name']} runs otherwise in params today")
                assert arm["budget"] == p.findings_budget(arm["name"]), (profile, c["id"], arm["name"])


def test_claims_name_existing_arms_at_the_same_budget(tmp_path):
    def claim(**kw):
        return lambda raw: raw["findings"].update(arms=ARMS, claims=[dict(CLAIMS[0], **kw)])

    with pytest.raises(ParamsError, match=r"findings.claims.gigpo.b = 'gigpoo': no such arm"):
        load_params(write(tmp_path, claim(b="gigpoo")))
    big = dict(ARMS, big={"stages": [{"algorithm": "gigpo", "episode_budget": 64}, {"episode_budget": 64}]})
    with pytest.raises(ParamsError, match=r"findings.claims.gigpo: arms grpo \(768 episodes\) and big \(128 episodes\) "
                                          "spend different rollout budgets"):
        load_params(write(tmp_path, lambda raw: raw["findings"].update(arms=big, claims=[dict(CLAIMS[0], b="big")])))
    bad = dict(ARMS, gigpo={"stages": [{"algorithm": "sarsa"}]})
    with pytest.raises(ParamsError, match=r"findings.arms.gigpo.stages.0.algorithm = 'sarsa'"):
        load_params(write(tmp_path, lambda raw: raw["findings"].update(arms=bad, claims=CLAIMS)))
    typo = dict(ARMS, gigpo={"stages": [{"clip_hihg": 0.3}]})
    with pytest.raises(ParamsError, match=r"findings.arms.gigpo.stages.0.clip_hihg: unknown key"):
        load_params(write(tmp_path, lambda raw: raw["findings"].update(arms=typo, claims=CLAIMS)))
    sft_on_sft = dict(ARMS, gigpo={"sft": {"epochs": 2}, "stages": [{}]})
    with pytest.raises(ParamsError, match=r"findings.arms.gigpo.sft: overrides apply to init: sft_arm only"):
        load_params(write(tmp_path, lambda raw: raw["findings"].update(arms=sft_on_sft, claims=CLAIMS)))
    with pytest.raises(ParamsError, match=r"findings.claims.gigpo: a and b are the same arm"):
        load_params(write(tmp_path, claim(b="grpo")))


def test_an_sft_arm_merges_its_overrides_into_the_sft_section(tmp_path):
    arms = dict(ARMS, own={"init": "sft_arm", "sft": {"epochs": 3, "model": {"hidden_size": 64}}, "stages": []},
                own2={"init": "sft_arm", "stages": []})
    p = tiny_params(tmp_path, arms, CLAIMS + [{"id": "sft", "claim": "c", "paper": "p", "a": "own2", "b": "own"}])
    sft = p.findings_sft("own")
    assert (sft.epochs, sft.model.hidden_size, sft.model.num_layers) == (3, 64, p.sft.model.num_layers)
    assert p.findings_budget("own") == 0 and p.findings_stages("own") == []


# ------------------------------------------------------------------------------------------ the math
def test_verdicts():
    assert verdict(0.01, 0.2) == "reproduced"
    assert verdict(-0.2, 0.0) == verdict(-0.3, -0.1) == "not reproduced"
    assert verdict(-0.1, 0.1) == verdict(0.0, 0.3) == "inconclusive"


def test_compare_matches_hand_computed_paired_differences():
    a = [[1, 0, 0, 1], [0, 0, 1, 1]]
    b = [[1, 1, 0, 1], [1, 0, 1, 1]]
    types = ["x", "x", "y", "y"]
    r = compare(a, b, types, 0.95, 500)
    # b - a = [[0, 1, 0, 0], [1, 0, 0, 0]]: 2 of 8 cells
    assert r["effect"]["diff"] == 0.25 and (r["n_seeds"], r["n_tasks"]) == (2, 4)
    assert r["a"]["success"] == 0.5 and r["b"]["success"] == 0.75 and r["b"]["per_seed"] == [0.75, 0.75]
    _, lo, hi = paired_difference(b, a, 0.95, 500)
    assert (r["effect"]["ci_low"], r["effect"]["ci_high"]) == (round(lo, 4), round(hi, 4))
    assert r["by_type"]["x"]["diff"] == 0.5 and r["by_type"]["x"]["a"] == 0.25 and r["by_type"]["x"]["b"] == 0.75
    assert r["by_type"]["y"] == {"n_tasks": 2, "a": 0.75, "b": 0.75, "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0,
                                 "verdict": "not reproduced"}
    with pytest.raises(ValueError, match="same shape"):
        compare(a, b, types[:3], 0.95, 500)


# ------------------------------------------------------------------------------------------ the runner
CALLS = []


def fake_run(params, arm, seed, tasks_dir, sft_dir):
    """gigpo wins every task, clip_sym every task but the first, grpo none."""
    CALLS.append((arm, seed))
    out = {"outcomes": {}, "task_ids": {}}
    for panel in params.findings.panels:
        ids = [t.task_id for t in load_split(tasks_dir, panel)]
        won = {"gigpo": [1] * len(ids), "clip_sym": [0] + [1] * (len(ids) - 1)}.get(arm, [0] * len(ids))
        out["outcomes"][panel], out["task_ids"][panel] = won, ids
    return out | {"arm": arm, "seed": seed, "curve": [], "sft": None, "episodes": 8, "seconds": 60.0,
                  "machine": "test machine"}


def test_report_files_deterministic_json_and_resume_from_cached_runs(tmp_path):
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    params = tiny_params(tmp_path)
    out, sft = tmp_path / "reports" / "findings", tmp_path / "models" / "sft"
    CALLS.clear()
    lines = []
    result = findings.run_findings(params, tasks_dir, out, sft, run=fake_run, say=lines.append)
    assert sorted(CALLS) == [(a, s) for a in ("clip_sym", "gigpo", "grpo") for s in (0, 1)]  # gigpo: once, shared
    assert lines[0] == "findings: 6 runs (3 arms x 2 seeds), 0 cached, 6 to run" and len(lines) == 7
    assert lines[-1].startswith("findings: [6/6] ")
    by_id = {c["id"]: c for c in result["claims"]}
    assert by_id["gigpo"]["diff"] == 1.0 and by_id["gigpo"]["verdict"] == "reproduced"
    assert by_id["clip_higher"]["diff"] == round(1 / 3, 4) and by_id["clip_higher"]["n_tasks"] == 3
    assert by_id["gigpo"]["arms"]["a"] == {"name": "grpo", "budget": 8,
                                           "spec": {"init": "sft", "sft": {}, "stages": [{"algorithm": "grpo"}]}}
    assert set(by_id["gigpo"]["panels"]["test"]["by_type"]) == {t.task_type for t in load_split(tasks_dir, "test")}
    first = (out / "findings.json").read_bytes()
    assert json.loads(first) == result and first.decode() == json.dumps(result, indent=1, sort_keys=True) + "\n"
    assert "meta" in result and "seconds" not in json.dumps(result["claims"])
    md = (out / "findings.md").read_text()
    assert "| gigpo: GiGPO beats GRPO | Feng et al. 2025 | gigpo vs grpo | 0.0 | 100.0 | +100.0 [+100.0, +100.0] " \
           "| **reproduced** |" in md
    assert "python -m flows.findings" in md and "## Per task type" in md
    assert (out / "findings.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((out / "runs").glob("*.json"))) == 6

    # a second invocation trains nothing and writes the same bytes
    CALLS.clear()
    again = findings.run_findings(params, tasks_dir, out, sft, run=fake_run, say=lines.append)
    assert CALLS == [] and again == result and (out / "findings.json").read_bytes() == first

    # a new claim trains its new arm only; a changed arm is a new run
    arms = dict(ARMS, dapo={"stages": [{"algorithm": "gigpo", "dynamic_sampling": True}]})
    more = tiny_params(tmp_path, arms, CLAIMS + [{"id": "dapo", "claim": "c", "paper": "p", "a": "gigpo", "b": "dapo"}])
    findings.run_findings(more, tasks_dir, out, sft, run=fake_run, say=lines.append)
    assert sorted(CALLS) == [("dapo", 0), ("dapo", 1)]
    assert findings.run_key(more, "gigpo", 0, tasks_dir, sft) == findings.run_key(params, "gigpo", 0, tasks_dir, sft)
    changed = tiny_params(tmp_path, dict(ARMS, grpo={"stages": [{"algorithm": "grpo", "lr": 1e-4}]}))
    assert findings.run_key(changed, "grpo", 0, tasks_dir, sft) != findings.run_key(params, "grpo", 0, tasks_dir, sft)

    docs = tmp_path / "docs"
    written = publish(out, docs)
    assert [p.name for p in written] == ["findings.md", "findings.json", "findings.png"]
    published, last = json.loads((docs / "findings.json").read_text()), json.loads((out / "findings.json").read_text())
    assert published["claims"] == last["claims"] and all(c["profile"] == "default" for c in last["claims"])
    assert published["profiles"]["default"] == {k: v for k, v in last.items() if k != "claims"}
    assert "](images/findings.png)" in (docs / "findings.md").read_text()

    # another profile's claims join the file beside the default's (its own markdown and plot); publishing
    # a profile again replaces only its own
    other = tmp_path / "reports" / "findings" / "real"
    other.mkdir(parents=True)
    real = json.loads((out / "findings.json").read_text())
    real = real | {"profile": "real", "claims": [c | {"profile": "real"} for c in real["claims"][:1]]}
    (other / "findings.json").write_text(json.dumps(real))
    for name in ("findings.md", "findings.png"):
        (other / name).write_bytes((out / name).read_bytes())
    assert [p.name for p in publish(other, docs)] == ["findings-real.md", "findings.json", "findings-real.png"]
    publish(other, docs)
    both = json.loads((docs / "findings.json").read_text())
    assert [(c["profile"], c["id"]) for c in both["claims"]] == [("default", c["id"]) for c in last["claims"]] + [
        ("real", last["claims"][0]["id"])]
    assert sorted(both["profiles"]) == ["default", "real"] and (docs / "images" / "findings-real.png").is_file()


def test_a_run_of_some_claims_replaces_only_those_when_published(tmp_path):
    from agentkiln.errors import UserError
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    out, sft, docs = tmp_path / "reports" / "findings", tmp_path / "models" / "sft", tmp_path / "docs"
    full = findings.run_findings(tiny_params(tmp_path), tasks_dir, out, sft, run=fake_run, say=lambda _: None)
    publish(out, docs)
    # clip_higher's a arm changed: only its claim runs (only the new arm trains), the gigpo claim is kept
    arms = dict(ARMS, clip_wide={"stages": [{"algorithm": "gigpo", "clip_high": 0.25}]})
    claims = [CLAIMS[0], dict(CLAIMS[1], a="clip_wide")]
    CALLS.clear()
    part = findings.run_findings(tiny_params(tmp_path, arms, claims), tasks_dir, out, sft, run=fake_run,
                                 say=lambda _: None, only=["clip_higher"])
    assert sorted(CALLS) == [("clip_wide", 0), ("clip_wide", 1)]  # gigpo's runs are cached
    assert part["only"] == ["clip_higher"] and [c["id"] for c in part["claims"]] == ["clip_higher"]
    assert set(part["arms"]) == {"clip_wide", "gigpo"}
    publish(out, docs)
    now = json.loads((docs / "findings.json").read_text())
    assert [c["id"] for c in now["claims"]] == ["gigpo", "clip_higher"]
    assert now["claims"][0] == full["claims"][0] | {"profile": "default"}  # untouched
    assert now["claims"][1]["arms"]["a"]["name"] == "clip_wide" and now["claims"][1]["diff"] == 1.0
    mine = now["profiles"]["default"]
    assert sorted(mine["arms"]) == ["clip_wide", "gigpo", "grpo"] and sorted(mine["per_seed"]) == sorted(mine["arms"])
    assert "only" not in mine and mine["meta"]["runs"] == 6 and mine["meta"]["total_minutes"] == 6.0
    md = (docs / "findings.md").read_text()
    assert "| gigpo vs grpo |" in md and "| gigpo vs clip_wide |" in md and "clip_sym" not in md
    assert (docs / "images" / "findings.png").read_bytes()[:4] == b"\x89PNG"
    # claims run at other seeds do not compare with the published ones: refused, docs untouched
    before = (docs / "findings.json").read_bytes()
    findings.run_findings(tiny_params(tmp_path, arms, claims, seeds=(0,)), tasks_dir, out, sft, run=fake_run,
                          say=lambda _: None, only=["clip_higher"])
    with pytest.raises(ValueError, match=r"the claims run \(clip_higher\) have seeds = \[0\], the published "
                                         r"'default' claims \[0, 1\]; run every claim"):
        publish(out, docs)
    assert (docs / "findings.json").read_bytes() == before
    with pytest.raises(UserError, match=r"no claim 'clip' in params.yaml findings.claims \(its claims: gigpo, clip_higher\)"):
        findings.run_findings(tiny_params(tmp_path), tasks_dir, out, sft, run=fake_run, only=["clip"])


def test_scratch_init_keeps_the_architecture_and_tokenizer_with_fresh_weights(tmp_path):
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    arms = dict(ARMS, scratch={"init": "scratch", "stages": [{"algorithm": "gigpo"}]})
    params = tiny_params(tmp_path, arms, [dict(CLAIMS[0], a="scratch")])
    sft_dir = tmp_path / "models" / "sft"
    sft, _ = findings.starting_policy(params, "gigpo", 0, tasks_dir, sft_dir)
    # (this test's models/sft is itself an untrained scratch model drawn with seed 0)
    fresh, _ = findings.starting_policy(params, "scratch", 3, tasks_dir, sft_dir)
    again, _ = findings.starting_policy(params, "scratch", 3, tasks_dir, sft_dir)
    assert type(fresh.model) is type(sft.model) and fresh.model.config.to_dict() == sft.model.config.to_dict()
    assert fresh.tokenizer.get_vocab() == sft.tokenizer.get_vocab()
    w = lambda p: p.model.get_input_embeddings().weight  # noqa: E731
    assert not torch.equal(w(fresh), w(sft)) and torch.equal(w(fresh), w(again))  # fresh, and seeded


def test_a_tiny_findings_run_end_to_end(tmp_path):  # ~12 s: two arms x one seed, 8 episodes each
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    params = tiny_params(tmp_path, claims=CLAIMS[:1], seeds=(0,))
    out = tmp_path / "reports" / "findings"
    result = findings.run_findings(params, tasks_dir, out, tmp_path / "models" / "sft", say=lambda line: None)
    runs = sorted((out / "runs").glob("*.json"))
    assert [p.name.split("-")[0] for p in runs] == ["gigpo", "grpo"]
    run = json.loads(runs[0].read_text())
    assert run["episodes"] == 8 and len(run["outcomes"]["test"]) == 3 and set(run["outcomes"]["test"]) <= {0, 1}
    assert result["claims"][0]["verdict"] in ("reproduced", "not reproduced", "inconclusive")
    assert yaml.safe_load((out / "findings.md").read_text().split("\n")[0].lstrip("# ")) == "Findings"


def test_an_sft_arm_trains_its_own_sft_per_seed_then_plays(tmp_path):
    from tests.conftest import tiny_dataset

    tasks_dir = tmp_path / "tasks"
    tiny_dataset(tasks_dir, {s: {"frozenlake_easy": 1.0} for s in ("sft", "rl", "test")}, n={"sft": 6, "rl": 2, "test": 2})
    tiny = {"epochs": 1, "batch_size": 2, "warmup_steps": 0,
            "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "vocab_size": 300}}
    arms = {"clean": {"init": "sft_arm", "sft": dict(tiny, data={"clean": 1.0, "recovery": 0.0}), "stages": []},
            "mixed": {"init": "sft_arm", "sft": dict(tiny, data={"clean": 1.0, "recovery": 1.0}), "stages": []}}
    params = tiny_params(tmp_path, arms, [{"id": "recovery", "claim": "c", "paper": "p", "a": "clean", "b": "mixed"}])
    run = findings.run_one(params, "mixed", 1, tasks_dir, tmp_path / "no-sft-model")
    assert run["episodes"] == 0 and run["curve"] == [] and run["sft"]["n_params"] > 0
    assert len(run["outcomes"]["test"]) == 2


def test_an_untrained_arm_is_the_start_of_a_claim_and_plays_once_for_every_seed(tmp_path):
    """A claim may set what RL adds against its starting policy (arm a: the same init, no training); that arm
    plays a fixed model greedily, so it runs once and its outcome stands for every seed. Two arms that train
    differently still need one budget."""
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    arms = {"start": {"init": "sft", "stages": []}, "gigpo": ARMS["gigpo"]}
    claims = [{"id": "rl_adds", "claim": "RL improves its start", "paper": "p", "a": "start", "b": "gigpo"}]
    params = tiny_params(tmp_path, arms, claims, seeds=(0, 1, 2))
    assert params.findings_budget("start") == 0 and params.findings_budget("gigpo") == 8
    out = tmp_path / "reports" / "findings"
    CALLS.clear()
    result = findings.run_findings(params, tasks_dir, out, tmp_path / "models" / "sft", run=fake_run, say=lambda _: None)
    assert sorted(CALLS) == [("gigpo", 0), ("gigpo", 1), ("gigpo", 2), ("start", 0)]
    assert len(list((out / "runs").glob("start-*.json"))) == 3  # each seed's file, the first one's outcome
    assert result["per_seed"]["start"] == [0.0, 0.0, 0.0] and result["claims"][0]["diff"] == 1.0
    other = dict(arms, start={"init": "base", "stages": []})  # another start than gigpo's: budgets must match
    with pytest.raises(ParamsError, match="spend different rollout budgets"):
        tiny_params(tmp_path, other, claims)
