"""The training engine: what a training loop asks of the machinery it runs on, so one SFT loop
(trainers.supervised) and one RL loop (trainers.rl) serve one process and data-parallel DeepSpeed ranks.

    engine.forward(fn, *args)   fn(model, *args): every forward enters here (ZeRO-3 gathers weights)
    engine.zero_grad()          before a step's first backward
    engine.backward(loss)       accumulate this rank's gradient of `loss`
    engine.step() -> float      clip by the global gradient norm, optimizer step; the norm before clipping
    engine.share(rows)          this rank's rows of a minibatch (and whether it has any of its own)
    engine.all_sum(values)      a sum over ranks;  engine.broadcast(obj): rank 0's object on every rank
    engine.gather(obj)          every rank's object, in rank order, on rank 0 (None elsewhere)
    engine.weights()            the full weights (rank 0; every rank calls it)
    engine.optimizer_state() / load_optimizer_state(state)   for checkpoints (every rank calls them)
    engine.log(metrics, step)   tracking, from rank 0 alone

A loop weights each backward by its share of the minibatch times `world` (DeepSpeed averages
gradients over ranks), so every engine steps on the same gradient: the minibatch's.
`LocalEngine` is one process; `trainers.distributed.RankEngine` is one DeepSpeed rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class Engine(Protocol):
    world: int
    rank: int
    main: bool
    micro_batching: bool  # a rank's share may be cut into micro-batches (gradients accumulate before a step)

    def forward(self, fn: Callable, *args, **kwargs) -> Any: ...
    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> float: ...
    def share(self, rows: list[int]) -> tuple[list[int], bool]: ...
    def all_sum(self, values: list[float]) -> list[float]: ...
    def broadcast(self, obj: Any) -> Any: ...
    def gather(self, obj: Any) -> list | None: ...
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def weights(self) -> dict | None: ...
    def optimizer_state(self) -> Any: ...
    def load_optimizer_state(self, state: Any) -> None: ...
    def log(self, metrics: dict, step: int) -> None: ...


# An engine factory: (model, optimizer, max_grad_norm) -> Engine; a loop builds its optimizer first
EngineFactory = Callable[[torch.nn.Module, torch.optim.Optimizer, float], Engine]


class LocalEngine:
    """One process: the model, a torch optimizer, clipping by the norm of `params`' gradients."""

    world = 1
    rank = 0
    main = True
    micro_batching = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                 params: list[torch.nn.Parameter] | None = None,
                 log: Callable[[dict, int], None] | None = None):
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm
        self.params = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        self._log = log

    def forward(self, fn: Callable, *args, **kwargs) -> Any:
        return fn(self.model, *args, **kwargs)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        self.optimizer.step()
        return norm

    def share(self, rows: list[int]) -> tuple[list[int], bool]:
        return rows, True

    def all_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list:
        return [obj]

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def weights(self) -> dict:
        return self.model.state_dict()

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def log(self, metrics: dict, step: int) -> None:
        if self._log is not None:
            self._log(metrics, step)


def local_factory(params: list[torch.nn.Parameter] | None = None,
                  log: Callable[[dict, int], None] | None = None) -> EngineFactory:
    """The one-process engine factory (clipping over `params`: the trainable ones)."""
    return lambda model, opt, max_grad_norm: LocalEngine(model, opt, max_grad_norm, params, log)
