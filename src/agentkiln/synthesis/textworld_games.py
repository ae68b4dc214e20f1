"""TextWorld games, compiled offline: coin collector, treasure hunter and cooking.

Knobs (every level has all of them; `game` picks which apply):
- game: coin_collector | treasure_hunter | cooking
- coin_levels [lo, hi]: coin collector levels 1-100 are a chain of rooms, 101-200 add dead ends,
  201-300 add distractor rooms; the route length grows with level % 100. A task's level is drawn
  uniformly from the range by its seed.
- treasure_levels [lo, hi]: treasure hunter levels 1-10 (5 rooms), 11-20 (10 rooms, closed doors
  and containers), 21-30 (20 rooms, locked doors); quest length grows within each band.
- recipe, take, go, open, cook, cut: cooking's ingredients in the recipe, ingredients to find,
  rooms (1, 6, 9 or 12) and which preparations are needed.
- max_turns: the episode's turn limit.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import textworld
from textworld.challenges import coin_collector, cooking, treasure_hunter
from textworld.generator.chaining import QuestGenerationError

from agentkiln.artifacts import TASK_FILES_KEY, sha256_cached
from agentkiln.envs.base import TaskSpec

VERSION = f"textworld-{textworld.__version__}"
GAMES = ("coin_collector", "treasure_hunter", "cooking")
_COMMON = {"open": False, "cook": False, "cut": False}
LEVELS = {
    "easy": {"game": "coin_collector", "coin_levels": [2, 8], "treasure_levels": [1, 5],
             "recipe": 1, "take": 1, "go": 1, **_COMMON, "max_turns": 20},
    "medium": {"game": "coin_collector", "coin_levels": [102, 108], "treasure_levels": [6, 10],
               "recipe": 1, "take": 1, "go": 6, **_COMMON, "max_turns": 30},
    "hard": {"game": "coin_collector", "coin_levels": [110, 116], "treasure_levels": [11, 15],
             "recipe": 2, "take": 2, "go": 6, "open": True, "cook": False, "cut": False, "max_turns": 40},
}
_RANGES = {"coin_levels": (1, 300), "treasure_levels": (1, 30)}


def check(knobs: dict) -> None:
    def bad(name, why):
        raise ValueError(f"textworld: knob {name} = {knobs[name]!r}: {why}")

    if knobs["game"] not in GAMES:
        bad("game", f"must be one of {list(GAMES)}")
    for name, (lo, hi) in _RANGES.items():
        v = knobs[name]
        if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) and lo <= v[0] <= v[1] <= hi):
            bad(name, f"must be [lo, hi] with {lo} <= lo <= hi <= {hi}")
    for name, lo, hi in (("recipe", 1, 5), ("take", 0, 5)):
        if type(knobs[name]) is not int or not lo <= knobs[name] <= hi:
            bad(name, f"must be an int in [{lo}, {hi}]")
    if knobs["go"] not in (1, 6, 9, 12):
        bad("go", "must be 1, 6, 9 or 12 (rooms)")
    for name in ("open", "cook", "cut"):
        if type(knobs[name]) is not bool:
            bad(name, "must be true or false")
    if type(knobs["max_turns"]) is not int or knobs["max_turns"] < 1:
        bad("max_turns", "must be an int >= 1")


# TextWorld writes the absolute path of its grammar files (inside this machine's installation) into
# every game's .json; it is read only to generate text, never to play. Written relative to the
# installation, the same game has the same bytes in every clone.
_INSTALL = os.path.dirname(os.path.dirname(os.path.abspath(textworld.__file__))) + os.sep


# Inform stamps the day it compiles a story file into its header as the serial number (bytes 0x12 to
# 0x17, YYMMDD), so the same game compiled on another day had other bytes, another sealed hash and
# other panel digests. Every game gets this one serial instead: the day the committed data were
# compiled, so their hashes stand. The header's checksum covers bytes 0x40 on, not the serial.
SERIAL = b"261127"
SERIAL_AT = slice(0x12, 0x18)


def _compile(game, opts: textworld.GameOptions) -> Path:
    out = Path(textworld.generator.compile_game(game, opts))
    out.with_suffix(".ni").unlink(missing_ok=True)  # Inform 7 source: not needed to play
    story = bytearray(out.read_bytes())
    story[SERIAL_AT] = SERIAL
    out.write_bytes(bytes(story))
    meta = out.with_suffix(".json")
    if meta.is_file():
        meta.write_text(meta.read_text().replace(json.dumps(_INSTALL)[1:-1], ""))
    return out


def candidate(seed: int, knobs: dict, out_dir: Path | None) -> TaskSpec | None:
    """Compile the game of `seed` to `out_dir/games/tw-<seed>.z8` (+ its .json), their sha256 in the
    task's data; None when TextWorld cannot build a quest of the drawn length on the drawn map (the gate
    then tries the next seed)."""
    if out_dir is None:
        raise ValueError("textworld: generate() needs out_dir (where the compiled games go)")
    games = Path(out_dir) / "games"
    games.mkdir(parents=True, exist_ok=True)
    opts = textworld.GameOptions()
    opts.seeds = seed
    opts.path = str(games / f"tw-{seed}.z8")
    opts.force_recompile = True
    rng = random.Random(seed)
    data: dict = {"game": knobs["game"], "game_file": f"games/tw-{seed}.z8"}
    with warnings.catch_warnings():  # jericho's "not fully supported" warning while recording the walkthrough
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        try:
            game = _make(knobs, seed, rng, data, opts)
        except QuestGenerationError:
            return None
        _compile(game, opts)
    # the game and its metadata, sealed with the split manifest: checked before every play
    data[TASK_FILES_KEY] = {f"games/{f.name}": sha256_cached(f) for f in sorted(games.glob(f"tw-{seed}.*"))}
    return TaskSpec(task_id=f"tw-{seed}", family="textworld", seed=seed, data=data)


def _make(knobs: dict, seed: int, rng: random.Random, data: dict, opts: textworld.GameOptions):
    if knobs["game"] == "coin_collector":
        data["level"] = rng.randint(*knobs["coin_levels"])
        return coin_collector.make({"level": data["level"]}, opts)
    if knobs["game"] == "treasure_hunter":
        data["level"] = rng.randint(*knobs["treasure_levels"])
        return treasure_hunter.make({"level": data["level"]}, opts)
    settings = {k: knobs[k] for k in ("recipe", "take", "go", "open", "cook", "cut")}
    return cooking.make({**settings, "split": "train", "recipe_seed": seed}, opts)
