"""The registry of reward components and the simple ones.

A component is `fn(episode, ctx, cfg) -> list[float]`: one value per turn of the episode, before its
weight (`cfg.weight`, applied by agentkiln.rewards.combine). `ctx` is the `Context` of the call (the
reward section, gamma, the reply budget, the trainer-owned state); `cfg` the component's own
settings (agentkiln.config.RewardParams). Every component but `outcome` should give values in
[-1, 1]; combine clips them there anyway.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentkiln.config import PLUGIN_REWARDS, RewardComponent, RewardParams
from agentkiln.envs import env_class
from agentkiln.rollout.episode import Episode

if TYPE_CHECKING:  # the state module registers nothing and imports this one
    from agentkiln.rewards.state import RewardState

Component = Callable[[Episode, "Context", object], list[float]]
COMPONENTS: dict[str, Component] = {}


def component(name: str) -> Callable[[Component], Component]:
    """Register `fn` as the built-in component `name` (a field of RewardParams)."""
    def register(fn: Component) -> Component:
        if name in COMPONENTS:
            raise ValueError(f"reward component {name!r} is registered twice")
        COMPONENTS[name] = fn
        return fn
    return register


NAME = re.compile(r"[a-z][a-z0-9_]{1,39}")


def register_reward(name: str, fn: Component, settings: type[RewardComponent] = RewardComponent) -> Component:
    """Register a reward component from your own code (a plugin module params.yaml's `plugins` lists):
    `fn(episode, ctx, cfg) -> one value per turn` (clipped to [-1, 1], times `cfg.weight`, bounded per
    episode with the other shaping terms), `settings` its settings: a RewardComponent subclass (its
    `weight` and your own fields), validated where params name it (`rl.defaults.reward.<name>: {weight:
    ..., ...}`) without a field in agentkiln's config. Returns `fn` (usable as a decorator's body)."""
    if not NAME.fullmatch(name):
        raise ValueError(f"register_reward: name {name!r}: lower-case letters, digits and '_', 2 to 40 of them")
    if not (isinstance(settings, type) and issubclass(settings, RewardComponent)):
        raise ValueError(f"register_reward {name!r}: settings must subclass agentkiln.config.RewardComponent")
    if name in RewardParams.model_fields or (name in COMPONENTS and COMPONENTS[name] is not fn):
        raise ValueError(f"register_reward: {name!r} is a component already; choose another name")
    COMPONENTS[name] = fn
    PLUGIN_REWARDS[name] = settings
    return fn


@dataclass(frozen=True)
class Context:
    params: RewardParams
    state: RewardState


@component("outcome")
def outcome(ep: Episode, ctx: Context, cfg) -> list[float]:
    """The family verifier's reward of each turn (1.0 on the winning turn for binary families)."""
    return [t.reward for t in ep.turns]


@component("format")
def format_(ep: Episode, ctx: Context, cfg) -> list[float]:
    """-1 on a turn whose reply did not parse to an action or tool call (Turn.parsed)."""
    return [0.0 if t.parsed else -1.0 for t in ep.turns]


@component("invalid")
def invalid(ep: Episode, ctx: Context, cfg) -> list[float]:
    """-1 on a turn whose action the environment refused."""
    return [-1.0 if t.invalid else 0.0 for t in ep.turns]


@component("truncation")
def truncation(ep: Episode, ctx: Context, cfg) -> list[float]:
    """-1 on the last turn of an episode that ran out of turns (or of context) without a win."""
    out = [0.0] * len(ep.turns)
    if out and ep.truncated:
        out[-1] = -1.0
    return out


@component("failure")
def failure(ep: Episode, ctx: Context, cfg) -> list[float]:
    """-1 on the last turn of an episode the task itself ended without a win (a FrozenLake hole, a wrong
    answer), of a family in `cfg.families` (all when empty); 0 for one cut by the turn limit. With a 0/1
    outcome every lost episode of a group scores the same, so a group that never wins teaches nothing;
    this one tells an episode that stepped into a hole from one still walking when time ran out (GiGPO's
    step groups then compare the actions taken from one state by whether they ended the game)."""
    out = [0.0] * len(ep.turns)
    if out and not ep.won and not ep.truncated and (not cfg.families or ep.family in cfg.families):
        out[-1] = -1.0
    return out


def overlong(n: int, budget: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of an n-token reply under a budget of L tokens: 0 up to L - buffer,
    then linear down to -1 at L, -1 beyond."""
    if n <= budget - buffer:
        return 0.0
    if n <= budget:
        return (budget - buffer - n) / buffer
    return -1.0


@component("length")
def length(ep: Episode, ctx: Context, cfg) -> list[float]:
    """The overlong penalty of each turn's reply tokens under the turn's reply budget (the stage's
    max_reply_tokens, else the family's default)."""
    budget = ctx.state.max_reply_tokens or env_class(ep.family).max_reply_tokens
    return [overlong(t.n_tokens, budget, cfg.buffer) for t in ep.turns]
