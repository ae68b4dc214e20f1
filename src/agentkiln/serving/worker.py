"""The endpoint's decoding loop: one thread owns the model. Requests queue up; the thread takes what
arrived within `wait` seconds of the first (at most `max_batch`), builds each one's episode
(serving.conversation), decodes them together with the rollout's generator (rollout.agents.HFGenerator:
one KV cache for the batch, constrained rows masked to their admissible actions) and answers each.
Greedy requests share a batch, as do sampled ones at one temperature; a request with a `seed` is
decoded alone, so its reply depends on its seed only. The policy is swapped (a followed alias moved)
only between batches.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from concurrent.futures import Future
from collections.abc import Callable
from dataclasses import dataclass, field

from agentkiln.config import VLLMParams
from agentkiln.envs.base import tool_call
from agentkiln.policy.prompt import THINK, parse_reply
from agentkiln.rollout.agents import HFGenerator, decoding_mode
from agentkiln.rollout.decoding import TrieCache
from agentkiln.rollout.sequence import add_reply
from agentkiln.rollout.vllm_backend import VLLMGenerator, VLLMRollout
from agentkiln.collected import tokenizer_digest
from agentkiln.serving.conversation import Conversations, RequestError
from agentkiln.serving.recorder import Recorder
from agentkiln.serving.source import ModelSource


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


class Worker:
    def __init__(self, source: ModelSource, recorder: Recorder | None = None, max_batch: int = 16,
                 wait: float = 0.005, seed: int = 0, generators: Callable | None = None):
        self.source, self.recorder = source, recorder
        self.generators = generators or HFGenerator  # (policy, temperature, greedy, seed) -> rollout.agents.Generator
        self.max_batch, self.wait, self.seed = max_batch, wait, seed
        self.conversations = Conversations()
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self._tries: dict[str, TrieCache] = {}
        self._digests: dict[str, str] = {}
        self.batches = 0
        self.thread = threading.Thread(target=self._loop, name="decode", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        self.queue.put(job)
        return job.future

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
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
                    self._decode(group, version, policy)
                except Exception as e:  # noqa: BLE001  (answer every waiting request; the loop goes on)
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(e)
            self.batches += 1

    def _decode(self, jobs: list[Job], version: str, policy) -> None:
        if version not in self._tries:  # per served version (a swapped-in policy has its own tokenizer)
            self._tries[version], self._digests[version] = TrieCache(policy), tokenizer_digest(policy)
        tries = self._tries[version]
        live = []
        for job in jobs:
            tools = job.tools if policy.fmt.native_tools else None
            try:
                episode_id, ep, retok, parent = self.conversations.start(policy, version, job.messages, job.admissible,
                                                                         job.budget, tools)
            except RequestError as e:
                job.future.set_exception(e)
                continue
            ep.task_id = str(job.metadata.get("task_id") or ep.task_id)  # what the client says it plays
            ep.family = str(job.metadata.get("family") or ep.family)
            constrained = decoding_mode({"default": job.decoding}, "", job.admissible) == "constrained"
            live.append((job, episode_id, ep, retok, parent, tools, tries(job.admissible, tools) if constrained else None))
        if not live:
            return
        first = live[0][0]
        greedy = first.temperature == 0
        gen = self.generators(policy, first.temperature if not greedy else 1.0, greedy,
                              first.seed if first.seed is not None else self.seed)
        gen.begin(len(live))
        eps = [ep for _, _, ep, *_ in live]
        replies = gen.replies(eps, list(range(len(live))), [t for *_, t in live], [j.budget for j, *_ in live])
        for (job, episode_id, ep, retok, parent, tools, trie), (ids, lps, ents, allowed) in zip(live, replies):
            prompt = ep.window_ids(len(ep.windows) - 1)
            add_reply(ep, ids, lps, ents, allowed if trie else None)
            text = trie.action(ids) if trie else policy.chat.decode(ids)
            turn = ep.turns[-1]
            turn.reply, turn.action = text, parse_reply(text)
            ended = bool(ids) and ids[-1] in policy.chat.stop_ids
            message = assistant_message(text, turn.action, job.tools)
            self.conversations.keep(episode_id, ep, version, job.messages, message)
            if self.recorder is not None:
                self.recorder.write(episode_id, ep, {
                    "model": self.source.spec, "model_version": version, "retokenized": retok, "parent": parent,
                    "tokenizer": self._digests[version],
                    "temperature": job.temperature or 1.0})
            job.future.set_result({
                "message": message, "episode_id": episode_id, "version": version, "retokenized": retok,
                "prompt_ids": prompt, "ids": ids, "logprobs": lps, "turn": len(ep.turns), "window": len(ep.windows) - 1,
                "action": turn.action, "reply": text,
                "finish_reason": "tool_calls" if message.get("tool_calls") else ("stop" if ended else "length"),
                "tokens": [policy.tokenizer.decode([i]) for i in ids]})


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
