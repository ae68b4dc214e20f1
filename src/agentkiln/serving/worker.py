"""The endpoint's decoding loop: one thread owns the model. Requests queue up; the thread takes what
arrived within `wait` seconds of the first (at most `max_batch`), prepares each one's episode
(serving.conversation) and admissible trie, decodes them together with the rollout's generator
(rollout.agents.HFGenerator: one KV cache for the batch, constrained rows masked to their admissible
actions) and answers each. Greedy requests share a batch, as do sampled ones at one temperature; a
request with a `seed` is decoded alone, so its reply depends on its seed only. The policy is swapped (a
followed alias moved) only between batches.

One request never fails or stalls the others: its preparation is bounded (serving.limits: sizes, and
`prepare_seconds` checked between its steps) and fails alone; a batch whose decoding fails is decoded
again one request at a time, so only the request that fails gets the error; a constrained reply is
bounded by the context window like a free one (an action too long for it is refused).
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import traceback
from concurrent.futures import Future
from collections.abc import Callable
from dataclasses import dataclass, field

from agentkiln.config import VLLMParams
from agentkiln.envs.base import tool_call
from agentkiln.policy.prompt import THINK, parse_reply
from agentkiln.rollout.agents import HFGenerator, decoding_mode
from agentkiln.rollout.decoding import ActionTrie, TrieCache
from agentkiln.rollout.episode import Episode
from agentkiln.rollout.sequence import add_reply
from agentkiln.rollout.vllm_backend import VLLMGenerator, VLLMRollout
from agentkiln.collected import tokenizer_digest
from agentkiln.serving.conversation import Conversations, RequestError
from agentkiln.serving.limits import OPTION, Deadline, Limits
from agentkiln.serving.recorder import Recorder
from agentkiln.serving.source import ModelSource

STOPPING = "the endpoint is stopping; send the request to another instance or again once it is back"


@dataclass
class Job:
    messages: list[dict]
    budget: int
    temperature: float = 1.0
    seed: int | None = None
    admissible: list[str] | None = None
    decoding: str = "auto"
    tools: list[dict] | None = None
    metadata: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future)

    @property
    def key(self):
        """Requests that can share a batch (one generator: one temperature, one random stream)."""
        if self.seed is not None:
            return ("seed", id(self))
        return ("greedy",) if self.temperature == 0 else ("sample", self.temperature)


@dataclass
class Prepared:
    job: Job
    episode_id: str
    ep: Episode
    retok: bool
    parent: str | None
    trie: ActionTrie | None


class Worker:
    def __init__(self, source: ModelSource, recorder: Recorder | None = None, max_batch: int = 16,
                 wait: float = 0.005, seed: int = 0, generators: Callable | None = None, limits: Limits | None = None,
                 log=print):
        self.source, self.recorder, self.log = source, recorder, log
        self.generators = generators or HFGenerator  # (policy, temperature, greedy, seed) -> rollout.agents.Generator
        self.max_batch, self.wait, self.seed = max_batch, wait, seed
        self.limits = limits or Limits()
        self.conversations = Conversations(self.limits.kept_bytes, log)
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self._tries: tuple[str, TrieCache, str] | None = None  # (version, its tries, its tokenizer digest)
        self.batches = self.failed = 0
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="decode", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        if self._stopping.is_set():
            job.future.set_exception(RequestError(STOPPING, "server_stopping", status=503))
        else:
            self.queue.put(job)
        return job.future

    def stop(self, timeout: float = 3.0) -> bool:
        """Answer what is queued with 503 and let the work in progress end (a preparation stops at its next
        step); whether the thread ended within `timeout` s (a daemon: it does not keep the process alive)."""
        self._stopping.set()
        self.queue.put(None)
        self.thread.join(timeout)
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return not self.thread.is_alive()
            if job is not None and not job.future.done():
                job.future.set_exception(RequestError(STOPPING, "server_stopping", status=503))

    def stats(self) -> dict:
        return {"batches": self.batches, "queued": self.queue.qsize(), "failed": self.failed,
                "kept": self.conversations.stats()}

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None or self._stopping.is_set():
                if first is not None:
                    self.queue.put(first)  # stop() answers it
                return
            jobs = [first]
            while len(jobs) < self.max_batch:
                try:
                    nxt = self.queue.get(timeout=self.wait)
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)
                    break
                jobs.append(nxt)
            version, policy = self.source.current()
            groups: dict = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                try:
                    if self._stopping.is_set():
                        raise RequestError(STOPPING, "server_stopping", status=503)
                    self._decode(group, version, policy)
                except Exception as e:  # noqa: BLE001  (outside any one request: its group answered, the loop on)
                    for job in group:
                        self._fail(job, e)
            self.batches += 1

    def _decode(self, jobs: list[Job], version: str, policy) -> None:
        """Prepare, decode and answer `jobs`; every job is answered, a failure only its own."""
        tries, digest = self._tries_of(version, policy)
        ready = []
        for job in jobs:
            try:
                ready.append(self._prepare(job, version, policy, tries))
            except Exception as e:  # noqa: BLE001  (this request alone)
                self._fail(job, e)
        if not ready:
            return
        try:
            replies = self._generate(ready, policy)
        except Exception as e:  # noqa: BLE001
            if len(ready) == 1:
                self._fail(ready[0].job, e)
                return
            for one in ready:  # which request failed the batch: decoded one by one, the others are answered
                self._decode_prepared([one], version, policy, digest)
            return
        for p, reply in zip(ready, replies):
            self._answer(p, reply, version, policy, digest)

    def _decode_prepared(self, ready: list[Prepared], version: str, policy, digest: str) -> None:
        try:
            replies = self._generate(ready, policy)
        except Exception as e:  # noqa: BLE001
            for p in ready:
                self._fail(p.job, e)
            return
        for p, reply in zip(ready, replies):
            self._answer(p, reply, version, policy, digest)

    def _prepare(self, job: Job, version: str, policy, tries: TrieCache) -> Prepared:
        """The request's episode with its new observation, and its trie: bounded in size and time (the
        trie first: it is checked against the deadline action by action)."""
        deadline = Deadline(self.limits.prepare_seconds)
        ctx = policy.max_context
        if job.budget >= ctx:
            raise RequestError(f"`max_tokens` {job.budget}: this policy's context window is {ctx} tokens, so a "
                               f"reply has at most {ctx - 1}", "context_length_exceeded", "max_tokens")
        tools = job.tools if policy.fmt.native_tools else None
        for k, t in enumerate(tools or []):  # a native tool call names its first parameter (policy.prompt)
            if not (t["function"].get("parameters") or {}).get("properties"):
                raise RequestError("this policy calls tools natively: each tool needs `parameters.properties` "
                                   "with at least one parameter", param=f"tools[{k}].function.parameters")
        sequences = None
        if decoding_mode({"default": job.decoding}, "", job.admissible) == "constrained":
            sequences = {}
            for action in job.admissible:
                sequences[action] = tries.reply_ids(action, tools)
                self._within(deadline, "admissible")
        episode_id, ep, retok, parent = self.conversations.start(policy, version, job.messages, job.admissible,
                                                                 job.budget, tools)
        self._within(deadline, "messages")
        ep.task_id = str(job.metadata.get("task_id") or ep.task_id)  # what the client says it plays
        ep.family = str(job.metadata.get("family") or ep.family)
        trie = None
        if sequences is not None:
            room = ctx - len(ep.window_ids(len(ep.windows) - 1))
            longest = max(map(len, sequences.values()))
            if longest > room:  # a constrained reply runs to the end of its action, whatever max_tokens says
                raise RequestError(f"`admissible`: the longest action is {longest} tokens and the context window "
                                   f"leaves {room} for the reply; send shorter actions or a shorter conversation",
                                   "context_length_exceeded", "admissible")
            trie = ActionTrie(sequences)
        return Prepared(job, episode_id, ep, retok, parent, trie)

    def _within(self, deadline: Deadline, param: str) -> None:
        if self._stopping.is_set():
            raise RequestError(STOPPING, "server_stopping", status=503)
        if deadline.passed():
            raise RequestError(f"preparing this request took longer than {deadline.seconds:g} s "
                               f"({OPTION['prepare_seconds']}): send a shorter conversation or fewer admissible "
                               "actions", "preparation_timeout", param, status=422)

    def _generate(self, ready: list[Prepared], policy) -> list:
        first = ready[0].job
        greedy = first.temperature == 0
        gen = self.generators(policy, first.temperature if not greedy else 1.0, greedy,
                              first.seed if first.seed is not None else self.seed)
        gen.begin(len(ready))
        return gen.replies([p.ep for p in ready], list(range(len(ready))), [p.trie for p in ready],
                           [p.job.budget for p in ready])

    def _answer(self, p: Prepared, reply, version: str, policy, digest: str) -> None:
        job, ep, trie = p.job, p.ep, p.trie
        try:
            ids, lps, ents, allowed = reply
            prompt = ep.window_ids(len(ep.windows) - 1)
            add_reply(ep, ids, lps, ents, allowed if trie else None)
            text = trie.action(ids) if trie else policy.chat.decode(ids)
            turn = ep.turns[-1]
            turn.reply, turn.action = text, parse_reply(text)
            ended = bool(ids) and ids[-1] in policy.chat.stop_ids
            message = assistant_message(text, turn.action, job.tools)
            self.conversations.keep(p.episode_id, ep, version, job.messages, message)
            if self.recorder is not None:
                self.recorder.write(p.episode_id, ep, {
                    "model": self.source.spec, "model_version": version, "retokenized": p.retok, "parent": p.parent,
                    "tokenizer": digest, "vocab_size": policy.vocab_size, "temperature": job.temperature or 1.0})
            job.future.set_result({
                "message": message, "episode_id": p.episode_id, "version": version, "retokenized": p.retok,
                "prompt_ids": prompt, "ids": ids, "logprobs": lps, "turn": len(ep.turns), "window": len(ep.windows) - 1,
                "action": turn.action, "reply": text,
                "finish_reason": "tool_calls" if message.get("tool_calls") else ("stop" if ended else "length"),
                "tokens": [policy.tokenizer.decode([i]) for i in ids]})
        except Exception as e:  # noqa: BLE001
            self._fail(job, e)

    def _fail(self, job: Job, e: Exception) -> None:
        """Answer `job` with its error: a RequestError as it is; anything else is a bug, logged here and
        answered as a bare 500 (no traceback to the client)."""
        if job.future.done():
            return
        if not isinstance(e, RequestError):
            self.failed += 1
            self.log("a request failed in the decoding loop (the others go on):\n"
                     + "".join(traceback.format_exception(e)).rstrip())
            e = RequestError("the server failed on this request (its log has the details); other requests are "
                             "unaffected", "internal_error", status=500)
        job.future.set_exception(e)

    # -- what the loop keeps ----------------------------------------------------------------------
    def _tries_of(self, version: str, policy) -> tuple[TrieCache, str]:
        """The served version's tries and tokenizer digest (an older version's go: they hold its policy)."""
        if self._tries is None or self._tries[0] != version:
            self._tries = (version, TrieCache(policy), tokenizer_digest(policy))
        return self._tries[1], self._tries[2]


class VLLMGenerators:
    """vLLM as the endpoint's generator (`agentkiln endpoint --backend vllm`): one engine in its own
    environment and process (rollout.vllm_backend), the served version's weights pushed to it when the
    version changes; replies are decoded as vLLM rollouts are (rollout.vllm_backend.VLLMGenerator)."""

    def __init__(self, policy, params=None, rollout=None):
        self.policy = policy
        self.rollout = rollout or VLLMRollout(policy, params or VLLMParams(), policy.device, seed=0)

    def __call__(self, policy, temperature: float, greedy: bool, seed: int):
        if policy is not self.policy:  # a new version is served: its weights go to the engine
            self.rollout.sync(policy)
            self.policy = policy
        return VLLMGenerator(self.rollout, policy, temperature, greedy, seed)

    def close(self) -> None:
        self.rollout.close()


def assistant_message(reply: str, action: str, tools: list[dict] | None) -> dict:
    """The reply as an OpenAI assistant message: reasoning apart, the action as the content, or as a tool
    call when it calls one of the request's tools (parsed as the environments parse them)."""
    msg: dict = {"role": "assistant", "content": action}
    thoughts = [m.group(0)[len("<think>"):-len("</think>")].strip() for m in THINK.finditer(reply)]
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    names = tuple(t.get("function", {}).get("name", "") for t in tools or [] if t.get("function", {}).get("name"))
    call = tool_call(action, names) if names else None
    if call is not None:
        name, arg = call
        spec = next(t["function"] for t in tools if t["function"]["name"].lower() == name)
        params = list((spec.get("parameters") or {}).get("properties") or {}) or ["argument"]
        msg["content"] = None
        msg["tool_calls"] = [{"id": "call_" + _short(reply), "type": "function",
                              "function": {"name": spec["name"], "arguments": json.dumps({params[0]: arg})}}]
    return msg


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
