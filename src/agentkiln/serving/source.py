"""Which policy the endpoint serves: a policy directory, a registered version, or a registry alias
that it follows. Pointed at `models:/<name>@<alias>`, it asks the registry every `poll` seconds which
version the alias names; when that changes (a promotion, a rollback) the new version is downloaded and
loaded beside the old one, and swapped in between two decoding batches: no restart, no request
answered by half of each."""

from __future__ import annotations

import threading
from pathlib import Path

from agentkiln.policy.model import Policy, load_policy
from agentkiln.registry.model_registry import model_digest


class ModelSource:
    def __init__(self, spec: str, poll: float = 10.0, log=print):
        self.spec, self.poll, self.log = spec, poll, log
        self.name, self.alias, self.fixed = None, None, None
        if spec.startswith("models:/"):
            rest = spec[len("models:/"):]
            if "@" in rest:
                self.name, self.alias = rest.split("@", 1)
            else:
                self.name, _, self.fixed = rest.rpartition("/")
            if not self.name or not (self.alias or self.fixed):
                raise ValueError(f"--model {spec}: expected models:/<name>@<alias> or models:/<name>/<version>")
            from agentkiln import tracking  # noqa: PLC0415  (only a registry URI needs the store)

            tracking.setup()
        elif not (Path(spec) / "config.json").is_file():
            raise FileNotFoundError(f"--model {spec}: not a policy directory (no config.json) nor a registry URI "
                                    "models:/<name>@<alias> or models:/<name>/<version>")
        self.version = self._version()
        self.policy = self._load(self.version)
        self._pending: tuple[str, Policy] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def served_name(self) -> str:
        return self.name or Path(self.spec).resolve().name

    def _version(self) -> str:
        if self.alias:
            from agentkiln.registry.model_registry import aliases  # noqa: PLC0415

            found = aliases(self.name).get(self.alias)
            if found is None:
                raise FileNotFoundError(f"--model {self.spec}: {self.name} has no alias {self.alias!r}; "
                                        "`agentkiln registry show` lists its versions and aliases")
            return found
        if self.fixed:
            return self.fixed
        return "local-" + model_digest(Path(self.spec))[:12]

    def _load(self, version: str) -> Policy:
        if self.name is None:
            return load_policy(self.spec)
        from agentkiln.registry.model_registry import downloaded_policy  # noqa: PLC0415

        uri = f"models:/{self.name}/{version}"
        with downloaded_policy(uri) as path:
            policy = load_policy(path)
        policy.source = uri
        return policy

    def check(self) -> bool:
        """Load the alias's version if it moved (True when a new one is waiting to be swapped in)."""
        if not self.alias:
            return False
        version = self._version()
        with self._lock:
            current = self._pending[0] if self._pending else self.version
        if version == current:
            return False
        policy = self._load(version)
        with self._lock:
            self._pending = (version, policy)
        self.log(f"{self.spec} now names version {version}: serving it from the next batch")
        return True

    def current(self) -> tuple[str, Policy]:
        """The version and policy to decode the next batch with (a waiting new version swapped in)."""
        with self._lock:
            if self._pending is not None:
                self.version, self.policy = self._pending
                self._pending = None
            return self.version, self.policy

    def follow(self) -> threading.Thread | None:
        """Poll the alias in the background until `stop()`."""
        if not self.alias:
            return None

        def loop():
            while not self._stop.wait(self.poll):
                try:
                    self.check()
                except Exception as e:  # noqa: BLE001  (a registry hiccup must not stop serving the current version)
                    self.log(f"checking {self.spec} failed ({e}); still serving version {self.version}")

        t = threading.Thread(target=loop, name="follow-alias", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
