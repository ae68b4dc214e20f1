"""The one prompt format shared by SFT, RL rollouts, distillation and evaluation.

Step-independent prompts (verl-agent style): the goal, the last `history` actions, the current
observation and the admissible actions. Context stays constant over long episodes and every turn is
one training sample; the agent's reply is an action followed by the end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GOAL, PAST, OBS, ACTIONS, ACT = "<goal>", "<past>", "<obs>", "<actions>", "<act>"
MARKERS = [GOAL, PAST, OBS, ACTIONS, ACT]


@dataclass(frozen=True)
class AgentFormat:
    """Saved next to the weights (agent.json) so every later stage prompts the model identically."""

    history: int = 4
    version: str = "v1"

    def to_dict(self) -> dict:
        return asdict(self)


def build_prompt(
    fmt: AgentFormat, goal: str, past_actions: list[str], observation: str, admissible: list[str] | None
) -> str:
    past = past_actions[-fmt.history :] if fmt.history else []
    parts = [GOAL, goal, PAST, " ; ".join(past) if past else "none", OBS, observation]
    if admissible is not None:
        parts += [ACTIONS, " | ".join(admissible)]
    parts.append(ACT)
    return " ".join(parts)
