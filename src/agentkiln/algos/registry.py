"""Advantage estimators and policy losses registered by name (as verl's core_algos): adding one is one
decorated function, and params' choices (`rl.algorithm`, `rl.policy_loss`) are this registry's names.

    @register_estimator("my_estimator")
    def my_estimator(c: Credit, p) -> tuple[Tensor, Tensor | None]:   # algos.estimators.Credit
        ...                                  # (advantage of every reply token [N], critic targets or None)

    @register_policy_loss("my_loss", token_level=True)
    def my_loss(logp, old_logp, advantages, seq_ids, p) -> tuple[Tensor, dict]:
        ...                                  # (scalar loss, {"clip_frac", "ratio_mean"})

Register before params are loaded (or validated) that name it. This module imports nothing heavy:
params are validated against these names without importing torch; the built-in estimators and
losses (agentkiln.algos.estimators, agentkiln.algos.losses) are imported on the first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

BUILTINS = ("agentkiln.algos.estimators", "agentkiln.algos.losses")  # the modules that register the built-ins


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable
    needs_critic: bool  # the trainer trains a value head and passes each turn's value (PPO's GAE)


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable
    token_level: bool  # reduced by `rl.loss_agg` (token-mean weighs micro-batches by tokens); else its own


_ESTIMATORS: dict[str, Estimator] = {}
_LOSSES: dict[str, PolicyLoss] = {}
_loaded = False


def register_estimator(name: str, *, needs_critic: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: `fn(credit, p)` becomes the advantage estimator `name` (rl.algorithm)."""
    return _register(_ESTIMATORS, name, lambda fn: Estimator(name, fn, needs_critic))


def register_policy_loss(name: str, *, token_level: bool = True) -> Callable[[Callable], Callable]:
    """Decorator: `fn(logp, old_logp, advantages, seq_ids, p)` becomes the policy loss `name` (rl.policy_loss)."""
    return _register(_LOSSES, name, lambda fn: PolicyLoss(name, fn, token_level))


def _register(table: dict, name: str, entry: Callable) -> Callable[[Callable], Callable]:
    """A decorator that files `entry(fn)` under `name`; a name another function holds is refused (the
    same function again, e.g. its module re-imported, is not)."""
    def deco(fn: Callable) -> Callable:
        old = table.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"{name!r} is registered already (by {old.fn.__module__}.{old.fn.__qualname__}): "
                             "choose another name")
        table[name] = entry(fn)
        return fn
    return deco


def _builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTINS:
            importlib.import_module(module)  # deferred: torch, only once something asks for a name


def estimator_names() -> tuple[str, ...]:
    _builtins()
    return tuple(_ESTIMATORS)


def policy_loss_names() -> tuple[str, ...]:
    _builtins()
    return tuple(_LOSSES)


def estimator(name: str) -> Estimator:
    _builtins()
    if name not in _ESTIMATORS:
        raise ValueError(f"rl algorithm {name!r}: expected one of {', '.join(_ESTIMATORS)} "
                         "(or register one: agentkiln.algos.registry.register_estimator)")
    return _ESTIMATORS[name]


def policy_loss(name: str) -> PolicyLoss:
    _builtins()
    if name not in _LOSSES:
        raise ValueError(f"rl policy_loss {name!r}: expected one of {', '.join(_LOSSES)} "
                         "(or register one: agentkiln.algos.registry.register_policy_loss)")
    return _LOSSES[name]
