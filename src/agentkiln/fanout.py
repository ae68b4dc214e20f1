"""Fan-out on Ray (params `compute.ray`, docs/scale.md); single-process is the default.

    with fanout.session(params.compute.ray):   # a stage's work; disabled: nothing starts
        run_episodes(...)                       # environments live and step in `env_workers` actors
        RayExecutor().submit(fn, *args)         # a concurrent.futures Executor over Ray tasks

`session` starts a local Ray (`num_cpus`), or connects to the cluster at `address`; on exit it
stops a Ray it started (a cluster is only disconnected from). Inside an enabled session `active()`
is true and the engine, the synthesis workers and the ablation's arm x seed jobs use Ray; a
disabled session switches fan-out off for its block. Results are the same either way: the same
seeded code runs, only in other processes. `in_session` wraps a stage entry point `f(params, ...)`.

On a cluster every node needs this package (same version) and the repository's data at the same
path (a shared filesystem): tasks run in the submitter's working directory, TextWorld games and
synthesized files are read and written there.

`ray` is imported only on the Ray path: a disabled run never pays its import.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path

from agentkiln.envs import Observation, StepResult, TaskSpec, env_class, make

_session: dict | None = None  # the open enabled session: {"env_workers": n, "hosts": [actor handles]}
_AF_UNIX_MAX = 107  # bytes of a Unix socket path (Linux)
_RAY_SOCKET_SUFFIX = 72  # what Ray appends to its temporary directory: ray/session_<time>_<pid>/sockets/plasma_store


def active() -> bool:
    """True inside an enabled session (in the process that opened it; Ray workers run single-process)."""
    return _session is not None


@contextmanager
def session(ray_params) -> Iterator[None]:
    """Run the block with Ray fan-out when `ray_params.enabled` (a `config.RayParams`), else without.
    An enabled session inside another reuses it; Ray already initialised in this process (by a
    caller or a test) is used and left running. On exit the session stops a local Ray it started,
    or disconnects from the cluster at `address` (which keeps running)."""
    global _session
    outer = _session
    if not ray_params.enabled:
        _session = None
        try:
            yield
        finally:
            _session = outer
        return
    if outer is not None:
        yield
        return
    import ray

    started = not ray.is_initialized()
    if started:
        _init(ray, ray_params)
    _session = {"env_workers": ray_params.env_workers, "hosts": []}
    try:
        yield
    finally:
        hosts, _session = _session["hosts"], None
        if started:
            ray.shutdown()  # the actors go with it (a cluster's: they belong to this driver)
        else:
            for host in hosts:  # Ray is the caller's and stays up: only this session's actors go
                ray.kill(host)


def in_session(stage: Callable) -> Callable:
    """A stage entry point `stage(params, ...)` run inside `session(params.compute.ray)`."""

    @functools.wraps(stage)
    def run(params, *args, **kwargs):
        with session(params.compute.ray):
            return stage(params, *args, **kwargs)

    return run


def _init(ray, p) -> None:
    kwargs: dict = {"include_dashboard": False}
    if p.address:
        _check_reachable(p.address)
        kwargs["address"] = p.address
    else:  # "local": a new Ray even when RAY_ADDRESS is set (null means local in params)
        kwargs |= {"address": "local", "num_cpus": p.num_cpus}
        base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        if len(base) + _RAY_SOCKET_SUFFIX > _AF_UNIX_MAX:
            # a run's private TMPDIR (agentkiln.lifecycle) is too long for Ray's socket paths: Ray's
            # usual place instead (Linux keeps /tmp short)
            kwargs["_temp_dir"] = str(Path("/tmp") / "ray")
    # Ray sets its own SIGTERM handler in the main thread; the run's (lifecycle: clean stop, children
    # stopped) must stay, and the session's exit shuts Ray down anyway
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)} if main else {}
    try:
        ray.init(**kwargs)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as e:
        root = e
        while root.__cause__ is not None:  # Ray wraps the reason (e.g. a missing auth token) in a generic error
            root = root.__cause__
        reason = str(root).strip().splitlines()[-1] if str(root).strip() else type(root).__name__
        where = f"compute.ray.address = {p.address!r}" if p.address else "compute.ray (a local Ray)"
        hint = ("is a Ray cluster running there (`ray start --head`), and its token given (RAY_AUTH_MODE=token)? "
                "null starts a local Ray" if p.address else "set compute.ray.address to a cluster, or enabled: false")
        raise RuntimeError(f"{where}: Ray did not start ({type(e).__name__}: {e}; {reason}); {hint}") from e
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, naming the setting: Ray retries an unreachable GCS address for minutes."""
    hostport = address.split("://", 1)[-1]
    if address == "auto" or ":" not in hostport:
        return  # Ray resolves these itself (and fails at once when there is nothing)
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"compute.ray.address = {address!r}: cannot reach {host}:{port} ({e}); is a Ray "
                           "cluster running there (`ray start --head`)? null starts a local Ray") from None


# --------------------------------------------------------------------------- environments on actors
class EnvHost:
    """A Ray actor's body: hosts environments by key, steps a batch of them per call."""

    def __init__(self):
        self.envs: dict = {}

    def open(self, items: list[tuple]) -> list[tuple[Observation, str, int]]:
        """(key, task, tasks_dir, max_turns) each -> (first observation, goal, max_turns) each."""
        out = []
        for key, task, tasks_dir, max_turns in items:
            env = self.envs[key] = make(task, tasks_dir, max_turns=max_turns)
            obs = env.reset()
            out.append((obs, env.goal, env.max_turns))
        return out

    def step(self, actions: list[tuple], close: list) -> list[StepResult]:
        """Step each (key, action); an environment whose episode ended is closed, so are `close`'s."""
        out = []
        for key, action in actions:
            res = self.envs[key].step(action)
            if res.done:
                self.envs.pop(key).close()
            out.append(res)
        for key in close:
            self.envs.pop(key).close()
        return out

    def expert_action(self, key) -> str | None:
        return self.envs[key].expert_action()

    def expert_distance(self, key) -> int | None:
        return self.envs[key].expert_distance()

    def close_group(self, group: int) -> None:
        for key in [k for k in self.envs if k[0] == group]:
            self.envs.pop(key).close()


class RemoteEnv:
    """What an agent sees of an environment on an actor: its family's class attributes (reply budget,
    tools) and, for the oracle baseline and rollout guidance, the expert's next action and its distance
    to a win (one remote call each)."""

    def __init__(self, host, key, task: TaskSpec, goal: str, max_turns: int):
        cls = env_class(task.family)
        self.family, self.free_form, self.tools = cls.family, cls.free_form, cls.tools
        self.max_reply_tokens, self.tool_specs = cls.max_reply_tokens, cls.tool_specs
        self.task, self.goal, self.max_turns = task, goal, max_turns
        self._host, self._key = host, key

    def expert_action(self) -> str | None:
        import ray

        return ray.get(self._host.expert_action.remote(self._key))

    def expert_distance(self) -> int | None:
        import ray

        return ray.get(self._host.expert_distance.remote(self._key))


_groups = itertools.count()


class RemoteEnvs:
    """The environments of one chunk of episodes spread over the session's actors (episode i on actor
    i mod n); each `step` makes one remote call per actor with work and gathers the results in order."""

    def __init__(self, tasks: list[TaskSpec], tasks_dir, max_turns: int | None):
        import ray

        self.hosts = _hosts()
        self.group = next(_groups)  # keys (group, i): chunks never mix on a host
        tasks_dir = None if tasks_dir is None else str(Path(tasks_dir).resolve())  # a worker's cwd may differ
        self.host_of = [i % len(self.hosts) for i in range(len(tasks))]
        per_host = [[i for i in range(len(tasks)) if self.host_of[i] == h] for h in range(len(self.hosts))]
        refs = {h: self.hosts[h].open.remote([((self.group, i), tasks[i], tasks_dir, max_turns) for i in idx])
                for h, idx in enumerate(per_host) if idx}
        firsts = {}
        for h, results in zip(refs, ray.get(list(refs.values()))):
            firsts.update(zip(per_host[h], results))
        self.first = [firsts[i] for i in range(len(tasks))]
        self.views = [RemoteEnv(self.hosts[self.host_of[i]], (self.group, i), task, goal, turns)
                      for i, (task, (_, goal, turns)) in enumerate(zip(tasks, self.first))]

    def step(self, actions: dict[int, str], close: list[int]) -> dict[int, StepResult]:
        """Step episode i with actions[i] (in parallel across actors); close `close`'s environments."""
        import ray

        work: dict[int, tuple[list, list]] = {}
        for i, action in actions.items():
            work.setdefault(self.host_of[i], ([], []))[0].append((i, action))
        for i in close:
            work.setdefault(self.host_of[i], ([], []))[1].append((self.group, i))
        refs = [self.hosts[h].step.remote([((self.group, i), a) for i, a in acts], shut)
                for h, (acts, shut) in work.items()]
        out = {}
        for (acts, _), results in zip(work.values(), ray.get(refs)):
            out.update(zip((i for i, _ in acts), results))
        return {i: out[i] for i in actions}

    def close(self) -> None:
        """Drop whatever of this chunk is still open (an error mid-chunk)."""
        import ray

        ray.get([h.close_group.remote(self.group) for h in self.hosts])


def _hosts() -> list:
    """The session's environment actors, started on first use and kept until the session ends."""
    if not _session["hosts"]:
        import ray

        # default actor resources (1 CPU to place, 0 held while alive): idle hosts never block the
        # session's tasks (the ablation's jobs); SPREAD puts them on different nodes of a cluster
        actor = ray.remote(EnvHost).options(scheduling_strategy="SPREAD")
        _session["hosts"] = [actor.remote() for _ in range(_session["env_workers"])]
    return _session["hosts"]


# --------------------------------------------------------------------------- tasks: an Executor over Ray
def _call(cwd: str, fn: Callable, args: tuple, kwargs: dict):
    """Run `fn` in the submitter's working directory (stages use paths relative to the repository root)."""
    here = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError as e:
        raise RuntimeError(f"compute.ray: this Ray worker has no directory {cwd}: on a cluster the repository "
                           "must be at the same path on every node (a shared filesystem)") from e
    try:
        return fn(*args, **kwargs)
    finally:
        os.chdir(here)


class RayExecutor(Executor):
    """`concurrent.futures.Executor` whose `submit(fn, *args)` runs a Ray task of one CPU: code written
    for a process pool (futures, `as_completed`, `shutdown(cancel_futures=True)`) runs on Ray unchanged.
    `env_vars` are set in the task's worker process before it starts (e.g. PYTHONHASHSEED)."""

    def __init__(self, env_vars: dict[str, str] | None = None):
        import ray

        opts: dict = {"num_cpus": 1}
        if env_vars:
            opts["runtime_env"] = {"env_vars": dict(env_vars)}
        self._remote = ray.remote(_call).options(**opts)
        self._refs: list = []

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        ref = self._remote.remote(os.getcwd(), fn, args, kwargs)
        self._refs.append(ref)
        return ref.future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        import ray

        if cancel_futures:
            ready = set(ray.wait(self._refs, num_returns=len(self._refs), timeout=0)[0]) if self._refs else set()
            for ref in self._refs:
                if ref not in ready:
                    ray.cancel(ref)
        elif wait and self._refs:
            ray.wait(self._refs, num_returns=len(self._refs))
        self._refs = []
