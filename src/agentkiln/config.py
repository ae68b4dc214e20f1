"""Typed schema of params.yaml: the only source of hyper-parameters.

Every stage reads its own section through `load_params()`. Validation happens at load, before any
work: an unknown key, a wrong type or an impossible value raises `ParamsError` naming the file,
the dotted field and the bad value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PARAMS_FILE = "params.yaml"


class ParamsError(ValueError):
    """params.yaml is missing, unparsable or fails the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- synthesize
class CoinCollector(_Strict):
    """TextWorld coin collector. Levels 1-100: a chain of rooms; 101-200: with dead ends;
    201-300: dead ends and distractor rooms. The quest length grows with level % 100."""

    challenge: Literal["coin_collector"]
    level_min: int = Field(ge=1, le=300)
    level_max: int = Field(ge=1, le=300)

    @model_validator(mode="after")
    def _range(self):
        if self.level_max < self.level_min:
            raise ValueError(f"level_max ({self.level_max}) < level_min ({self.level_min})")
        return self


class Cooking(_Strict):
    """TextWorld cooking (household, ALFWorld-like): find ingredients, prepare and eat a meal."""

    challenge: Literal["cooking"]
    recipe: int = Field(1, ge=1, le=5, description="ingredients in the recipe")
    take: int = Field(1, ge=0, le=5, description="ingredients to find and take")
    go: Literal[1, 6, 9, 12] = Field(1, description="number of rooms")
    open: bool = False
    cook: bool = False
    cut: bool = False


GameType = Annotated[Union[CoinCollector, Cooking], Field(discriminator="challenge")]


class Split(_Strict):
    n_games: int = Field(ge=1)
    seed: int = Field(ge=0)
    mix: dict[str, float] = Field(description="game type name -> share of the split")

    @model_validator(mode="after")
    def _mix(self):
        if not self.mix:
            raise ValueError("mix is empty")
        for name, share in self.mix.items():
            if share <= 0:
                raise ValueError(f"mix.{name} = {share}: shares must be > 0")
        return self


class SynthesizeParams(_Strict):
    workers: int = Field(2, ge=1, le=64)
    max_expert_steps: int = Field(60, ge=1, description="games whose walkthrough is longer are rejected")
    game_types: dict[str, GameType]
    splits: dict[Literal["sft", "rl", "test"], Split]

    @model_validator(mode="after")
    def _consistent(self):
        missing = {"sft", "rl", "test"} - set(self.splits)
        if missing:
            raise ValueError(f"splits: missing {sorted(missing)}")
        for split_name, split in self.splits.items():
            for name in split.mix:
                if name not in self.game_types:
                    raise ValueError(
                        f"splits.{split_name}.mix.{name}: unknown game type "
                        f"(known: {sorted(self.game_types)})"
                    )
        seeds = [s.seed for s in self.splits.values()]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"splits: seeds must differ between splits, got {seeds}")
        return self


# --------------------------------------------------------------------------- policy
class ModelParams(_Strict):
    """`source: scratch` builds a Llama-style model with random weights and a word-level tokenizer
    from the synthesized text; any other value is a local directory or hub id for
    `AutoModelForCausalLM.from_pretrained` (its own tokenizer is used)."""

    source: str = "scratch"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(512, ge=8)
    max_context: int = Field(512, ge=32)

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


class SFTParams(_Strict):
    model: ModelParams = ModelParams()
    history: int = Field(2, ge=0, description="previous (action, observation) steps in the prompt")
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(2e-3, gt=0, lt=1)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)


class RLParams(_Strict):
    iterations: int = Field(30, ge=0)
    tasks_per_iter: int = Field(16, ge=1)
    group_size: int = Field(8, ge=2, description="G episodes per task from the same initial state")
    max_turns: int = Field(20, ge=1)
    temperature: float = Field(1.0, gt=0)
    lr: float = Field(3e-4, gt=0, lt=1)
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    kl_coef: float = Field(0.01, ge=0)
    ppo_epochs: int = Field(1, ge=1)
    minibatch_size: int = Field(64, ge=1, description="samples (turns) per optimizer step")
    max_grad_norm: float = Field(1.0, gt=0)


class DistillParams(_Strict):
    student: ModelParams = ModelParams(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    samples_per_task: int = Field(4, ge=1)
    temperature: float = Field(0.7, gt=0)
    max_turns: int = Field(30, ge=1)
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0, lt=1)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)


class EvaluateParams(_Strict):
    max_turns: int = Field(30, ge=1)
    policies: list[Literal["random", "sft", "rl", "distilled"]] = ["random", "sft", "rl", "distilled"]
    confidence: float = Field(0.95, gt=0, lt=1)
    seed: int = Field(0, ge=0, description="seeds the random baseline")


class PromoteParams(_Strict):
    model_name: str = Field("agentkiln-policy", min_length=1)
    candidates: list[Literal["sft", "rl", "distilled"]] = ["rl", "distilled", "sft"]
    metric: Literal["success"] = "success"
    margin: float = Field(0.0, ge=0, le=1, description="challenger must beat champion by this much")


class Params(_Strict):
    seed: int = Field(0, ge=0)
    torch_threads: int = Field(2, ge=1, description="fixed so CPU results are bit-identical")
    synthesize: SynthesizeParams
    sft: SFTParams = SFTParams()
    rl: RLParams = RLParams()
    distill: DistillParams = DistillParams()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: {err.error_count()} invalid parameter(s):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {loc}: unknown key (check spelling; see src/agentkiln/config.py)")
        else:
            lines.append(f"  - {loc} = {e.get('input')!r}: {e['msg']}")
    return "\n".join(lines)


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ParamsError with a readable message otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: not found (run from the repository root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_errors(path, e)) from None
