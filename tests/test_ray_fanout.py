"""Ray fan-out (`compute.ray`) gives exactly the single-process results: episodes stepped on
environment actors (TextWorld, a sandboxed tool family, FrozenLake; policy, oracle and random agents),
the synthesis workers' bytes, the ablation's arm x seed metrics. One real local Ray (2 CPUs) for the
module, started as a stage starts it; `fanout.session(RayParams())` (disabled) gives the
single-process path while it runs."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import yaml

from agentkiln import fanout
from agentkiln.config import RayParams, SynthesizeParams, load_params
from tests.conftest import ROOT

RAY = RayParams(enabled=True, num_cpus=2, env_workers=2)


def single_process():
    return fanout.session(RayParams())  # fan-out off for the block; the module's Ray keeps running


@pytest.fixture(scope="module")
def ray_session():
    handler = signal.getsignal(signal.SIGTERM)
    with fanout.session(RAY):
        assert signal.getsignal(signal.SIGTERM) is handler  # ray.init's own handler is undone: a run's stays
        yield


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory, ray_session):
    """A tiny data set synthesized by the spawned pool and by Ray tasks: (pool dir, Ray dir)."""
    from agentkiln.synthesis import synthesize

    params = SynthesizeParams.model_validate({
        "workers": 2, "max_expert_steps": 40,
        "task_types": {"coin": {"family": "textworld", "level": "easy"},
                       "py": {"family": "python-tool", "level": "easy", "knobs": {"kind": "arithmetic", "numbers": 3}},
                       "lake": {"family": "gym-toytext", "knobs": {"game": "frozenlake"}}},
        "splits": {"sft": {"n_tasks": 3, "seed": 1, "mix": {"coin": 1, "py": 1}},
                   "rl": {"n_tasks": 2, "seed": 2, "mix": {"lake": 1}},
                   "test": {"n_tasks": 2, "seed": 3, "mix": {"coin": 1, "py": 1}}},
    })
    pool, ray = tmp_path_factory.mktemp("pool"), tmp_path_factory.mktemp("ray")
    with single_process():
        synthesize(params, pool, progress=False)
    synthesize(params, ray, progress=False)
    return pool, ray


def files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_synthesis_on_ray_writes_the_same_bytes(synthesized):
    pool, ray = files(synthesized[0]), files(synthesized[1])
    assert any(f.startswith("games/") for f in pool)  # TextWorld's compiled games are compared too
    assert pool == ray


def test_episodes_stepped_on_actors_equal_the_single_process_ones(synthesized):
    from agentkiln.evaluate.baselines import OracleAgent
    from agentkiln.rollout.agents import PolicyAgent, RandomAgent
    from agentkiln.rollout.engine import run_episodes
    from agentkiln.stages.common import load_split
    from tests.conftest import scratch_policy

    tasks_dir = synthesized[1]
    tasks = load_split(tasks_dir, "sft") + load_split(tasks_dir, "test") + load_split(tasks_dir, "rl")
    assert {"textworld", "python-tool", "gym-toytext"} <= {t.family for t in tasks}
    policy = scratch_policy(tasks, tasks_dir)
    agents = {  # batch of 4: several chunks (each chunk's environments spread over the 2 actors)
        "policy": (lambda: PolicyAgent(policy, seed=7, batch_size=4, max_reply_tokens=6), 2),
        "oracle": (OracleAgent, 1),  # its expert_action() is a remote call to the hosting actor
        "random": (lambda: RandomAgent(seed=3), 2),
    }

    def play():
        return {name: [dataclasses.asdict(e) for e in run_episodes(make(), tasks, tasks_dir, 4, group_size=g)]
                for name, (make, g) in agents.items()}

    with single_process():
        here = play()
    there = play()
    import ray

    hosts = ray.get([h.__ray_call__.remote(lambda host: (os.getpid(), len(host.envs))) for h in fanout._session["hosts"]])
    assert len({pid for pid, _ in hosts} - {os.getpid()}) == RAY.env_workers  # the actors stepped them
    assert all(n == 0 for _, n in hosts)  # and closed every one
    for name in agents:  # every field: ids, log-probs, observations, actions, rewards, won, cut
        assert there[name] == here[name], name
    oracle = here["oracle"]
    assert any(e["won"] for e in oracle)
    assert any("Output:" in t["observation"] for e in oracle for t in e["turns"])  # the sandbox really ran
    assert len(here["policy"]) == 2 * len(tasks) and all(e["ids"] for e in here["policy"])


def test_ablation_jobs_on_ray_equal_the_process_pool(tmp_path, ray_session):
    from agentkiln.stages.ablation import run_ablation
    from tests.conftest import ablation_repo

    tasks_dir = ablation_repo(tmp_path)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["ablation"] |= {"seeds": [0], "workers": 2, "baseline": "grpo",
                        "base": {"iterations": 100, "episode_budget": 8, "tasks_per_iter": 2, "group_size": 2,
                                 "max_turns": 4},
                        "arms": {"grpo": [{"algorithm": "grpo"}], "gigpo": [{"algorithm": "gigpo"}]}}
    raw["evaluate"]["max_turns"] = 4
    raw["compute"]["ray"] = RAY.model_dump()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(tmp_path / "params.yaml")
    pool_params = params.model_copy(update={"compute": params.compute.model_copy(update={"ray": RayParams()})})

    cwd = os.getcwd()
    os.chdir(tmp_path)  # models/sft is found relative to the repository root, as in the flow
    try:
        pool = run_ablation(pool_params, tasks_dir, tmp_path / "pool")  # Ray disabled: 2 spawned workers
        ray = run_ablation(params, tasks_dir, tmp_path / "ray")  # the stage's own session: the module's Ray
    finally:
        os.chdir(cwd)
    for r in (pool, ray):
        r.pop("seconds")
    assert ray == pool  # summary (success, CIs, paired differences), per-task outcomes, learning curves
    assert set(ray["curves"]) == {"grpo", "gigpo"} and ray["curves"]["grpo"][0][-1]["episodes"] == 8


def test_disabled_imports_no_ray_and_an_unreachable_address_names_the_setting():
    code = (
        "import sys\n"
        "import agentkiln.stages.rl, agentkiln.stages.evaluate, agentkiln.stages.distill, agentkiln.stages.ablation\n"
        "import agentkiln.synthesis.stage\n"
        "from agentkiln import fanout\nfrom agentkiln.config import RayParams\n"
        "with fanout.session(RayParams()):\n    assert not fanout.active()\n"
        "assert 'ray' not in sys.modules, 'ray imported with compute.ray disabled'\n"
        "try:\n    fanout.session(RayParams(enabled=True, address='127.0.0.1:1')).__enter__()\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "compute.ray.address = '127.0.0.1:1': cannot reach" in out.stdout
