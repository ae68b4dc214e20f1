"""Growing an episode's token sequence, turn by turn: one set of rules for episodes the policy plays
and for episodes rendered from text (expert demonstrations, a teacher's episodes re-tokenized for a
student), so SFT trains on exactly the token layout rollouts produce.

The window rule (docs/episodes.md): a turn's observation is appended to the current window if the
window then still has room for a full reply (`reply_budget` tokens); otherwise a new window starts
with c_0 (system + goal + first observation), then the most recent turns whose ids fit in half of the
room c_0 leaves (at least the latest reply), then the observation. If even that does not fit, the
episode ends there (`Episode.cut`, counted as truncated). A first message longer than the context
keeps its last tokens.
"""

from __future__ import annotations

from agentkiln.policy.model import Policy
from agentkiln.policy.prompt import observation_text, render_action
from agentkiln.rollout.episode import Episode, Turn

SAME, NEW_WINDOW, CUT = "same", "new", "cut"


def add_observation(ep: Episode, policy: Policy, reply_budget: int, tools: list[dict] | None = None) -> str:
    """Append the ids of the latest turn's observation (ep.turns[-1]); SAME, NEW_WINDOW or CUT."""
    chat, ctx = policy.chat, policy.max_context
    turn, k = ep.turns[-1], len(ep.turns) - 1
    if k == 0:
        ids = chat.start(observation_text(policy.fmt, turn.observation, turn.admissible, ep.goal), tools,
                         policy.fmt.system_for(ep.family))
        ids = ids[-(ctx - reply_budget):]
        ep.ids, ep.prompt_len, ep.windows = ids, len(ids), [[0, len(ids)]]
        return NEW_WINDOW
    prev = ep.turns[k - 1]
    piece = [] if ep.ids[prev.end - 1] in chat.stop_ids else [chat.end_id]  # a reply cut at its budget
    piece += chat.observation(observation_text(policy.fmt, turn.observation, turn.admissible))
    status = SAME
    if ep.window_len(len(ep.windows) - 1) + len(piece) + reply_budget > ctx:
        room = ctx - reply_budget - ep.prompt_len - len(piece)
        if len(ep.ids) - prev.start > room:
            return CUT
        start = prev.start
        for t in reversed(ep.turns[: k - 1]):
            if len(ep.ids) - t.start > room // 2:
                break
            start = t.start
        ep.windows.append([start, len(ep.ids)])
        status = NEW_WINDOW
    ep.ids += piece
    ep.windows[-1][1] = len(ep.ids)
    return status


def add_reply(ep: Episode, ids: list[int], logprobs: list[float] | None = None, entropy: list[float] | None = None,
              allowed: list[list[int]] | None = None) -> None:
    """Append the latest turn's reply ids (as generated) and what the sampler knew of them."""
    turn = ep.turns[-1]
    turn.window, turn.start = len(ep.windows) - 1, len(ep.ids)
    ep.ids += ids
    turn.end = len(ep.ids)
    ep.windows[-1][1] = len(ep.ids)
    turn.logprobs, turn.entropy, turn.allowed = logprobs or [], entropy or [], allowed


def render(policy: Policy, episode: Episode, reply_budget: int, tools: list[dict] | None = None) -> Episode:
    """The token sequence of an episode known as text (each turn's observation, admissible actions
    and action: an expert demonstration, or another policy's episode re-tokenized), built by the
    same rules as a rollout: each action's reply ids are what the policy would have to generate."""
    out = Episode(episode.task_id, episode.family, episode.group, episode.task_type, episode.max_turns,
                  episode.goal, won=episode.won)
    for turn in episode.turns:
        out.turns.append(Turn(turn.observation, turn.admissible, turn.anchor, reply=turn.reply, action=turn.action,
                              reward=turn.reward, invalid=turn.invalid, mistake=turn.mistake))
        if add_observation(out, policy, reply_budget, tools) == CUT:
            out.turns.pop()
            out.cut = True
            break
        add_reply(out, policy.chat.reply(render_action(policy.fmt, turn.action, tools)))
    return out
