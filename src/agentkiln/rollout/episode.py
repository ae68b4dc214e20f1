"""An episode: the turns played and the one token sequence they make.

    ids = c_0 r_0 c_1 r_1 ... r_n       (c_0: system + goal + first observation + generation prompt;
                                         r_k: the reply generated at turn k, exactly as sampled;
                                         c_k: what the chat template appends after r_(k-1))

Turn k's reply is ids[turn.start:turn.end]. While the episode fits the policy's context window it is
one window (one training row). When the next observation and a full reply no longer fit, a new window
starts: c_0, then the most recent turns that fit in half the context, then the new observation; its
row is `c_0 + ids[start:stop]` and its loss covers only the replies generated in it (each reply is
trained in the context it was sampled in). Baselines (random, oracle) play without ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Turn:
    observation: str  # what the environment showed before this turn's reply
    admissible: list[str] | None  # the valid actions then (None: free-form family)
    anchor: str  # hash of the raw state (GiGPO's step-level groups)
    reply: str = ""  # the reply's text
    action: str = ""  # what it asked the environment to do (parsed from the reply)
    reward: float = 0.0
    invalid: bool = False
    tool_error: bool = False
    mistake: bool = False  # a demonstration's injected wrong action: context for SFT, never a target
    guided: bool = False  # RL guidance: the expert's action, its tokens forced (their log-probs the policy's)
    parsed: bool = True  # the reply parsed to an action (a tool family: to one of its tool calls)
    to_go: int | None = None  # expert's steps to a win from this turn's state, -1: none (potentials=True)
    window: int = 0  # the window this reply was generated in
    start: int = 0  # ids[start:end] are the reply's tokens
    end: int = 0
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of every reply token
    entropy: list[float] = field(default_factory=list)
    allowed: list[list[int]] | None = None  # constrained decoding: the ids allowed at each reply token
    advantage: float | None = None  # RL: the mean advantage its reply tokens were trained with
    trainer_logp: float | None = None  # RL: its reply's log-prob recomputed by the trainer (vLLM, async)

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Episode:
    task_id: str
    family: str
    group: int  # episodes of one group start from the same initial state
    task_type: str = ""
    max_turns: int = 0  # the environment's turn limit
    goal: str = ""
    turns: list[Turn] = field(default_factory=list)
    won: bool = False
    end_to_go: int | None = None  # the same after the last turn (potentials=True)
    cut: bool = False  # ended because its latest observation no longer fit the context window
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0  # len(c_0)
    windows: list[list[int]] = field(default_factory=list)  # [start, stop) in ids; window 0 starts at 0
    policy_version: int = 0  # the trainer's updates applied to the weights that played it (async RL)
    guide_at: int | None = None  # RL guidance: from this turn on the expert plays it (None: the policy alone)

    @property
    def guided(self) -> bool:
        """The expert played some of its turns (rollout guidance): not the policy's own success."""
        return any(t.guided for t in self.turns)

    @property
    def truncated(self) -> bool:
        """Ended without a win by running out of turns (or of context)."""
        return not self.won and (self.cut or len(self.turns) >= self.max_turns)

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def n_invalid(self) -> int:
        return sum(t.invalid for t in self.turns)

    @property
    def n_tokens(self) -> int:
        """Generated tokens."""
        return sum(t.n_tokens for t in self.turns)

    def window_ids(self, w: int) -> list[int]:
        """The row of window `w`: window 0 is ids[0:stop]; a later one is c_0 + ids[start:stop]."""
        start, stop = self.windows[w]
        return self.ids[:stop] if start == 0 else self.ids[: self.prompt_len] + self.ids[start:stop]

    def window_len(self, w: int) -> int:
        """len(window_ids(w)), without building the list."""
        start, stop = self.windows[w]
        return stop if start == 0 else self.prompt_len + stop - start

    def window_offset(self, w: int) -> int:
        """Row position of ids[i] in window `w` = i + window_offset(w)."""
        start = self.windows[w][0]
        return 0 if start == 0 else self.prompt_len - start


def own_episodes(episodes: list[Episode]) -> list[Episode]:
    """The episodes rollout guidance had no part in (every one when it is off): the policy's own success."""
    return [ep for ep in episodes if ep.guide_at is None]


def to_record(ep: Episode, temperature: float = 1.0) -> dict:
    """An episode as plain data: its turns' texts and outcomes, and its token ids as generated (windows,
    each reply's span, per-token behaviour log-probs, constrained-decoding choices): the format of logged
    training episodes and of the endpoint's recorded ones."""
    return {"task_id": ep.task_id, "family": ep.family, "task_type": ep.task_type, "group": ep.group, "won": ep.won,
            "reward": ep.reward, "policy_version": ep.policy_version, "goal": ep.goal, "max_turns": ep.max_turns,
            "temperature": temperature, "ids": list(ep.ids), "prompt_len": ep.prompt_len,
            "windows": [list(w) for w in ep.windows], "turns": [
                {"observation": t.observation, "reply": t.reply, "action": t.action, "reward": t.reward,
                 "invalid": t.invalid, "tokens": t.n_tokens, "advantage": t.advantage,
                 "behaviour_logp": round(sum(t.logprobs), 6),
                 "trainer_logp": None if t.trainer_logp is None else round(t.trainer_logp, 6),
                 "window": t.window, "start": t.start, "end": t.end, "guided": t.guided,
                 "logprobs": [round(x, 6) for x in t.logprobs], "allowed": t.allowed}
                for t in ep.turns]}


def from_record(rec: dict) -> Episode:
    """The episode a record was made from (its turns' texts, ids, spans, log-probs and advantages)."""
    turns = [Turn(observation=t["observation"], admissible=None, anchor="", reply=t["reply"], action=t["action"],
                  reward=t["reward"], invalid=t["invalid"], window=t["window"], start=t["start"], end=t["end"],
                  logprobs=list(t["logprobs"]), allowed=t["allowed"], advantage=t["advantage"],
                  trainer_logp=t["trainer_logp"], guided=t.get("guided", False)) for t in rec["turns"]]
    return Episode(task_id=rec["task_id"], family=rec["family"], group=rec["group"], task_type=rec["task_type"],
                   max_turns=rec["max_turns"], goal=rec["goal"], turns=turns, won=rec["won"], ids=list(rec["ids"]),
                   prompt_len=rec["prompt_len"], windows=[list(w) for w in rec["windows"]],
                   policy_version=rec["policy_version"])
