"""`agentkiln endpoint`: a policy behind an OpenAI-compatible API, driven by the real `openai` client
over real HTTP (uvicorn), against the evaluation path of the same model."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentkiln.servers import free_port
from tests.endpoint_support import Served, harness_episode

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def world(endpoint_world):
    return endpoint_world


def test_harness_through_the_endpoint_plays_as_eval_does(world, tmp_path):
    """Whole episodes of two families (admissible actions; a tool family) through the openai client,
    four clients at once: the same actions, outcomes and success as the evaluation path of the same
    model with the same (greedy) decoding; every recorded episode holds exactly the ids served, which
    are the ids evaluation generated."""
    from agentkiln.evaluate.agents import policy_agent
    from agentkiln.evaluate.harness import records, summarize
    from agentkiln.policy import load_policy
    from agentkiln.rollout.engine import run_episodes
    from tests.conftest import params_with

    tasks, out, model = world
    policy = load_policy(model)
    evaluated = run_episodes(policy_agent(policy, params_with({}).evaluate, greedy=True), tasks, out, None)
    with Served(str(model), record=tmp_path / "rec") as srv:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["policy"]
        with ThreadPoolExecutor(4) as pool:
            played = list(pool.map(lambda t: harness_episode(client, t, out), tasks))
        assert srv.worker.batches < sum(len(p["actions"]) for p in played)  # concurrent requests were batched
    for ep, run in zip(evaluated, played):
        assert run["actions"] == [t.action for t in ep.turns], ep.task_id
        assert run["won"] == ep.won
    eval_success = summarize(records(evaluated, tasks, 1))["success"]
    assert sum(p["won"] for p in played) / len(played) == eval_success
    assert 0 < eval_success < 1  # the comparison is not between two all-losing (or all-winning) players
    assert any(a.startswith("sql[") for p in played for a in p["actions"])  # the tool family decoded freely
    for ep, run in zip(evaluated, played):
        rec = json.loads((tmp_path / "rec" / f"{run['episode']}.json").read_text())
        assert rec["ids"] == ep.ids and not rec["retokenized"] and rec["task_id"] == ep.task_id
        for turn, served in zip(rec["turns"], run["served"]):  # the ids of every turn as served
            start, _ = rec["windows"][turn["window"]]
            window = rec["ids"][: turn["end"]] if start == 0 else rec["ids"][: rec["prompt_len"]] + rec["ids"][start: turn["end"]]
            assert served == window


def test_tool_calls_streaming_logprobs_and_rewards(world, tmp_path):
    """A constrained tool-family reply comes back as an OpenAI tool call (streamed too); log-probs are the
    reply tokens'; a resent history continues the recorded episode; the client's reward closes it."""
    import httpx

    from agentkiln.envs import make

    tasks, out, model = world
    env = make(tasks[6], out)
    obs = env.reset()
    tools = env.tool_specs()
    messages = [{"role": "user", "content": env.goal + "\n" + obs.text}]
    with Served(str(model), record=tmp_path / "rec") as srv:
        client = srv.client()
        forced = ["sql[SELECT 1]", "answer[42]"]
        r = client.chat.completions.create(model="policy", messages=messages, tools=tools, temperature=0,
                                           logprobs=True, extra_body={"admissible": forced})
        msg, ext = r.choices[0].message, r.model_extra["agentkiln"]
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        call = msg.tool_calls[0].function
        assert f"{call.name}[{next(iter(json.loads(call.arguments).values()))}]" in forced
        assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(
            json.loads((tmp_path / "rec" / f"{ext['episode_id']}.json").read_text())["turns"][0]["logprobs"], abs=1e-5)
        assert sum(t.logprob for t in r.choices[0].logprobs.content) > -50
        # the history resent with the served reply continues the same episode (same id, ids kept)
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                         "content": "1"}]
        r2 = client.chat.completions.create(model="policy", messages=messages, tools=tools, temperature=0,
                                            extra_body={"admissible": forced})
        ext2 = r2.model_extra["agentkiln"]
        assert ext2["episode_id"] == ext["episode_id"] and ext2["turn"] == 2 and not ext2["retokenized"]
        assert r2.model_extra["prompt_token_ids"][: len(r.model_extra["prompt_token_ids"])] == r.model_extra["prompt_token_ids"]
        # a reply the endpoint never served: re-tokenised from its text, flagged, a new episode
        edited = messages[:1] + [{"role": "assistant", "content": "sql[SELECT 2]"}] + [{"role": "user", "content": "2"}]
        r3 = client.chat.completions.create(model="policy", messages=edited, temperature=0)
        assert r3.model_extra["agentkiln"]["retokenized"] and r3.model_extra["agentkiln"]["episode_id"] != ext["episode_id"]
        messages += [r2.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "2"}]
        raw = httpx.post(f"{srv.url}/chat/completions", json={"messages": messages, "temperature": 0, "tools": tools})
        assert raw.headers["x-agentkiln-model-version"].startswith("local-")
        assert raw.headers["x-agentkiln-episode"] == ext["episode_id"]
        ok = httpx.post(f"{srv.url}/episodes/{ext['episode_id']}/reward", json={"reward": 1.0})
        assert ok.status_code == 200 and ok.json()["won"] is True
        rec = json.loads((tmp_path / "rec" / f"{ext['episode_id']}.json").read_text())
        assert rec["outcome"]["reward"] == 1.0 and len(rec["turns"]) == 3
        assert httpx.post(f"{srv.url}/episodes/ep-nope/reward", json={"reward": 1}).status_code == 404
        # streamed: the same reply, as chunks the client puts back together
        stream = client.chat.completions.create(model="policy", messages=messages[:1], tools=tools, temperature=0,
                                                stream=True, extra_body={"admissible": forced})
        chunks = list(stream)
        calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert calls[0][0].function.name == call.name and chunks[-1].choices[0].finish_reason == "tool_calls"
        # bad requests are refused by name
        for body, word in [({"messages": "hi"}, "messages"), ({"messages": messages, "n": 2}, "`n`"),
                           ({"messages": messages, "top_p": 0.5}, "top_p"),
                           ({"messages": messages, "decoding": "constrained"}, "admissible"),
                           ({"messages": [{"role": "assistant", "content": "x"}]}, "user message")]:
            bad = httpx.post(f"{srv.url}/chat/completions", json=body)
            assert bad.status_code == 400 and word in bad.json()["error"]["message"], body


@pytest.fixture(scope="module")
def registered(world, tmp_path_factory):
    """A registry (SQLite store) holding two versions: the world policy (1) and another one (2)."""
    from agentkiln import tracking
    from agentkiln.policy import save_policy
    from agentkiln.registry import model_registry as mr
    from tests.conftest import scratch_policy
    from tests.test_tracking_registry import _isolated_mlflow_env

    tasks, out, model = world
    tmp = tmp_path_factory.mktemp("registry")
    other = save_policy(scratch_policy(tasks, out, seed=7), tmp / "other")
    name = "agentkiln-endpoint-test"
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with _isolated_mlflow_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(tmp)
        tracking._setup_state = None
        tracking.setup()
        with tracking.stage_run("promote"):
            versions = (mr.register_candidate(model, name, {"candidate": "sft"}, {"success": 0.5}),
                        mr.register_candidate(other, name, {"candidate": "rl"}, {"success": 0.6}))
        yield name, versions, uri, tmp


def test_the_endpoint_follows_the_champion_alias_without_a_restart(registered):
    """Pointed at models:/<name>@champion: promoting another version changes the version that answers
    (response header), with the same server process and port; so does a rollback."""
    import httpx

    from agentkiln.registry import model_registry as mr

    name, (v1, v2), _, _ = registered
    mr.promote(name, v1)
    body = {"messages": [{"role": "user", "content": "go"}], "temperature": 0, "admissible": ["left", "right"]}
    with Served(f"models:/{name}@champion", poll=0.2) as srv:
        first = httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60)
        assert first.headers["x-agentkiln-model-version"] == v1 == "1"
        assert srv.client().models.list().data[0].id == name
        mr.promote(name, v2)
        deadline, seen = time.time() + 60, v1
        while seen != v2:
            assert time.time() < deadline, "the endpoint still serves the old champion"
            time.sleep(0.2)
            r = httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60)
            seen = r.headers["x-agentkiln-model-version"]
        assert r.json()["agentkiln"]["model_version"] == v2
        mr.rollback(name)
        deadline = time.time() + 60
        while httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60).headers[
                "x-agentkiln-model-version"] != v1:
            assert time.time() < deadline, "the endpoint did not follow the rollback"
            time.sleep(0.2)


def test_mlflow_models_serve_answers_a_chat_request_as_the_agent(registered, world):
    """The registered model's pyfunc is the agent: `mlflow models serve` of the champion answers an
    OpenAI chat request in the policy's format, constrained to the admissible actions, with the reply
    the endpoint gives to the same request."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    import mlflow

    from agentkiln.registry import model_registry as mr

    name, (v1, _), uri, tmp = registered
    _, _, model = world
    mr.promote(name, v1)
    actions = ["left", "down", "right", "up"]
    body = {"messages": [{"role": "user", "content": "Reach the goal without falling into a hole.\nS F F\nF H F\nF F G"}],
            "temperature": 0, "admissible": actions}
    loaded = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    assert loaded.metadata.flavors["python_function"]["loader_module"] == "agentkiln.serving.pyfunc"
    direct = loaded.predict(body)
    loaded._model_impl.close()  # its decoding thread (torch ops off the main thread) would outlive the test
    assert direct["choices"][0]["message"]["content"] in actions
    with Served(str(model)) as srv:  # the endpoint gives the same reply, from the same ids
        same = httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60).json()
    assert same["choices"][0]["message"] == direct["choices"][0]["message"]
    assert same["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    port = free_port()
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", f"models:/{name}@champion",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "mlflow models serve did not start"
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=60)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert r.status_code == 200, r.text
        served = r.json()
        served = served.get("predictions", served)
        assert served["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_recorded_episodes_collect_into_a_split_that_sft_and_rl_train_on(world, tmp_path):
    """A harness plays through the recording endpoint and posts rewards; `collect` seals the episodes
    (never over an existing split); SFT trains on the won ones with the ids as served (and on the text of
    the ones a different tokenizer served), one RL iteration trains on the rewarded ones beside its
    rollouts, and the registered model's lineage names the split."""
    import httpx

    from agentkiln.config import RLParams
    from agentkiln.policy import load_policy
    from agentkiln.collected import collect, load_split, split_digest, training_episodes
    from agentkiln.stages.promote import collected_lineage
    from agentkiln.trainers import rl as trainer
    from agentkiln.trainers.supervised import OptimConfig, train_supervised
    from tests.conftest import params_with

    tasks, out, model = world
    lake = tasks[:6]
    with Served(str(model), record=tmp_path / "rec") as srv:
        client = srv.client()
        for run in [harness_episode(client, t, out, max_turns=6) for t in lake]:
            if run["episode"]:
                httpx.post(f"{srv.url}/episodes/{run['episode']}/reward", json={"reward": float(run["won"])})
    split = collect(tmp_path / "rec", tmp_path / "collected", "harness-v1", dvc=False, log=lambda *_: None)
    with pytest.raises(FileExistsError, match="never overwritten"):
        collect(tmp_path / "rec", tmp_path / "collected", "harness-v1", dvc=False, log=lambda *_: None)
    manifest = json.loads((split / "manifest.json").read_text())
    records = load_split(split, "test")
    assert manifest["meta"]["episodes"] == len(records) == 6 and 0 < manifest["meta"]["won"] < 6
    policy = load_policy(model)
    served, text = training_episodes(records, policy, won_only=True)
    assert len(served) == manifest["meta"]["won"] and not text
    assert [e.ids for e in served] == [r["ids"] for r in records if r["outcome"]["won"]]  # the ids as served
    history = train_supervised(policy, served, OptimConfig(3, 2, 1e-3, 0.0, 0, 1.0), seed=0)
    assert history[-1]["loss"] < history[0]["loss"]
    # the RL stage: one iteration, the split's rewarded episodes in the batch with their behaviour log-probs
    p = RLParams(algorithm="grpo", iterations=1, tasks_per_iter=2, group_size=2, max_turns=4, minibatch_size=8,
                 offline={"split": str(split), "per_iteration": 6})
    hist = trainer.train_rl(load_policy(model), None, lake, out, p, seed=0)
    assert hist[0]["offline/episodes"] == 6 and hist[0]["offline/success"] == manifest["meta"]["won"] / 6
    # the SFT stage with another tokenizer (a scratch one of its own): the won episodes rendered from text
    params = params_with({"sft": {"data": {"collected": str(split)}},
                          "rl": {"stages": {"main": {"init": "sft", "offline": {"split": str(split)}}}}})
    assert collected_lineage(params) == {"lineage.collected.sft": f"{split}@{split_digest(split)}",
                                         "lineage.collected.rl.main": f"{split}@{split_digest(split)}"}
    from agentkiln.stages.sft import run_sft
    from tests.conftest import tiny_dataset

    lake_mix = {"frozenlake_easy": 1.0}
    tasks_dir = tiny_dataset(tmp_path / "tasks", {"sft": lake_mix, "rl": lake_mix, "test": lake_mix},
                             {"sft": 4, "rl": 2, "test": 2})
    metrics = run_sft(params.model_copy(update={"sft": params.sft.model_copy(update={"epochs": 1})}), tasks_dir,
                      tmp_path / "sft")
    assert metrics["n_episodes_collected_won"] == manifest["meta"]["won"] and metrics["n_episodes_collected_as_served"] == 0
    assert metrics["n_episodes"] == metrics["n_episodes_clean"] + metrics.get("n_episodes_recovery", 0) + metrics[
        "n_episodes_collected_won"]
    (split / "episodes.jsonl").write_text((split / "episodes.jsonl").read_text().replace('"won": true', '"won": false'))
    with pytest.raises(Exception, match="episodes.jsonl"):  # a tampered split is refused by name
        load_split(split, "sft.data.collected")


def test_the_endpoint_command_serves_until_sigterm_and_refuses_bad_input(world, tmp_path):
    """`agentkiln endpoint` as a user runs it: says where it serves, answers, stops on SIGTERM saying where
    the recorded episodes are (port freed, nothing left running); a missing model or a taken port is
    refused at once, by name."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    _, _, model = world
    script = str(Path(sys.executable).parent / "agentkiln")
    bad = subprocess.run([script, "endpoint", "--model", str(tmp_path / "nope")], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "no such file or directory" in bad.stderr, bad.stderr
    port = free_port()
    proc = subprocess.Popen([script, "endpoint", "--model", str(model), "--port", str(port), "--record",
                             str(tmp_path / "rec"), "--threads", "1"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert f"at http://127.0.0.1:{port}/v1" in first and "recording episodes" in first, first
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                               json={"messages": [{"role": "user", "content": "go"}], "admissible": ["left", "up"]})
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, "the endpoint did not answer"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("left", "up")
        taken = subprocess.run([script, "endpoint", "--model", str(model), "--port", str(port)], capture_output=True,
                               text=True, timeout=60, cwd=tmp_path)
        assert taken.returncode == 2 and f"port {port}" in taken.stderr and "taken" in taken.stderr
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "endpoint stopped" in rest and str(tmp_path / "rec") in rest, rest
        assert list((tmp_path / "rec").glob("ep-*.json"))
        from agentkiln.servers import port_taken

        assert not port_taken(port)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
