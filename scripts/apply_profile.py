"""Apply a params profile (a YAML file of overrides, e.g. profiles/gpu-qwen2.5.yaml) and `--set`
overrides to params.yaml, validated by agentkiln.config before anything is written.

    python scripts/apply_profile.py profiles/gpu-qwen2.5.yaml --set sft.model.source=/models/Qwen2.5-0.5B-Instruct
    python scripts/apply_profile.py profiles/gpu-qwen2.5.yaml --set compute.device=cuda:1 --dry-run

Overrides merge into params.yaml key by key (a nested mapping of the profile changes only the keys it
names), except the values of `mix`, `stages`, `decoding` and `arms`, which a profile replaces whole (an
RL stage list, a split's mixture, a decoding table, the ablation arms are one setting each). `--set
a.b.c=VALUE` sets one key (VALUE is read as YAML: `true`, `3`, `1e-4`, `[a, b]`, `{x: 1}`, `null`);
`--set`s apply after the profile, in order.

params.yaml keeps its comments and layout: each override is written in place (the value on its own
line, the line's comment kept; a key params.yaml lacks is added to its section). If an edit cannot be
made in place (the result would not read back as the merged parameters) the file is written whole,
without its comments, under a header that says so. Nothing is written unless the result passes
`agentkiln.config.load_params` (unknown keys, wrong types, a model directory that is not there: the
error names the key). Run it from the repository root (relative model paths are checked from there);
DVC then reruns the stages whose parameters changed (`dvc repro`, or `bash scripts/run_pipeline.sh`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

import yaml

from agentkiln.config import ParamsError, load_params, read_yaml

REPLACED_WHOLE = ("mix", "stages", "decoding", "arms")
HEADER = ("# agentkiln parameters, written whole by scripts/apply_profile.py (the comments of the previous\n"
          "# params.yaml could not be kept: see its git history and src/agentkiln/config.py for every field).\n")


class ProfileError(ValueError):
    """A profile or --set that cannot be applied."""


# --------------------------------------------------------------------------- merging
def leaves(over: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, value) of every override: mappings recurse, except under REPLACED_WHOLE keys."""
    out = []
    for k, v in over.items():
        path = (*prefix, str(k))
        if isinstance(v, dict) and v and str(k) not in REPLACED_WHOLE:
            out += leaves(v, path)
        else:
            out.append((path, v))
    return out


def set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for i, k in enumerate(path[:-1]):
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[path[-1]] = copy.deepcopy(value)


def get_path(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def parse_set(item: str) -> tuple[tuple, object]:
    if "=" not in item:
        raise ProfileError(f"--set {item!r}: expected KEY.PATH=VALUE")
    key, raw = item.split("=", 1)
    path = tuple(p for p in key.strip().split("."))
    if not key.strip() or any(not p for p in path):
        raise ProfileError(f"--set {item!r}: empty key")
    try:
        value = read_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ProfileError(f"--set {key}: value {raw!r} is not YAML: {e}") from None
    return path, value


# --------------------------------------------------------------------------- editing in place
def flow(value) -> str:
    """`value` as one line of YAML (flow style)."""
    s = yaml.safe_dump(value, default_flow_style=True, width=1_000_000, sort_keys=False).strip()
    return s.removesuffix("\n...")


def _splice(text: str, start: int, end: int, new: str) -> str:
    if start > 0 and text[start - 1] == ":":  # `key:` with an empty value
        new = " " + new
    gap = len(text[end:]) - len(text[end:].lstrip(" "))
    if gap and text[end + gap : end + gap + 1] == "#":  # keep the line's comment in its column
        end_gap = max(1, gap - (len(new) - (end - start)))
        return text[:start] + new + " " * end_gap + text[end + gap :]
    return text[:start] + new + text[end:]


def _replace_node(text: str, key, node, value) -> str:
    """Write `value` over `node` (the value of mapping key `key`); a multi-line block collection
    becomes one flow line after its key (comments inside it go with it)."""
    if isinstance(node, yaml.ScalarNode) or node.flow_style:
        return _splice(text, node.start_mark.index, node.end_mark.index, flow(value))
    last = node.value[-1] if node.value else None
    last = last[1] if isinstance(last, tuple) else last
    end = last.end_mark.index if last is not None else node.end_mark.index
    if key is None:  # the document root: rewriting it whole is not an in-place edit
        raise ProfileError("the root of params.yaml is not a mapping")
    return text[: key.end_mark.index] + ": " + flow(value) + text[end:]


def edit(text: str, path: tuple, merged: dict) -> str:
    """`text` with the key at `path` set to its value in `merged` (one edit, comments elsewhere kept)."""
    node, key = yaml.compose(text, Loader=yaml.SafeLoader), None
    for i, k in enumerate(path):
        sub = path[: i + 1]
        if not isinstance(node, yaml.MappingNode) or node.flow_style:
            return _replace_node(text, key, node, get_path(merged, path[:i]))
        hit = next(((kn, vn) for kn, vn in node.value if isinstance(kn, yaml.ScalarNode) and kn.value == k), None)
        if hit is None:  # a key the section lacks: a new line before its first key, at its indentation
            first = node.value[0][0] if node.value else None
            if first is None:
                return _replace_node(text, key, node, get_path(merged, path[:i]))
            col = first.start_mark.column
            at = first.start_mark.index - col
            return text[:at] + " " * col + f"{flow(k)}: {flow(get_path(merged, sub))}\n" + text[at:]
        key, node = hit
        if i == len(path) - 1:
            return _replace_node(text, key, node, get_path(merged, sub))
    return text


def apply(text: str, overrides: list[tuple[tuple, object]]) -> tuple[str, dict, bool]:
    """(new params text, merged parameters, whether the comments were kept)."""
    base = read_yaml(text)
    if not isinstance(base, dict):
        raise ProfileError("params.yaml: the top level is not a mapping")
    merged = copy.deepcopy(base)
    for path, value in overrides:
        set_path(merged, path, value)
    new = text
    try:
        for path, _ in overrides:
            new = edit(new, path, merged)
        if read_yaml(new) == merged:
            return new, merged, True
    except (yaml.YAMLError, ProfileError, KeyError, TypeError, IndexError):
        pass
    return HEADER + yaml.safe_dump(merged, sort_keys=False, width=110), merged, False


# --------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", help="a YAML file of overrides (profiles/*.yaml)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="one override (repeatable; after the profile's)")
    ap.add_argument("--params", default="params.yaml", help="the params file to start from (default params.yaml)")
    ap.add_argument("--out", default=None, help="where to write (default: --params, in place)")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the result; write nothing")
    args = ap.parse_args(argv)
    src, out = Path(args.params), Path(args.out or args.params)
    try:
        overrides: list[tuple[tuple, object]] = []
        if args.profile:
            prof = read_yaml(Path(args.profile).read_text())
            if not isinstance(prof, dict):
                raise ProfileError(f"{args.profile}: a profile is a mapping of params.yaml sections")
            overrides += leaves(prof)
        overrides += [parse_set(s) for s in args.sets]
        if not overrides:
            raise ProfileError("nothing to apply: give a profile and/or --set KEY=VALUE")
        text, merged, kept = apply(src.read_text(), overrides)
    except (OSError, yaml.YAMLError, ProfileError) as e:
        print(f"apply_profile: {e}", file=sys.stderr)
        return 2
    # validate before writing: a temporary file beside the target, read by the pipeline's own loader
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".params-", suffix=".yaml", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_params(tmp)
        if args.dry_run:
            print(text, end="")
            return 0
        os.replace(tmp, out)
    except ParamsError as e:
        why = str(e).replace(tmp, f"{out} (as it would be written)")
        print(f"apply_profile: the result does not validate; {out} is unchanged.\n{why}", file=sys.stderr)
        return 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for path in dict.fromkeys(path for path, _ in overrides):
        print(f"  {'.'.join(path)} = {flow(get_path(merged, path))}")
    print(f"apply_profile: {len(overrides)} override(s) -> {out} (validated{'' if kept else '; comments not kept'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
