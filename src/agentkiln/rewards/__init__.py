"""Rewards as a subsystem: a stage's turn reward is a list of named components with weights
(params.yaml `rl.defaults.reward`, overridable per stage component by component).

    rewards, means = turn_rewards(episodes, p.reward, RewardState(p))

Components (each `fn(episode, ctx, cfg) -> per-turn values`, registered by name):
- outcome     the family verifier's reward (components)
- format      -1 on a reply that is no action / tool call (components)
- invalid     -1 on an invalid action (components)
- truncation  -1 on the last turn of an episode that ran out of turns (components)
- failure     -1 on the last turn of an episode the task ended lost: a hole, a wrong answer (components)
- length      DAPO's soft overlong penalty on reply tokens (components)
- potential   gamma Phi(s') - Phi(s), Phi = -expert's steps to go / scale (potential)
- adaptive    a base component x (1 - the task type's EMA success) (adaptive)
- process     an implicit PRM trained online on (won, lost) pairs (process)
- judge       a local model's P(yes) against a rubric (judge)
The default (outcome 1, the rest 0) is each environment's own reward, unchanged. A plugin adds a
component with `register_reward(name, fn, settings)` (docs/extending.md).
"""

from agentkiln.rewards import adaptive, judge, potential, process  # noqa: F401  (they register their components)
from agentkiln.rewards.combine import turn_rewards
from agentkiln.rewards.components import COMPONENTS, Context, component, register_reward
from agentkiln.rewards.state import RewardState


def needs_potentials(params) -> bool:
    """Whether the rollout must measure the expert's distances (potential, or adaptive on it)."""
    return params.potential.weight != 0 or (params.adaptive.weight != 0 and params.adaptive.base == "potential")


def observe_iteration(state: RewardState, episodes: list, params) -> dict:
    """After an iteration's rollouts: update `state` on every episode played (adaptive success, the
    process model), then the iteration's reward metrics: each active component's mean weighted
    return (`reward/<name>`), `shaped_return`, and the state's own (process_loss, process_pairs)."""
    row = state.update(episodes)
    _, means = turn_rewards(episodes, params, state)
    row["shaped_return"] = means.pop("shaped_return")
    return row | {f"reward/{name}": v for name, v in means.items()}


__all__ = ["COMPONENTS", "Context", "RewardState", "component", "needs_potentials", "observe_iteration",
           "register_reward", "turn_rewards"]
