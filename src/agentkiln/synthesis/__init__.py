"""Task synthesis: procedurally generated, verified, versioned task sets of every family.

`generate(family, n, seed, level=..., **knobs)` makes tasks of one family (synthesis/generate.py);
`synthesize(params, out_dir)` is the pipeline stage: a mixture of task types into splits
(synthesis/stage.py). Each family's generator lives in its own module here.
"""

from agentkiln.synthesis.generate import GENERATORS, env_version, generate, resolve
from agentkiln.synthesis.stage import synthesize

__all__ = ["GENERATORS", "env_version", "generate", "resolve", "synthesize"]
