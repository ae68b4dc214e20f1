"""The trajectory viewer (agentkiln.evaluate.trajectories): every turn of the chosen episodes, model
output escaped (a reply with <script> is shown as text), a fixed sample (first success, first
failure, then panel order), advantages where known, same episodes -> same bytes."""

from __future__ import annotations

from agentkiln.evaluate import trajectories
from agentkiln.rollout.episode import Episode, Turn


def _episode(task: str, won: bool, replies: list[str]) -> Episode:
    ep = Episode(task, "sokoban", 0, goal="push the box <onto> the target")
    ep.turns = [Turn(observation=f"obs {i} of {task}", admissible=None, anchor="a", reply=r, action=r.strip(),
                     reward=1.0 if won and i == len(replies) - 1 else 0.0, invalid=r.startswith("bad"))
                for i, r in enumerate(replies)]
    ep.won = won
    return ep


def test_sample_puts_a_success_and_a_failure_first():
    eps = [_episode("t0", False, ["up"]), _episode("t1", False, ["up"]), _episode("t2", True, ["up"]),
           _episode("t3", False, ["up"]), _episode("t4", True, ["up"])]
    assert [e.task_id for e in trajectories.sample(eps, 4)] == ["t2", "t0", "t1", "t3"]
    assert [e.task_id for e in trajectories.sample(eps[:2], 4)] == ["t0", "t1"]


def test_every_turn_shown_and_model_output_escaped(tmp_path):
    evil = "<script>alert(1)</script>"
    shown = {"sft": [_episode("t0", True, ["left", evil, "right"])], "random": [_episode("t1", False, ["bad move"])]}
    for t, adv in zip(shown["sft"][0].turns, [0.5, -0.25, 1.0]):  # a training episode's turns carry advantages
        t.advantage = adv
    shown["sft"][0].turns[2].guided = True  # rollout guidance: the expert's reply is marked as such
    page = trajectories.render(shown)
    assert page.count("the expert&#x27;s reply") + page.count("the expert's reply") == 1
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<pre class='reply'>") == 4 and page.count("turn ") >= 4
    assert "obs 2 of t0" in page and "advantage -0.250" in page and "invalid" in page
    assert page.count("advantage ") == 3 and page.count("policy version 0") == 1  # evaluation episodes have none
    assert "<a href='#sft'>sft</a>" in page and "id='random'" in page
    assert "push the box &lt;onto&gt; the target" in page
    assert "http" not in page  # self-contained: nothing is fetched
    a = trajectories.write(shown, tmp_path / "a.html").read_bytes()
    assert a == trajectories.write(shown, tmp_path / "b.html").read_bytes()
