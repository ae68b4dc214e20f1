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
import importlib.util
import os
import re
import sys
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


PLUGINS_ENV = "AGENTKILN_PLUGINS"  # the plugins this process loaded, for the processes it starts (os.pathsep list)
PLUGIN_GROUP = "agentkiln.plugins"  # entry points of installed packages: imported like `plugins` entries
FAMILY_NAME = re.compile(r"[a-z][a-z0-9-]{1,39}")
_loaded: set[str] = set()


class PluginError(ValueError):
    """A plugin that cannot be imported or registers a bad family (config turns it into a ParamsError)."""


def register_family(name: str, env: type | str, generator: ModuleType | str, replace: bool = False) -> None:
    """Register an environment family from your own code, as gymnasium's `register` does: `env` its
    environment class (a subclass of agentkiln.envs.Env, or "module:Class"), `generator` its task
    generator (a module, or its dotted name, with LEVELS, check and candidate: agentkiln.synthesis.generate).
    Call it in a plugin module that params.yaml's `plugins` lists (or an installed package's entry point
    in the `agentkiln.plugins` group); `agentkiln.synthesis.contract.check_family(name)` tests it."""
    if not FAMILY_NAME.fullmatch(name):
        raise PluginError(f"register_family: name {name!r}: lower-case letters, digits and '-', 2 to 40 of them")
    if name in FAMILIES and not replace and (FAMILIES[name], GENERATORS[name]) != (_path(env), _path(generator)):
        raise PluginError(f"register_family: {name!r} is registered already ({FAMILIES[name]}); choose another name "
                          "or pass replace=True")
    env_path, gen_path = _path(env), _path(generator)
    if ":" not in env_path:
        raise PluginError(f"register_family {name!r}: env {env!r}: expected a class or 'module:Class'")
    FAMILIES[name], GENERATORS[name] = env_path, gen_path


def _path(obj) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, ModuleType):
        return obj.__name__
    return f"{obj.__module__}:{obj.__qualname__}"


def load_plugins(entries: list[str] = (), root: str | Path | None = None) -> list[str]:
    """Import plugin modules once (each registers environment families and reward components): a dotted
    module name, or a `.py` file (relative to `root`); then the `agentkiln.plugins` entry points of
    installed packages. What was loaded is recorded in the environment (AGENTKILN_PLUGINS), so the
    processes this one starts (rollout workers, findings runs, stage subprocesses) load it too."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    done = []
    for entry in entries:
        done.append(_import(entry, Path(root) if root is not None else Path.cwd()))
    for ep in entry_points(group=PLUGIN_GROUP):
        if f"entry-point:{ep.value}" not in _loaded:
            try:
                ep.load()
            except Exception as e:  # noqa: BLE001  (named below, with the package it came from)
                raise PluginError(f"plugin entry point {ep.name} = {ep.value} ({PLUGIN_GROUP}) failed to load: "
                                  f"{type(e).__name__}: {e}") from None
            _loaded.add(f"entry-point:{ep.value}")
    known = [p for p in os.environ.get(PLUGINS_ENV, "").split(os.pathsep) if p]
    os.environ[PLUGINS_ENV] = os.pathsep.join(dict.fromkeys(known + done))
    return done


def _import(entry: str, root: Path) -> str:
    """Import one plugin (once); the form recorded for child processes (a file: its absolute path)."""
    if entry.endswith(".py"):
        path = (root / entry).resolve() if not Path(entry).is_absolute() else Path(entry)
        key = str(path)
        if key in _loaded:
            return key
        if not path.is_file():
            raise PluginError(f"plugins: {entry}: no such file ({path}); give a .py file or an importable module")
        name = "agentkiln_plugin_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its classes' "module:Class" paths import from here
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            del sys.modules[name]
            raise PluginError(f"plugins: {entry} failed to import: {type(e).__name__}: {e}") from None
    else:
        key = entry
        if key in _loaded:
            return key
        try:
            importlib.import_module(entry)
        except Exception as e:  # noqa: BLE001
            raise PluginError(f"plugins: {entry} failed to import ({type(e).__name__}: {e}); give an importable "
                              "module (installed, or on PYTHONPATH) or a .py file") from None
    _loaded.add(key)
    return key


def _known(family: str) -> bool:
    """Whether `family` is registered, loading the plugins this process inherited first if it is not."""
    if family not in FAMILIES and os.environ.get(PLUGINS_ENV):
        load_plugins([p for p in os.environ[PLUGINS_ENV].split(os.pathsep) if p])
    return family in FAMILIES


def generator(family: str) -> ModuleType:
    if not _known(family):
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
