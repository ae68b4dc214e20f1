"""What the agent is shown and how its replies become actions: one format for SFT, RL rollouts,
distillation and evaluation, saved next to the weights (agent.json) so every stage talks to the
model the same way.

Messages: the first user message is the goal and the first observation; every later message is
an observation; each lists the admissible actions when the family has them (`show_admissible`).
Replies: the action as plain text (`go north`, `sql[SELECT ...]`), optionally after reasoning in
`<think>...</think>`, or a native tool call (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen/Hermes style) that `parse_reply` turns into the family's `name[argument]` form.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

FORMAT_VERSION = "v2"  # v1: step-independent prompts (a window of past actions)
THINK = re.compile(r"<think>.*?</think>", re.S)
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
BRACKET_CALL = re.compile(r"\s*([A-Za-z_][\w-]*)\s*\[(.*)\]\s*", re.S)


@dataclass(frozen=True)
class AgentFormat:
    system_prompt: str | None = None  # None: the chat template's default (none for the scratch template)
    show_admissible: bool = True      # list the valid actions in every message (families that have them)
    observation_role: str = "user"    # or "tool": the role of environment messages in the chat template
    native_tools: bool = False        # replies as the template's tool calls (tool families), not name[arg]
    version: str = FORMAT_VERSION
    # per family, the system prompt of its episodes (what the actions and the reply format are: what an
    # instruct model needs to act zero-shot); a family without one gets `system_prompt`
    system_prompts: dict[str, str] = field(default_factory=dict, hash=False)

    def system_for(self, family: str) -> str | None:
        return self.system_prompts.get(family, self.system_prompt)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AgentFormat:
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"agent.json format {d.get('version')!r}: this agentkiln reads {FORMAT_VERSION!r} "
                             "(episodes as conversations); retrain the policy (dvc repro sft)")
        return cls(**{k: dict(v) if k == "system_prompts" else v for k, v in d.items() if k in cls.__dataclass_fields__})


def observation_text(fmt: AgentFormat, observation: str, admissible: list[str] | None, goal: str | None = None) -> str:
    """One environment message: (the goal,) the observation, (the valid actions)."""
    parts = [goal] if goal else []
    parts.append(observation)
    if fmt.show_admissible and admissible:
        parts.append("Actions: " + " | ".join(admissible))
    return "\n".join(parts)


def render_action(fmt: AgentFormat, action: str, tools: list[dict] | None = None) -> str:
    """The reply text that performs `action` (what SFT teaches and constrained decoding allows)."""
    if fmt.native_tools and tools:
        m = BRACKET_CALL.fullmatch(action)
        spec = next((t["function"] for t in tools if m and t["function"]["name"] == m.group(1).lower()), None)
        if spec is not None:
            arg = next(iter(spec["parameters"]["properties"]))
            call = {"name": spec["name"], "arguments": {arg: m.group(2).strip()}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return action


def parse_reply(text: str) -> str:
    """The action in a reply: reasoning in <think>...</think> is dropped (an unclosed <think> leaves
    no action), a native tool call becomes `name[first argument]`, anything else is the stripped text
    (the environment judges it: garbage is an invalid step, never an exception)."""
    text = THINK.sub("", text)
    if "<think>" in text:
        return ""
    m = TOOL_CALL.search(text)
    if m:
        try:
            call = json.loads(m.group(1))
            args = call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            value = next(iter(args.values())) if isinstance(args, dict) and args else ""
            return f"{call['name']}[{value if isinstance(value, str) else json.dumps(value)}]"
        except (ValueError, KeyError, TypeError, AttributeError):
            return text.strip()
    return text.strip()
