"""Extending agentkiln from your own files (docs/extending.md): the toy environment family and the toy reward
component of docs/examples/ are loaded through params.yaml's `plugins`, the family passes the contract
check, and both are trained through one RL iteration; a plugin's reward settings are validated without a
field in agentkiln's config; the processes a stage starts load the plugins too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from agentkiln.config import ParamsError, load_params
from agentkiln.families import FAMILIES, PluginError, register_family

from tests.conftest import ROOT

EXAMPLES = ["docs/examples/guess_number.py", "docs/examples/first_try_bonus.py"]


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """What a test's plugins register stays in that test (the other tests of this worker see the built-ins)."""
    from agentkiln import families
    from agentkiln.config import PLUGIN_REWARDS
    from agentkiln.rewards import COMPONENTS

    saved = (dict(families.FAMILIES), dict(families.GENERATORS), set(families._loaded), dict(COMPONENTS),
             dict(PLUGIN_REWARDS), os.environ.get(families.PLUGINS_ENV))
    yield
    for live, old in zip((families.FAMILIES, families.GENERATORS, COMPONENTS, PLUGIN_REWARDS),
                         (saved[0], saved[1], saved[3], saved[4])):
        live.clear()
        live.update(old)
    families._loaded.clear()
    families._loaded.update(saved[2])
    if saved[5] is None:
        os.environ.pop(families.PLUGINS_ENV, None)
    else:
        os.environ[families.PLUGINS_ENV] = saved[5]


def params_file(tmp_path, mutate=lambda raw: None):
    """The repository's params.yaml with the examples as plugins, a guess-number task type in every split,
    the quick_win reward on, written beside copies of the examples (plugin paths are relative to it)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for example in EXAMPLES:
        (tmp_path / example).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / example).write_text((ROOT / example).read_text())
    raw["plugins"] = EXAMPLES
    raw["synthesize"]["task_types"]["guess_easy"] = {"family": "guess-number", "level": "easy", "knobs": {"high": 32}}
    raw["synthesize"]["workers"] = 1
    raw["synthesize"]["splits"] = {s: {"n_tasks": 4, "seed": 40 + i, "mix": {"guess_easy": 1.0}}
                                   for i, s in enumerate(("sft", "rl", "test", "val"))}
    raw["rl"]["defaults"]["reward"]["quick_win"] = {"weight": 0.5, "within": 3}
    raw["promote"]["guards"] = {"invalid_rate": 0.05}
    raw["evaluate"]["panels"] = ["test"]
    raw["findings"]["panels"] = ["test"]
    raw["ablation"]["panel"] = "test"
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_family_and_a_reward_from_your_own_files_train_through_an_rl_iteration(tmp_path):
    from agentkiln.config import SynthesizeParams
    from agentkiln.rewards import COMPONENTS
    from agentkiln.stages.common import load_split
    from agentkiln.synthesis.contract import check_family
    from agentkiln.synthesis.stage import synthesize
    from agentkiln.trainers.rl import train_rl

    from tests.conftest import scratch_policy

    params = load_params(params_file(tmp_path))
    assert "guess-number" in FAMILIES and "quick_win" in COMPONENTS  # registered by importing the plugins
    report = check_family("guess-number", n=4)
    assert report == {"easy": 4, "medium": 4, "hard": 4, "fuzz": 500}
    tasks_dir = tmp_path / "tasks"
    synthesize(SynthesizeParams.model_validate(params.synthesize.model_dump()), tasks_dir, progress=False)
    pool = load_split(tasks_dir, "rl")
    assert {t.family for t in pool} == {"guess-number"}
    policy = scratch_policy(pool, tasks_dir)
    p = params.rl.defaults.model_copy(update={"iterations": 1, "episode_budget": None, "tasks_per_iter": 2,
                                              "group_size": 4, "rollout_batch": 8, "minibatch_size": 8,
                                              "micro_batch_size": 4})
    assert p.reward.components()["quick_win"].within == 3
    history = train_rl(policy, None, pool, tasks_dir, p, seed=0)
    assert len(history) == 1 and history[0]["episodes"] == 8
    assert "reward/quick_win" in history[0] and 0.0 <= history[0]["reward/quick_win"] <= 0.5


def test_a_plugins_reward_settings_are_validated_by_its_own_model(tmp_path):
    def bad(component):
        return lambda raw: raw["rl"]["defaults"]["reward"].update(quick_win=component)

    with pytest.raises(ParamsError, match=r"reward.quick_win.within: Input should be greater than or equal to 1"):
        load_params(params_file(tmp_path, bad({"weight": 0.5, "within": 0})))
    with pytest.raises(ParamsError, match=r"reward.quick_win.bonus: Extra inputs are not permitted"):
        load_params(params_file(tmp_path, bad({"weight": 0.5, "bonus": 2})))

    def unknown(raw):
        raw["rl"]["defaults"]["reward"]["quik_win"] = {"weight": 1.0}

    with pytest.raises(ParamsError, match=r"reward.quik_win: not a reward component \(components: outcome, .*quick_win"):
        load_params(params_file(tmp_path, unknown))
    # a stage overrides a plugin's component knob by knob, as a built-in one
    p = load_params(params_file(tmp_path, lambda raw: raw["rl"]["stages"]["main"].update(
        reward={"quick_win": {"within": 5}})))
    assert (p.rl.stage("main").reward.components()["quick_win"].within, p.rl.stage("main").reward.components()[
        "quick_win"].weight) == (5, 0.5)


def test_a_missing_plugin_and_a_bad_registration_are_refused_by_name(tmp_path):
    with pytest.raises(ParamsError, match=r"plugins: docs/nowhere.py: no such file"):
        load_params(params_file(tmp_path, lambda raw: raw.update(plugins=["docs/nowhere.py"])))
    with pytest.raises(ParamsError, match=r"plugins: no_such_module_here failed to import"):
        load_params(params_file(tmp_path, lambda raw: raw.update(plugins=["no_such_module_here"])))
    with pytest.raises(PluginError, match="is registered already"):
        register_family("sokoban", env="elsewhere:Env", generator="elsewhere")
    with pytest.raises(PluginError, match="lower-case letters"):
        register_family("Bad Name", env="x:Y", generator="x")


def test_processes_a_stage_starts_load_its_plugins(tmp_path):
    load_params(params_file(tmp_path))
    code = ("from agentkiln.envs import env_class; from agentkiln.rewards import COMPONENTS; "
            "print(env_class('guess-number').__name__, 'quick_win' in COMPONENTS)")
    # the family is found by name: the child loads what AGENTKILN_PLUGINS records (the rewards on that lookup too)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["GuessNumberEnv", "True"], out.stderr[-2000:]
