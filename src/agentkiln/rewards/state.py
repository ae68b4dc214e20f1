"""What the reward keeps across iterations, owned by the trainer: each task type's success (adaptive),
the process model, the judge; plus the stage's gamma and reply budget the components read."""

from __future__ import annotations

from agentkiln.config import RLParams
from agentkiln.rewards.adaptive import SuccessEMA
from agentkiln.rewards.judge import Judge
from agentkiln.rewards.process import ProcessModel
from agentkiln.rollout.episode import Episode, own_episodes


class RewardState:
    """`update` after each iteration's rollouts; `state_dict` goes into the checkpoint. The process
    model exists only with reward.process.weight > 0, the judge only with reward.judge.weight > 0
    (`judge` may be given: a loaded one, e.g. in tests)."""

    def __init__(self, p: RLParams, seed: int = 0, judge: Judge | None = None, compute=None):
        r = p.reward
        self.gamma, self.max_reply_tokens = p.gamma, p.max_reply_tokens
        self.success = SuccessEMA(r.adaptive.decay)
        self.process = ProcessModel(r.process, seed) if r.process.weight > 0 else None
        self.judge = judge
        if self.judge is None and r.judge.weight > 0:
            self.judge = Judge.from_settings(r.judge, compute)

    def update(self, episodes: list[Episode]) -> dict:
        """Learn from one iteration's episodes (every one played; adaptive success from the policy's own
        episodes, the process model from all); returns metrics."""
        self.success.update(own_episodes(episodes))
        return self.process.update(episodes) if self.process is not None else {}

    def state_dict(self) -> dict:
        return {"success": self.success.state_dict(),
                "process": self.process.state_dict() if self.process is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.success.load_state_dict(state["success"])
        if self.process is not None and state["process"] is not None:
            self.process.load_state_dict(state["process"])
