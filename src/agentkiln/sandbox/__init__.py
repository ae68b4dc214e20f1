"""Run model-written code in a contained process: `run_python(code, limits) -> SandboxResult`.

    res = run_python("print(sum(range(10)))")          # SandboxResult(ok=True, stdout="45\\n", ...)
    res = run_python("while True: pass")               # ok=False, status="cpu", error="CPU time limit 1 s exceeded"

Three rooms: `server` (the program that runs inside the isolation, standard library only),
`isolation` (bubblewrap / unshare command lines and the filesystem view) and `client` (the trainer's
side: `Sandbox`, `Limits`, `SandboxResult`). docs/sandbox.md says what is and is not guaranteed.
"""

from agentkiln.sandbox import server
from agentkiln.sandbox.client import Limits, Sandbox, SandboxResult, default_sandbox, run_python
from agentkiln.sandbox.isolation import ISOLATION_ENV, ISOLATIONS, SANDBOX_UID, bwrap_prefix

__all__ = ["ISOLATIONS", "ISOLATION_ENV", "SANDBOX_UID", "Limits", "Sandbox", "SandboxResult", "bwrap_prefix",
           "default_sandbox", "run_python", "server"]
