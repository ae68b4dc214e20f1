"""The trajectory viewer: a self-contained HTML page showing episodes turn by turn: observation, the
agent's reply, the action it parsed to, reward, invalid actions and tool errors, and for training
episodes the advantage each reply was trained with and the policy version that played it. The
evaluate stage writes reports/trajectories.html (sampled panel episodes); each RL stage writes
reports/rl/<stage>/trajectories.html (its first and last iterations' logged episodes). Model output is untrusted text: everything is escaped, and the
page loads nothing from anywhere. Same episodes -> same bytes."""

from __future__ import annotations

import html
from pathlib import Path

from agentkiln.rollout.episode import Episode

PER_POLICY = 4  # episodes shown per policy: the first success and failure first, then panel order

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "details{border:1px solid #ccc;border-radius:4px;margin:.5em 0;padding:.3em .6em}"
         "summary{cursor:pointer;font-weight:bold}.won{color:#1a7f37}.lost{color:#b42318}"
         "pre{white-space:pre-wrap;background:#f6f8fa;padding:.5em;margin:.2em 0;font-size:90%}"
         ".reply{background:#eef4ff}.meta{color:#555;font-size:85%}nav a{margin-right:1em}")


def sample(episodes: list[Episode], k: int = PER_POLICY) -> list[Episode]:
    """k episodes in a fixed order: the first won and the first lost one (when there are), then
    the panel's order."""
    first = [e for e in (next((e for e in episodes if e.won), None), next((e for e in episodes if not e.won), None)) if e]
    rest = [e for e in episodes if all(e is not f for f in first)]
    return (first + rest)[:k]


def _turns(ep: Episode) -> list[str]:
    out = []
    for i, t in enumerate(ep.turns):
        flags = [f for f, on in (("invalid", t.invalid), ("tool error", t.tool_error),
                                 ("the expert's reply (rollout guidance)", t.guided)) if on]
        adv = f" · advantage {t.advantage:+.3f}" if t.advantage is not None else ""
        out += [f"<p class='meta'>turn {i + 1} · reward {t.reward:+.2f}{adv}"
                f"{' · ' + ', '.join(flags) if flags else ''}</p>",
                f"<pre>{html.escape(t.observation)}</pre>",
                f"<pre class='reply'>&gt; {html.escape(t.reply)}</pre>"]
        if t.action and t.action != t.reply.strip():
            out.append(f"<p class='meta'>action: <code>{html.escape(t.action)}</code></p>")
    return out


def render(shown: dict[str, list[Episode]], title: str = "agentkiln episodes, turn by turn") -> str:
    """`shown`: a section's name (a policy, an RL iteration) -> its episodes. A turn's advantage is
    shown where it has one (training episodes)."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             "<nav>" + "".join(f"<a href='#{html.escape(p)}'>{html.escape(p)}</a>" for p in shown) + "</nav>"]
    for policy, episodes in shown.items():
        parts.append(f"<h2 id='{html.escape(policy)}'>{html.escape(policy)}</h2>")
        for ep in episodes:
            verdict = "won" if ep.won else "lost"
            trained = any(t.advantage is not None for t in ep.turns)
            version = f" · policy version {ep.policy_version}" if trained else ""
            parts += [f"<details><summary>{html.escape(ep.task_id)} ({html.escape(ep.family)}): "
                      f"<span class='{verdict}'>{verdict}</span> in {len(ep.turns)} turns</summary>",
                      f"<p class='meta'>goal: {html.escape(ep.goal)}{version}</p>",
                      *_turns(ep), "</details>"]
    return "\n".join(parts + ["</body></html>"]) + "\n"


def write(shown: dict[str, list[Episode]], path: Path, title: str = "agentkiln episodes, turn by turn") -> Path:
    Path(path).write_text(render(shown, title))
    return Path(path)
