"""An OpenAI chat request as an agentkiln episode: the messages a harness sends become the turns of
one token sequence, built by the same rules as a rollout (rollout.sequence), so a served reply is
decoded from exactly the ids the evaluated agent would have seen.

A harness resends the whole conversation every turn. The server keeps, for every reply it served,
the episode as it stood after that reply, keyed by a digest of the messages up to and including that
reply (`Conversations`). A request whose history ends with a reply the server served continues that
episode: its token ids are kept as generated and only the new messages are appended (the delta
method). A history the server did not serve (an edited reply, another server's, a restart) is
re-tokenised from its text and flagged `retokenized`: its ids are what this policy would have
generated, not what was generated.

Messages: system messages are ignored (the policy's own system prompt, from its agent.json, is the
one it was trained with); consecutive user / tool messages form one observation; the first one holds
the goal and the first observation (what `agentkiln eval` shows as the first message).
"""

from __future__ import annotations

import copy
import hashlib
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from agentkiln.errors import UserError
from agentkiln.policy.model import Policy
from agentkiln.policy.prompt import render_action
from agentkiln.rollout.episode import Episode, Turn
from agentkiln.rollout.sequence import CUT, add_observation, render


class RequestError(UserError, ValueError):
    """A request the server cannot answer as asked: an OpenAI-style error, its message says why and
    `param` names the field (HTTP `status`: 400 unless said otherwise)."""

    def __init__(self, message: str, code: str = "invalid_request_error", param: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.code, self.param, self.status = code, param, status


def text_of(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise RequestError(f"message content of type {type(content).__name__}: expected a string or a list of text parts")


def _arguments(args) -> dict:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):  # kept as text: the client's arguments, whatever they are
            return {"_raw": args}
    return args if isinstance(args, dict) else {"_raw": args}


def tool_calls_of(msg: dict) -> list[tuple[str, dict]]:
    out = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        out.append((str(fn.get("name", "")), _arguments(fn.get("arguments", {}))))
    return out


def normal(msg: dict) -> list:
    """What identifies a message across round trips (ids, names and reasoning fields left out)."""
    role = msg.get("role")
    if role == "assistant":
        return [role, text_of(msg.get("content")).strip(), tool_calls_of(msg)]
    return [role, text_of(msg.get("content"))]


def digest(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps([normal(m) for m in messages], sort_keys=True).encode()).hexdigest()


def action_of(msg: dict) -> str:
    """The action an assistant message performed, in the environments' `name[argument]` form."""
    calls = tool_calls_of(msg)
    if calls:
        name, args = calls[0]
        value = next(iter(args.values()), "") if args else ""
        return f"{name}[{value if isinstance(value, str) else json.dumps(value)}]"
    return text_of(msg.get("content")).strip()


def segments(messages: list[dict]) -> list[tuple[str, dict | None]]:
    """(observation text, the assistant message that answered it or None) per turn."""
    msgs = [m for m in messages if m.get("role") != "system"]
    for m in msgs:
        if m.get("role") not in ("user", "tool", "assistant"):
            raise RequestError(f"message role {m.get('role')!r}: expected system, user, assistant or tool",
                               param="messages")
    if not msgs or msgs[0].get("role") == "assistant":
        raise RequestError("the conversation must start with a user message (the goal and first observation)",
                           param="messages")
    if msgs[-1].get("role") == "assistant":
        raise RequestError("the last message is the assistant's: send the observation that follows it",
                           param="messages")
    out, obs = [], []
    for m in msgs:
        if m["role"] == "assistant":
            if not obs:
                raise RequestError("two assistant messages in a row: each reply answers an observation",
                                   param="messages")
            out.append(("\n".join(obs), m))
            obs = []
        else:
            obs.append(text_of(m.get("content")))
    out.append(("\n".join(obs), None))
    return out


@dataclass
class Saved:
    episode_id: str
    episode: Episode
    version: str
    turns: int
    size: int  # footprint(episode)


def footprint(ep: Episode) -> int:
    """About the bytes an episode holds in memory: ids and floats as Python objects (36 and 32 bytes),
    its texts (one byte a character), the constrained-decoding choices, a few hundred bytes a turn."""
    n = 600 + 36 * len(ep.ids) + 120 * len(ep.windows)
    for t in ep.turns:
        n += 600 + len(t.observation) + len(t.reply) + len(t.action) + 32 * (len(t.logprobs) + len(t.entropy))
        n += sum(56 + 36 * len(a) for a in t.allowed or [])
        n += sum(56 + len(a) for a in t.admissible or [])
    return n


class Conversations:
    """Episodes as they stood after each served reply, by the digest of the messages that far, and each
    recorded episode's latest turn count (a request continuing an older turn forks a new episode).
    Bounded in bytes (`max_bytes`, approximate): past it the least recently used are dropped, counted
    and logged; a client continuing a dropped one is served from its text (flagged `retokenized`)."""

    def __init__(self, max_bytes: int = 256 * 2**20, log=print):
        self.max_bytes, self.log = max_bytes, log
        self.saved: OrderedDict[str, Saved] = OrderedDict()
        self.heads: dict[str, int] = {}
        self._refs: dict[str, int] = {}  # saved states per episode id: its head goes with its last one
        self.bytes = self.dropped = self.dropped_bytes = 0

    def stats(self) -> dict:
        return {"conversations": len(self.saved), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "dropped": self.dropped, "dropped_bytes": self.dropped_bytes}

    def start(self, policy: Policy, version: str, messages: list[dict], admissible: list[str] | None,
              budget: int, tools: list[dict] | None) -> tuple[str, Episode, bool, str | None]:
        """(episode id, the episode with the new observation appended, retokenized, parent id): ready to decode."""
        segs = segments(messages)
        history = [m for m in messages if m.get("role") != "system"]
        last = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=-1)
        retok, parent = False, None
        key = digest(history[: last + 1]) if last >= 0 else None
        saved = self.saved.get(key) if key else None
        if last < 0:
            episode_id, ep = new_id(), Episode("endpoint", "", 0)
        elif saved is not None and saved.version == version:
            self.saved.move_to_end(key)
            ep = copy.deepcopy(saved.episode)
            episode_id = saved.episode_id
            if self.heads.get(episode_id, saved.turns) != saved.turns:  # an earlier turn replayed: a new branch
                episode_id, parent = new_id(), saved.episode_id
        else:
            episode_id, retok = new_id(), True
            ep = from_text(policy, segs[:-1], budget, tools)
            if ep.cut:
                raise RequestError("the conversation does not fit the policy's context window",
                                   "context_length_exceeded", "messages")
        ep.turns.append(Turn(segs[-1][0], admissible, ""))
        if add_observation(ep, policy, budget, tools) == CUT:
            raise RequestError(f"the conversation no longer fits the policy's context window ({policy.max_context} "
                               f"tokens with a {budget}-token reply): the episode ends here", "context_length_exceeded",
                               "messages")
        return episode_id, ep, retok, parent

    def keep(self, episode_id: str, ep: Episode, version: str, messages: list[dict], reply: dict) -> None:
        """Remember the episode after the reply `reply` (the assistant message as served)."""
        history = [m for m in messages if m.get("role") != "system"] + [reply]
        key = digest(history)
        if key in self.saved:
            self._forget(key)
        saved = Saved(episode_id, copy.deepcopy(ep), version, len(ep.turns), footprint(ep))
        self.saved[key] = saved
        self.bytes += saved.size
        self._refs[episode_id] = self._refs.get(episode_id, 0) + 1
        self.heads[episode_id] = len(ep.turns)
        while self.bytes > self.max_bytes and self.saved:
            size = self._forget(next(iter(self.saved)))
            self.dropped += 1
            self.dropped_bytes += size
            if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th ... drop: said, not flooded
                self.log(f"kept conversations reached --max-kept-bytes ({self.max_bytes:,} bytes): {self.dropped:,} "
                         "dropped so far, least recently used first (continuing one re-tokenizes it from its text)")

    def _forget(self, key: str) -> int:
        saved = self.saved.pop(key)
        self.bytes -= saved.size
        self._refs[saved.episode_id] -= 1
        if not self._refs[saved.episode_id]:
            del self._refs[saved.episode_id], self.heads[saved.episode_id]
        return saved.size


def from_text(policy: Policy, segs: list[tuple[str, dict]], budget: int, tools: list[dict] | None) -> Episode:
    """The episode of a conversation known only as text, rendered by the rollout's rules."""
    text = Episode("endpoint", "", 0)
    for obs, reply in segs:
        action = action_of(reply)
        text.turns.append(Turn(obs, None, "", reply=render_action(policy.fmt, action, tools), action=action))
    return render(policy, text, budget, tools)


def new_id() -> str:
    return "ep-" + uuid.uuid4().hex[:16]
