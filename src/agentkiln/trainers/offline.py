"""Episodes from outside the rollouts in the RL batch (`rl.offline`): a collected split's rewarded
episodes (agentkiln collect: what an agent harness played through the endpoint), trained on with the
ids and behaviour log-probs they were served with, so PPO's ratio is taken against the policy that
actually played them (its clip bounds how far an old episode can move the new policy).

Each iteration takes the next `per_iteration` of them, in order and round the split (the same
iteration always gets the same ones: a resumed run trains on what an uninterrupted one would).
Episodes of one task id form a group (the estimator's baseline); each turn is its own GiGPO anchor
(a harness's states carry no hash), so step-level credit reduces to the episode's.
"""

from __future__ import annotations

import copy

from agentkiln.config import OfflineParams
from agentkiln.policy.model import Policy
from agentkiln.rollout.episode import Episode
from agentkiln.collected import load_split, training_episodes

GROUP_BASE = 1_000_000  # above any rollout group index


class OfflineFeed:
    def __init__(self, p: OfflineParams, policy: Policy, where: str = "rl.offline.split"):
        self.p = p
        records = load_split(p.split, where)
        served, other = training_episodes(records, policy, won_only=False)
        if not served:
            raise ValueError(f"{where}: {p.split} has no rewarded episode served with this policy's tokenizer "
                             f"({len(other)} rewarded ones were served by another tokenizer or re-tokenised); "
                             "the offline batch needs the ids and log-probs as served")
        tasks = sorted({ep.task_id for ep in served})
        for i, ep in enumerate(served):
            ep.group = GROUP_BASE + tasks.index(ep.task_id)
            for k, t in enumerate(ep.turns):
                t.anchor = f"offline:{i}:{k}"
        self.episodes, self.skipped = served, len(other)

    def take(self, it: int) -> list[Episode]:
        """Iteration `it`'s offline episodes (fresh copies: the trainer writes advantages onto them)."""
        n = len(self.episodes)
        k = min(self.p.per_iteration, n)
        picked = [self.episodes[(it * k + j) % n] for j in range(k)]
        return [copy.deepcopy(ep) for ep in sorted(picked, key=lambda e: e.group)]
