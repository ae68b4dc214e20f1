"""The family catalog, below every layer that names a family.

Each family's environment class and task generator are named by module path and imported on first
use (naming one family never imports another's libraries). `resolve` checks a task type's level and
knobs against its generator; `env_version` is the version sealed into every panel. config validates
task types with this module, envs makes environments from it, synthesis generates tasks from it and
panels check their versions against it: none of them imports another for it.

Task i of a synthesis call with seed s gets seed `s * SEED_STRIDE + k * n + i` on its k-th attempt
(agentkiln.synthesis.generate), which bounds the tasks per call.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import ModuleType

# family name -> "module:class" of its environment (agentkiln.envs.base.Env)
FAMILIES: dict[str, str] = {
    "textworld": "agentkiln.envs.textworld_env:TextWorldEnv",
    "sokoban": "agentkiln.envs.sokoban:SokobanEnv",
    "gym-toytext": "agentkiln.envs.toytext:ToyTextEnv",
    "shop": "agentkiln.envs.shop:ShopEnv",
    "search-qa": "agentkiln.envs.search_qa:SearchQAEnv",
    "sql": "agentkiln.envs.sql:SQLEnv",
    "python-tool": "agentkiln.envs.python_tool:PythonToolEnv",
}
# family name -> its generator module (the contract: agentkiln.synthesis.generate's docstring)
GENERATORS: dict[str, str] = {
    "textworld": "agentkiln.synthesis.textworld_games",
    "sokoban": "agentkiln.synthesis.sokoban",
    "gym-toytext": "agentkiln.synthesis.toytext",
    "shop": "agentkiln.synthesis.shop",
    "search-qa": "agentkiln.synthesis.search_qa",
    "sql": "agentkiln.synthesis.sql",
    "python-tool": "agentkiln.synthesis.python_tool",
}
MAX_RETRIES = 20
SEED_STRIDE = 100_000
_ROOT = Path(__file__).parent
# code every family's tasks go through: the verification gate and the environment contract
_SHARED_SOURCES = (_ROOT / "synthesis" / "generate.py", _ROOT / "envs" / "base.py")


def generator(family: str) -> ModuleType:
    if family not in GENERATORS:
        raise ValueError(f"unknown environment family {family!r} (known: {sorted(GENERATORS)})")
    return importlib.import_module(GENERATORS[family])


def resolve(family: str, level: str = "easy", **overrides) -> dict:
    """The difficulty knobs of a level with overrides; unknown levels, knobs or values raise
    ValueError naming them."""
    gen = generator(family)
    if level not in gen.LEVELS:
        raise ValueError(f"{family}: unknown level {level!r} (known: {sorted(gen.LEVELS)})")
    knobs = dict(gen.LEVELS[level])
    unknown = set(overrides) - set(knobs)
    if unknown:
        raise ValueError(f"{family}: unknown difficulty knob(s) {sorted(unknown)} (known: {sorted(knobs)})")
    knobs |= overrides
    gen.check(knobs)
    return knobs


def env_version(family: str) -> str:
    """Library versions + a hash of the family's generator and environment code and the shared
    contract: a frozen panel is only valid for the environment version in its manifest."""
    gen = generator(family)
    env_module = importlib.import_module(FAMILIES[family].split(":")[0])
    h = hashlib.sha1()
    extra = set(getattr(gen, "SOURCES", ()))  # other code that shapes a family's observations (the sandbox)
    for f in sorted({gen.__file__, env_module.__file__, *map(str, _SHARED_SOURCES), *extra}):
        h.update(Path(f).read_bytes())
    return f"{family}-agentkiln-{h.hexdigest()[:12]}" + (f"+{gen.VERSION}" if gen.VERSION else "")
