"""`agentkiln endpoint` and `agentkiln collect` under careless or hostile clients, judged from outside:
the server's answers (status, the error's `param`), its memory (resident set of its process), and the
latency of good requests sent meanwhile. The endpoint runs as the real command in its own process,
over real HTTP; collect is the real command over real files."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.endpoint_support import SCRIPT, Command, Served

MiB = 2**20
GOOD = {"messages": [{"role": "user", "content": "Reach the goal.\nS F F\nF H F\nF F G"}], "temperature": 0,
        "admissible": ["left", "down", "right", "up"]}
# what the module's endpoint takes beyond the defaults: admissible lists big enough to reach its
# preparation bound, which is short (the good requests here prepare in milliseconds)
ROOMY = ("--max-admissible", "10000", "--max-action-chars", "4000", "--max-admissible-chars", "8000000")
RSS_GROWTH = 400 * MiB  # the bound this suite holds the endpoint's peak resident memory to, over its start


@pytest.fixture(scope="module")
def endpoint(endpoint_world, tmp_path_factory):
    _, _, model = endpoint_world
    tmp = tmp_path_factory.mktemp("hostile")
    with Command(model, tmp, "--record", str(tmp / "rec"), "--max-prepare-seconds", "0.5", *ROOMY) as cmd:
        httpx.post(f"{cmd.base}/v1/chat/completions", json=GOOD, timeout=60)  # warm: lazy initialisation
        cmd.started_rss = cmd.rss()[0]
        yield cmd


def heavy(n: int, chars: int = 900) -> dict:
    """A request whose admissible actions take long to prepare (each one's token ids, all distinct)."""
    return GOOD | {"admissible": [f"{i:05d} " + "go north then " * (chars // 14) for i in range(n)]}


class Good:
    """Good requests sent one after another in the background, each timed and checked."""

    def __init__(self, base: str):
        self.base, self.latencies, self.wrong = base, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                r = client.post(f"{self.base}/v1/chat/completions", json=GOOD)
                self.latencies.append(time.monotonic() - start)
                if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] not in GOOD["admissible"]:
                    self.wrong.append((r.status_code, r.text[:300]))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(60)


def raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def user(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}]} | extra


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


HOSTILE = [  # (what, body, status, the error's param)
    ("a body that is not UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("JSON nested 100,000 deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("JSON nested 100 deep in a field", b'{"messages": [], "metadata": ' + nested(100) + b"}", 400, "metadata"),
    ("not JSON", b'{"messages": [', 400, None),
    ("an empty body", b"", 400, None),
    ("a JSON array", b"[1, 2]", 400, None),
    ("a content part whose text is not a string", user([{"type": "text", "text": 5}]), 400,
     "messages[0].content[0].text"),
    ("an image content part", user([{"type": "image_url", "image_url": {"url": "http://x"}}]), 400,
     "messages[0].content[0].type"),
    ("a tool spec whose name is not a string", user("go", tools=[{"type": "function", "function": {"name": 5}}]), 400,
     "tools[0].function.name"),
    ("malformed tool_calls", {"messages": [{"role": "user", "content": "go"},
                                           {"role": "assistant", "tool_calls": [{"function": "sql"}]},
                                           {"role": "user", "content": "ok"}]}, 400,
     "messages[1].tool_calls[0].function"),
    ("an out-of-range seed", user("go", seed=2**64), 400, "seed"),
    ("a seed that is a string", user("go", seed="7"), 400, "seed"),
    ("a huge max_tokens on a free-form turn", user("go", max_tokens=10**12), 400, "max_tokens"),
    ("a lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "messages[0].content"),
    ("a NaN temperature", b'{"messages": [{"role": "user", "content": "go"}], "temperature": NaN}', 400, "temperature"),
    ("an unknown role", {"messages": [{"role": "wizard", "content": "go"}]}, 400, "messages[0].role"),
    ("metadata that is not strings", user("go", metadata={"task_id": 5}), 400, "metadata.task_id"),
    ("n: 2", user("go", n=2), 400, "n"),
    ("a 1 MB message", user("x" * MiB), 400, "messages[0].content"),
    ("a 10 MB message", user("x" * (10 * MiB)), 413, None),
    ("a 100,000-character admissible action", GOOD | {"admissible": ["y" * 100_000]}, 400, "admissible[0]"),
    ("an action longer than the context leaves", GOOD | {"admissible": ["left", "y" * 3000]}, 400, "admissible"),
]


def test_every_bad_input_is_refused_by_name_and_the_connection_stays_open(endpoint):
    """Each class of bad input gets a 4xx whose OpenAI-style error names the parameter (no traceback, no
    500); the same keep-alive connection then answers a good request; good requests sent meanwhile from
    another client are answered correctly within a few seconds; the server's peak resident memory
    stays within RSS_GROWTH of its start."""
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=60)
    with Good(endpoint.base) as good:
        for what, body, status, param in HOSTILE:
            conn.request("POST", "/v1/chat/completions", raw(body), {"content-type": "application/json"})
            r = conn.getresponse()
            answer = r.read()
            assert r.status == status, (what, r.status, answer[:300])
            error = json.loads(answer)["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (what, error)
            assert error["message"] and error["code"] and b"Traceback" not in answer, (what, error)
            sock = conn.sock
            conn.request("POST", "/v1/chat/completions", raw(GOOD), {"content-type": "application/json"})
            after = conn.getresponse()
            assert after.status == 200 and json.loads(after.read())["choices"][0]["message"]["content"] in GOOD[
                "admissible"], what
            assert conn.sock is sock, f"{what}: the connection was not kept"
        # a body that says it is 1 GB: refused before it is read, its connection closed (said in the answer)
        big = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=60)
        big.putrequest("POST", "/v1/chat/completions")
        big.putheader("content-length", str(1 << 30))
        big.endheaders(b'{"messages": [')
        r = big.getresponse()
        assert r.status == 413 and r.getheader("connection") == "close" and json.loads(r.read())["error"]["code"]
        for method, path, status in (("GET", "/v1/nope", 404), ("DELETE", "/v1/chat/completions", 405)):
            conn.request(method, path)
            r = conn.getresponse()
            assert r.status == status and json.loads(r.read())["error"]["message"], (method, path)
        # eight 7 MB bodies at once: read, parsed and refused (each message over its bound), memory given back
        flood = raw(user("x" * (7 * MiB)))
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{endpoint.base}/v1/chat/completions", content=flood,
                                                       timeout=60).status_code, range(8)))
        assert set(codes) <= {400, 503}, codes  # 503: over --max-inflight-bytes, retry later
    assert not good.wrong, good.wrong[:3]
    assert len(good.latencies) >= 5 and max(good.latencies) < 5.0, good.latencies
    _, peak = endpoint.rss()
    grown = peak - endpoint.started_rss
    assert grown < RSS_GROWTH, f"peak RSS {peak / MiB:.0f} MiB, {grown / MiB:.0f} MiB over its start"
    health = httpx.get(f"{endpoint.base}/health").json()
    assert health["failed"] == 0 and "Traceback" not in endpoint.output()


def test_one_bad_request_among_eight_good_ones_fails_alone(endpoint):
    """One bad request sent together with eight good ones (three trials, three kinds of bad: refused when
    parsed, when its trie is built, when its reply budget meets the context): the bad one gets its 4xx,
    the eight good ones their replies."""
    bads = [(user([{"type": "text", "text": ["x"]}]), "messages[0].content[0].text"),
            (GOOD | {"admissible": ["y" * 3000]}, "admissible"),
            (GOOD | {"decoding": "free", "max_tokens": 5000}, "max_tokens")]
    for bad, param in bads:
        bodies = [bad] + [GOOD | {"metadata": {"task_id": f"t{i}"}} for i in range(8)]
        barrier = threading.Barrier(len(bodies))

        def send(body):
            barrier.wait()
            return httpx.post(f"{endpoint.base}/v1/chat/completions", json=body, timeout=60)

        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(send, bodies))
        assert answers[0].status_code == 400 and answers[0].json()["error"]["param"] == param, answers[0].text
        for r in answers[1:]:
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in GOOD["admissible"], r.text


def test_a_request_past_the_preparation_bound_fails_alone(endpoint):
    """3,000 distinct admissible actions take seconds to prepare: past the endpoint's 0.5 s bound the
    request fails alone (422 naming `admissible`) well before that, and good requests sent meanwhile are
    answered within a few seconds."""
    with Good(endpoint.base) as good:
        time.sleep(0.3)
        start = time.monotonic()
        r = httpx.post(f"{endpoint.base}/v1/chat/completions", json=heavy(3000), timeout=60)
        took = time.monotonic() - start
        time.sleep(0.3)
    error = r.json()["error"]
    assert r.status_code == 422 and error["param"] == "admissible" and error["code"] == "preparation_timeout", r.text
    assert "--max-prepare-seconds" in error["message"] and took < 3.0, took
    assert not good.wrong and max(good.latencies) < 3.0, (good.wrong[:3], good.latencies)


def test_sigterm_during_a_long_request_ends_the_endpoint_within_10_s(endpoint_world, tmp_path):
    """With a generous preparation bound, a request of 8,000 admissible actions keeps the decoding thread
    busy for many seconds; SIGTERM while it is in progress ends `agentkiln endpoint` within 10 s, cleanly
    (status 0, its last words said), and the request is answered or its connection closed, not left hanging."""
    _, _, model = endpoint_world
    with Command(model, tmp_path, "--max-prepare-seconds", "120", *ROOMY) as cmd:
        answer: list = []

        def send():
            try:
                answer.append(httpx.post(f"{cmd.base}/v1/chat/completions", json=heavy(8000), timeout=60).status_code)
            except httpx.TransportError as e:
                answer.append(type(e).__name__)

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{cmd.base}/health").json()["requests_in_flight_bytes"] == 0:  # its body is in
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        took = cmd.stop()
        sender.join(30)
        assert took < 10.0, f"SIGTERM took {took:.1f} s\n{cmd.output()}"
        assert cmd.proc.returncode == 0 and "endpoint stopped" in cmd.output(), cmd.output()
        assert answer == [503], answer


def test_a_batch_whose_decoding_fails_answers_every_request_but_the_failing_one(endpoint_world):
    """An engine that fails on one row (a bug, not bad input: the engine is wrapped to fail on it) with
    four good requests in its batch: the four are answered, the failing one gets a JSON 500 without a
    traceback on a connection that stays open, the traceback goes to the server's log and /health."""
    from agentkiln.rollout.agents import HFGenerator

    class Failing(HFGenerator):
        def replies(self, episodes, *args, **kwargs):
            if any("POISON" in ep.turns[-1].observation for ep in episodes):
                raise RuntimeError("the engine failed on this row")
            return super().replies(episodes, *args, **kwargs)

    _, _, model = endpoint_world
    with Served(str(model), generators=Failing) as srv:
        bodies = [user("POISON", temperature=0)] + [GOOD | {"metadata": {"task_id": f"t{i}"}} for i in range(4)]
        barrier = threading.Barrier(len(bodies))

        def send(body):
            barrier.wait()
            return httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60)

        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(send, bodies))
        error = answers[0].json()["error"]
        assert answers[0].status_code == 500 and error["type"] == "server_error" and "Traceback" not in answers[0].text
        assert all(r.status_code == 200 for r in answers[1:]), [r.text for r in answers[1:]]
        conn, socks, statuses = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60), [], []
        for body in (user("POISON"), GOOD):  # one keep-alive connection answers both
            conn.request("POST", "/v1/chat/completions", raw(body), {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            statuses.append(r.status)
            socks.append(conn.sock)
        assert statuses == [500, 200] and socks[0] is socks[1] is not None
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health").json()["failed"] == 2
    assert any("the engine failed on this row" in line and "Traceback" in line for line in srv.logged)


def test_rewards_take_a_finite_number_once_unless_replaced(endpoint):
    """NaN, infinity, a string: 400 naming `reward`, nothing written; a first reward: 200; a second one:
    409 naming `replace`, the first kept; with "replace": true: 200, replaced; an unknown id: 404."""
    r = httpx.post(f"{endpoint.base}/v1/chat/completions", json=GOOD, timeout=60)
    episode = r.json()["agentkiln"]["episode_id"]
    path = Path(endpoint.proc.args[endpoint.proc.args.index("--record") + 1]) / f"{episode}.json"
    url = f"{endpoint.base}/v1/episodes/{episode}/reward"
    for body in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e999}', b'{"reward": "1"}',
                 b'{"reward": true}', b'{"won": true}', b'{"reward": 1, "won": "yes"}'):
        bad = httpx.post(url, content=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] in ("reward", "won"), (body, bad.text)
        assert json.loads(path.read_text())["outcome"] is None, body
    assert httpx.post(url, json={"reward": 1.0}).json()["won"] is True
    again = httpx.post(url, json={"reward": 0.0})
    assert again.status_code == 409 and again.json()["error"]["param"] == "replace", again.text
    assert json.loads(path.read_text())["outcome"]["reward"] == 1.0
    replaced = httpx.post(url, json={"reward": 0.0, "replace": True})
    assert replaced.status_code == 200 and replaced.json()["won"] is False, replaced.text
    assert json.loads(path.read_text())["outcome"]["reward"] == 0.0
    for other in ("ep-0000000000000000", "..", "ep-../x", "x" * 300):
        assert httpx.post(f"{endpoint.base}/v1/episodes/{other}/reward", json={"reward": 1}).status_code == 404, other


def test_kept_conversations_and_the_recording_are_bounded_in_bytes(endpoint_world, tmp_path):
    """Past --max-kept-bytes the least recently used conversations are dropped (a client continuing one is
    served from its text, flagged retokenized); past --max-record-bytes turns are served but not
    recorded; both are counted in /health and said in the log."""
    from agentkiln.serving.limits import Limits

    _, _, model = endpoint_world
    limits = Limits(kept_bytes=60_000, record_bytes=30_000)
    with Served(str(model), record=tmp_path / "rec", limits=limits) as srv:
        first = None
        for i in range(24):
            messages = [{"role": "user", "content": f"game {i}\n" + GOOD["messages"][0]["content"]}]
            r = httpx.post(f"{srv.url}/chat/completions", json=GOOD | {"messages": messages}, timeout=60).json()
            first = first or (messages, r)
            messages += [r["choices"][0]["message"], {"role": "user", "content": "S F F"}]
            assert httpx.post(f"{srv.url}/chat/completions", json=GOOD | {"messages": messages},
                              timeout=60).status_code == 200
        health = httpx.get(f"http://127.0.0.1:{srv.port}/health").json()
        kept, recording = health["kept"], health["recording"]
        assert kept["dropped"] > 0 and kept["bytes"] <= kept["max_bytes"] == 60_000, kept
        assert recording["dropped_turns"] > 0 and recording["bytes"] <= 30_000, recording
        assert sum(f.stat().st_size for f in (tmp_path / "rec").glob("ep-*.json")) == recording["bytes"]
        messages, r = first  # the oldest conversation was dropped: continued from its text
        messages = messages + [r["choices"][0]["message"], {"role": "user", "content": "S F F"}]
        again = httpx.post(f"{srv.url}/chat/completions", json=GOOD | {"messages": messages}, timeout=60).json()
        assert again["agentkiln"]["retokenized"] is True
    assert any("--max-kept-bytes" in line for line in srv.logged)
    assert any("--max-record-bytes" in line for line in srv.logged)


# ------------------------------------------------------------------------------------- collect as a gate
def forged(records: list[dict]) -> dict[str, object]:
    """Bad records made from good ones, by file name: what each breaks."""
    good = records[0]

    def edit(**changes) -> dict:
        return json.loads(json.dumps(good)) | changes

    turns_nan = json.loads(json.dumps(good))
    turns_nan["turns"][0]["logprobs"][0] = float("nan")
    span = json.loads(json.dumps(good))
    span["turns"][0]["end"] = len(span["ids"]) + 5
    no_turns = edit()
    del no_turns["turns"]
    return {"ep-negative-id.json": edit(ids=[-1] + good["ids"][1:]),
            "ep-beyond-vocab.json": edit(ids=good["ids"][:-1] + [good["vocab_size"]]),
            "ep-float-id.json": edit(ids=[1.5] + good["ids"][1:]),
            "ep-string-id.json": edit(ids=["7"] + good["ids"][1:]),
            "ep-nan-reward.json": edit(outcome={"reward": float("nan"), "won": False, "at": 1.0}),
            "ep-nan-logprob.json": turns_nan,
            "ep-span-outside.json": span,
            "ep-no-turns.json": no_turns,
            "ep-a-list.json": [good],
            "ep-not-utf8.json": b'{"kind": "\xff"}',
            "ep-nested.json": b"[" * 100_000 + b"]" * 100_000}


WHY = {"ep-negative-id.json": "outside the vocabulary", "ep-beyond-vocab.json": "outside the vocabulary",
       "ep-float-id.json": "ids[0]", "ep-string-id.json": "ids[0]", "ep-nan-reward.json": "outcome.reward",
       "ep-nan-logprob.json": "turns[0].logprobs[0]", "ep-span-outside.json": "turns[0]",
       "ep-no-turns.json": "turns: Field required", "ep-a-list.json": "a JSON list", "ep-not-utf8.json": "UTF-8",
       "ep-nested.json": "nested", "ep-link-outside.json": "symbolic link", "ep-link-inside.json": "symbolic link"}


def collect(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "collect", *args, "--no-dvc"], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_collect_refuses_each_forged_record_by_name_and_writes_nothing(endpoint_world, tmp_path):
    """Recorded episodes beside forged ones (bad ids, NaN numbers, broken spans, a missing field, a JSON
    list, bytes that are not UTF-8 or JSON, symbolic links out of and inside the directory): collect
    names each forged file with its reason, exits 2 and writes nothing; with the forgeries gone it seals;
    a reply whose ids are not its text is refused when the tokenizer is at hand (--model); load_split
    refuses a forged line in a sealed split whose manifest was made to match."""
    from agentkiln.artifacts import write_manifest
    from agentkiln.collected import EPISODES, MANIFEST, SPLIT_FORMAT, SPLIT_KIND, load_split

    _, _, model = endpoint_world
    rec = tmp_path / "rec"
    with Served(str(model), record=rec) as srv:
        for i in range(3):
            body = GOOD | {"messages": [{"role": "user", "content": f"{i} " + GOOD["messages"][0]["content"]}]}
            r = httpx.post(f"{srv.url}/chat/completions", json=body, timeout=60).json()
            httpx.post(f"{srv.url}/episodes/{r['agentkiln']['episode_id']}/reward", json={"reward": float(i % 2)})
    records = [json.loads(f.read_text()) for f in sorted(rec.glob("ep-*.json"))]
    assert len(records) == 3 and all(r["vocab_size"] > max(r["ids"]) for r in records)
    bad_dir = tmp_path / "bad"
    shutil.copytree(rec, bad_dir)
    for name, content in forged(records).items():
        (bad_dir / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(records[0]))
    os.symlink(outside, bad_dir / "ep-link-outside.json")
    os.symlink(bad_dir / next(rec.glob("ep-*.json")).name, bad_dir / "ep-link-inside.json")
    res = collect(str(bad_dir), "--name", "forged", "--out", str(tmp_path / "collected"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = {line.strip()[2:].split(":", 1)[0]: line for line in res.stderr.splitlines()
             if line.strip().startswith("- ")}
    assert set(lines) == set(WHY), res.stderr
    for name, why in WHY.items():
        assert why in lines[name], (name, lines[name])
    assert "Traceback" not in res.stderr and not (tmp_path / "collected").exists()
    # the good ones alone are sealed; a reply whose ids are not its text is refused under --model
    ok = collect(str(rec), "--name", "good", "--out", str(tmp_path / "collected"), "--model", str(model), cwd=tmp_path)
    assert ok.returncode == 0 and "sealed 3 episodes" in ok.stdout, ok.stderr
    lying = tmp_path / "lying"
    shutil.copytree(rec, lying)
    first = sorted(lying.glob("ep-*.json"))[0]
    record = json.loads(first.read_text())
    record["turns"][0]["reply"] = "up" if record["turns"][0]["reply"] != "up" else "down"
    first.write_text(json.dumps(record))
    assert collect(str(lying), "--name", "lying", "--out", str(tmp_path / "collected"), cwd=tmp_path).returncode == 0
    res = collect(str(lying), "--name", "lying2", "--out", str(tmp_path / "collected"), "--model", str(model),
                  cwd=tmp_path)
    assert res.returncode == 2 and first.name in res.stderr and "not the ids of its reply" in res.stderr, res.stderr
    assert not (tmp_path / "collected" / "lying2").exists()
    # load_split: a forged line in a split whose manifest was made to match it
    split = tmp_path / "collected" / "good"
    lines = (split / EPISODES).read_text().splitlines()
    forged_line = json.loads(lines[1])
    forged_line["ids"][3] = -5
    (split / EPISODES).write_text("\n".join([lines[0], json.dumps(forged_line), *lines[2:]]) + "\n")
    meta = json.loads((split / MANIFEST).read_text())["meta"]
    (split / MANIFEST).unlink()
    write_manifest(split, MANIFEST, SPLIT_KIND, SPLIT_FORMAT, meta)
    with pytest.raises(ValueError, match="line 2 .*outside the vocabulary"):
        load_split(split, "sft.data.collected")
