"""Where a policy to evaluate or watch comes from (a baseline, a pipeline model, a registry URI, a
directory, an RL checkpoint), and an episode as text."""

from __future__ import annotations

from pathlib import Path

from agentkiln import paths


KINDS = ("a model is random or oracle (baselines), sft, rl or distilled (the pipeline's), a registry URI "
         "models:/<name>@<alias> or models:/<name>/<version>, a policy directory (with config.json, e.g. models/sft) "
         "or an RL checkpoint directory (with state.pt, while its stage runs or after it was killed)")


def source_problem(source: str) -> str | None:
    """What is wrong with a model argument that names a path, found without importing anything heavy:
    said at once, before seconds of torch imports. None when it may be fine (resolve_policy decides)."""
    if source in ("random", "oracle", "sft", "rl", "distilled") or source.startswith("models:/"):
        return None
    path = Path(source)
    if not path.exists():
        return f"{source}: no such file or directory; {KINDS}"
    if not ((path / "config.json").is_file() or (path / "state.pt").is_file()):
        return f"{source}: holds neither config.json nor state.pt; {KINDS}"
    return None


def resolve_policy(source: str, params, init: str | None = None):
    """A Policy from any of the sources above (None for the baselines)."""
    import torch

    from agentkiln.policy import load_policy

    if source in ("random", "oracle"):
        return None
    if source in ("base", "sft", "rl", "distilled"):
        path = paths.model_dirs(params)[source]
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: the {source} model is missing; run `dvc repro` (or `dvc pull`) first")
        return load_policy(path)
    if source.startswith("models:/"):
        from agentkiln import tracking
        from agentkiln.registry.model_registry import downloaded_policy

        tracking.setup()
        with downloaded_policy(source) as path:
            policy = load_policy(path)
        policy.source = source
        return policy
    path = Path(source)
    if (path / "state.pt").is_file():  # an RL checkpoint: weights on top of the stage's starting model
        start = Path(init) if init else paths.model_dir(params.rl.stage(path.name).init)
        policy = load_policy(start)
        policy.model.load_state_dict(torch.load(path / "state.pt", weights_only=False)["policy"])
        return policy
    if (path / "config.json").is_file():
        return load_policy(path)
    raise FileNotFoundError(source_problem(source) or f"{source}: {KINDS}")


def transcript(episode) -> str:
    lines = [f"--- {episode.task_id} ({episode.family}): {'won' if episode.won else 'lost'} in {len(episode.turns)} turns"]
    for i, t in enumerate(episode.turns, 1):
        lines.append(f"[{i}] {t.observation.strip()[:300]}")
        lines.append(f"    > {t.reply}{'  (invalid)' if t.invalid else ''}  reward {t.reward:+.2f}")
    return "\n".join(lines)
