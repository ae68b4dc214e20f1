"""Token ids of a conversation, built append-only from the model's own chat template.

An episode is one token sequence: `start` (system + first user message + the generation prompt),
then for every turn the reply the model generated (kept exactly, ending with the end-of-turn token)
and `observation` (what the template puts after that end-of-turn: the environment's message, then
the next generation prompt). Each piece is the difference between two renderings of the template
(the verl/SkyRL "delta" method) and is tokenized on its own, so no earlier token is ever re-encoded:
the ids trained on are the ids generated plus the ids appended. Re-rendering a whole conversation
instead drifts (templates that strip `<think>` from past turns, BPE merges across turn boundaries).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from agentkiln.errors import UserError


class ChatTemplateError(UserError, ValueError):
    """The tokenizer's chat template cannot be split into append-only pieces."""


_USER, _REPLY, _OBS = "u", "x", "o"  # sentinel contents of the reference renderings
CACHE_ENTRIES = 65_536  # token-id caches keyed by text: rollouts reuse a few thousand; a server's clients vary it


class LRU(OrderedDict):
    """A dict that keeps its `capacity` most recently used entries: the token ids of texts (replies,
    admissible actions) that a long-running server's clients can vary without end."""

    def __init__(self, capacity: int = CACHE_ENTRIES):
        super().__init__()
        self.capacity = capacity

    def get_or_set(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > self.capacity:
            self.popitem(last=False)
        return value


@dataclass
class ChatFormat:
    """Pieces of one tokenizer's chat template. `system`: the system prompt (None: the template's
    default); `observation_role`: the role environment messages take (user, or tool)."""

    tokenizer: object
    system: str | None = None
    observation_role: str = "user"
    source: str = "policy"
    _ids: LRU = field(default_factory=LRU, repr=False)

    def __post_init__(self) -> None:
        gen = self._render(self._head(_USER), True)
        full = self._render(self._head(_USER) + [_msg("assistant", _REPLY)], False)
        if not full.startswith(gen) or _REPLY not in full[len(gen):]:
            raise self._error("an assistant reply does not follow the generation prompt")
        after = full[len(gen):]
        cut = after.index(_REPLY) + len(_REPLY)
        self._reply_prefix, self._reply_tail = after[: cut - len(_REPLY)], after[cut:]
        tail_ids = self._encode(self._reply_tail)
        specials = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        if tail_ids and tail_ids[0] in specials:
            self.end_id = tail_ids[0]
        elif self.tokenizer.eos_token_id is not None:
            self.end_id = self.tokenizer.eos_token_id
        else:
            raise self._error("no end-of-turn token after an assistant reply and no eos_token")
        end_text = self.tokenizer.decode([self.end_id])
        if not self._reply_tail.startswith(end_text):
            end_text = ""  # the end token is not in the template's text: the next piece starts right after the reply
        self._after_reply = gen + self._reply_prefix + _REPLY + end_text
        self._gen = gen
        self.stop_ids = frozenset(i for i in (self.end_id, self.tokenizer.eos_token_id) if i is not None)

    # -- pieces -----------------------------------------------------------------------------------
    def start(self, text: str, tools: list[dict] | None = None, system: str | None = None) -> list[int]:
        """System prompt (`system`, else the format's) + the first user message + the generation prompt.
        Only this piece holds the system prompt: the later pieces are the same whatever it says."""
        return self._encode(self._render(self._head(text, system), True, tools))

    def reply(self, text: str) -> list[int]:
        """The ids the model must generate to answer `text`: its content as the template renders an
        assistant message, then the end-of-turn token (SFT targets, constrained-decoding tries)."""
        def make() -> list[int]:
            full = self._render(self._head(_USER) + [_msg("assistant", text)], False)
            seg = full[len(self._gen):]
            if not full.startswith(self._gen) or not seg.endswith(self._reply_tail):
                raise self._error(f"the assistant message {text[:40]!r} is not rendered as prefix + content + end")
            body = seg[len(self._reply_prefix): len(seg) - len(self._reply_tail)]
            return self._encode(self._reply_prefix + body) + [self.end_id]

        return list(self._ids.get_or_set(("reply", text), make))

    def observation(self, text: str) -> list[int]:
        """What follows a reply's end-of-turn token: the environment's message, the generation prompt."""
        msgs = self._head(_USER) + [_msg("assistant", _REPLY), _msg(self.observation_role, text)]
        full = self._render(msgs, True)
        if not full.startswith(self._after_reply):
            raise self._error(f"a {self.observation_role} message after a reply changes the text before it")
        return self._encode(full[len(self._after_reply):])

    def decode(self, ids: list[int]) -> str:
        """A reply's text (the end-of-turn token dropped)."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)

    # -- helpers ----------------------------------------------------------------------------------
    def _head(self, user: str, system: str | None = None) -> list[dict]:
        system = system or self.system
        return ([_msg("system", system)] if system else []) + [_msg("user", user)]

    def _render(self, messages: list[dict], generation: bool, tools: list[dict] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation)
        except Exception as e:  # jinja errors of a template that refuses a role or an order
            raise self._error(f"rendering {[m['role'] for m in messages]} failed: {e}") from e

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _error(self, why: str) -> ChatTemplateError:
        return ChatTemplateError(f"{self.source}: chat template: {why}; agentkiln needs an append-only template "
                                 f"(roles system/user/assistant/{self.observation_role})")


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}
