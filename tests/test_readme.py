"""README.md is the product page: short, undated, its two commands first, every command in its code
blocks present and answering `--help`, every relative link resolving from a fresh clone."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
FIRST_COMMANDS = ["bash scripts/run_pipeline.sh", "bash scripts/test.sh"]


def code_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands(text: str) -> list[tuple[str, ...]]:
    """Every `agentkiln <sub...>`, `python -m flows.X`, `python scripts/X.py` and `bash scripts/X.sh` of
    the code blocks, as the argv that asks it for --help (in order, once each)."""
    found: list[tuple[str, ...]] = []
    for block in code_blocks(text):
        for line in block:
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, w in enumerate(words):
                rest = words[i + 1:]
                if w == "agentkiln":
                    sub = []
                    for r in rest:
                        if not re.fullmatch(r"[a-z][a-z-]*", r):
                            break
                        sub.append(r)
                    cmd = ("agentkiln", *sub)
                elif w == "python" and rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("flows."):
                    cmd = ("python", "-m", rest[1])
                elif w == "python" and rest and re.fullmatch(r"scripts/[\w-]+\.py", rest[0]):
                    cmd = ("python", rest[0])
                elif w == "bash" and rest and re.fullmatch(r"scripts/[\w-]+\.sh", rest[0]):
                    cmd = ("bash", rest[0])
                else:
                    continue
                if cmd not in found:
                    found.append(cmd)
    return found


COMMANDS = commands(TEXT)


def test_the_two_commands_come_first():
    first = [line.split("#")[0].strip() for line in code_blocks(TEXT)[0]]
    assert first == FIRST_COMMANDS
    assert TEXT.index("```") < TEXT.index("\n## "), "the two commands come before the first section"


def test_it_is_short_and_undated():
    lines = TEXT.splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines (at most 220): move reference material to docs/"
    sessions = [line for line in lines if re.search(r"\bsessions?\b", line, re.IGNORECASE)]
    assert not sessions, sessions
    # a commit hash: 7-40 hex characters with letters and digits (dated results belong in docs/runs.md)
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", TEXT)
    assert not hashes, hashes


def test_the_code_blocks_name_commands():
    kinds = {c[0] for c in COMMANDS}
    assert {"agentkiln", "bash"} <= kinds, COMMANDS
    assert ("bash", "scripts/run_pipeline.sh") in COMMANDS and ("bash", "scripts/test.sh") in COMMANDS
    profiles = re.findall(r"--profile[ =]([\w.-]+)", "\n".join("\n".join(b) for b in code_blocks(TEXT)))
    assert profiles and all((ROOT / "profiles" / f"{p}.yaml").is_file() for p in profiles), profiles


def argv(cmd: tuple[str, ...]) -> list[str]:
    if cmd[0] == "agentkiln":
        script = Path(sys.executable).parent / "agentkiln"
        base = [str(script)] if script.exists() else [sys.executable, "-c", "from agentkiln.cli import main; main()"]
        return [*base, *cmd[1:], "--help"]
    if cmd[0] == "python":
        return [sys.executable, *cmd[1:], "--help"]
    return [*cmd, "--help"]


@pytest.mark.parametrize("cmd", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_every_command_exists_and_answers_help(cmd):
    if cmd[0] in ("bash", "python") and cmd[1] != "-m":
        assert (ROOT / cmd[1]).is_file(), f"README.md runs {cmd[1]}, which does not exist"
    if cmd[:2] == ("python", "-m"):
        assert (ROOT / (cmd[2].replace(".", "/") + ".py")).is_file(), f"no module {cmd[2]}"
    res = subprocess.run(argv(cmd), cwd=ROOT, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, (cmd, res.stdout[-1000:], res.stderr[-2000:])
    assert res.stdout.strip(), f"{' '.join(cmd)} --help printed nothing"


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", TEXT)
    relative = [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert relative, "README.md links no docs"
    broken = []
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        if not target.exists() or ROOT not in target.parents:
            broken.append(link)
        elif anchor and target.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)}
            if anchor not in headings:
                broken.append(link)
    assert not broken, f"links in README.md that do not resolve: {broken}"
    for anchor in re.findall(r"\]\(#([^)]+)\)", TEXT):
        assert anchor in {slug(h) for h in re.findall(r"^#+ (.+)$", TEXT, re.MULTILINE)}, anchor
