"""SFT's training episodes: a mixture of the synthesized expert table's variants (`sft.data`), plus,
for later rounds, a policy's own won episodes on the sft tasks (`sft.data.own_wins`).

- `clean` / `recovery` / `alternative` (agentkiln.synthesis.recovery): each variant's weight w is how
  many times, on average, every episode of it is trained on per epoch: floor(w) copies of all of
  them, then a seeded subset of round(frac(w) * n). Clean first (task order), then recovery, then
  alternative; {clean: 1, recovery: 0, alternative: 0} gives exactly the clean-only episode list (and
  the scratch tokenizer's text) of the recipe before recovery data existed.
- `own_wins` (rejection sampling, "real end-to-end trajectories"): the saved policy `own_wins.policy`
  plays every sft task `samples_per_task` times at `temperature`; its won episodes are appended. When
  the policy being trained talks exactly like that one (same tokenizer, chat template, agent format,
  no shorter context) it trains on the very ids that were generated; otherwise on the episodes
  re-rendered with its own tokenizer. Turns the environment called invalid stay as context with no
  loss, like the injected mistakes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

from agentkiln.config import ComputeParams, OwnWinsParams, SFTDataParams
from agentkiln.panels import load_panel
from agentkiln.policy import load_policy
from agentkiln.policy.model import Policy
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.rollout.episode import Episode
from agentkiln.schemas import VARIANTS
from agentkiln.stages.common import expert_episodes, used_variants  # noqa: F401  (re-exported)


def mixture(df: pd.DataFrame, data: SFTDataParams, seed: int) -> tuple[list[Episode], dict[str, int]]:
    """The text episodes SFT trains on, and how many of each variant."""
    out, counts = [], {}
    for variant in VARIANTS:
        w = getattr(data, variant)
        if w <= 0:
            continue
        episodes = expert_episodes(df[df["variant"] == variant])
        whole, frac = int(w), w - int(w)
        chosen = episodes * whole
        if frac:
            rng = random.Random(f"sft-data:{seed}:{variant}")
            chosen += [episodes[i] for i in sorted(rng.sample(range(len(episodes)), round(frac * len(episodes))))]
        out += chosen
        counts[variant] = len(chosen)
    return out, counts


def same_ids(a: Policy, b: Policy) -> bool:
    """The two policies turn the same conversation into the same ids (a's generated ids are b's to train on)."""
    return a.tokenizer.get_vocab() == b.tokenizer.get_vocab() and a.tokenizer.chat_template == b.tokenizer.chat_template \
        and a.fmt == b.fmt and b.max_context >= a.max_context


def own_wins(p: OwnWinsParams, tasks_dir: Path, compute: ComputeParams, seed: int) -> tuple[list[Episode], Policy, int]:
    """(won episodes, the policy that played them, episodes played) on the sft tasks."""
    path = Path(p.policy)
    if not path.is_dir():
        raise FileNotFoundError(f"sft.data.own_wins.policy: {path} is not a saved policy directory (train it first, "
                                "or set own_wins.policy: null)")
    player = load_policy(path, compute=compute)
    agent = PolicyAgent(player, temperature=p.temperature, seed=seed)
    played = run_episodes(agent, load_panel(tasks_dir, "sft"), tasks_dir, None, group_size=p.samples_per_task,
                          progress="own rollouts")
    won = [e for e in played if e.won]
    for ep in won:
        for t in ep.turns:
            t.mistake = t.invalid  # the policy's own invalid steps: context, not targets
    return won, player, len(played)
