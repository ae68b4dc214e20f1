"""The MLflow UI on the project's store: start a real `mlflow server` on loopback, and take
headless-Chromium screenshots of the registered model's pages.

    python -m agentkiln.registry.ui --out reports/registry.png

starts the server on the repository's SQLite store (or --backend-store-uri), saves the model page
(versions and aliases) to --out and the champion version's page (its lineage tags) next to it,
prints both URLs, and stops the server. The UI is a single-page app with a hash router: the model
page is `<base>/#/models/<name>`, a version's page `<base>/#/models/<name>/versions/<v>`.

Importing this module does not import mlflow: the server runs in its own process group, started
with this interpreter (`python -m mlflow server`); only the command's defaults read
agentkiln.tracking.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agentkiln.servers import ManagedServer, free_port

MODEL_NAME = "agentkiln-policy"
CHROMIUM_ENV = "AGENTKILN_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "chromium not installed: apt-get install chromium (or set AGENTKILN_CHROMIUM to a Chromium/Chrome binary)"
# Virtual time Chromium gives the page before the screenshot: the React UI fetches the model
# over the REST API, then renders. Pending network requests pause virtual time.
VIRTUAL_TIME_MS = 15000


class ChromiumNotFound(RuntimeError):
    pass


# --------------------------------------------------------------------------- server
def absolute_sqlite_uri(uri: str) -> str:
    """`sqlite:///rel/path.db` made absolute against the current directory (the server runs
    elsewhere); other URIs unchanged."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/") and ":memory:" not in uri:
        path, sep, query = uri[len(prefix):].partition("?")
        return prefix + str(Path(path).resolve()) + sep + query
    return uri


class MlflowServer(ManagedServer):
    """`mlflow server` on `backend_store_uri` (tracking and registry), serving artifacts from
    `artifacts_dir`, on `host`:`port` (a free port when None), one worker, started at construction
    (agentkiln.servers.ManagedServer: its own process group, `stop()` ends uvicorn and any workers).
    `wait()` blocks until `GET /health` answers and returns the base URL.

    The default security middleware lets loopback hosts and origins through, so nothing is
    disabled."""

    def __init__(self, backend_store_uri: str, artifacts_dir: str | Path, host: str = "127.0.0.1", port: int | None = None):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        artifacts_dir = Path(artifacts_dir).resolve()
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", absolute_sqlite_uri(backend_store_uri),
            "--artifacts-destination", str(artifacts_dir),
            "--host", host,
            "--port", str(self.port),
            "--workers", "1",
            "--app-name", "agentkiln",  # MLflow's app, its root URL in the model-training view (registry.mlflow_app)
        ]
        env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1")
        # cwd = the artifacts dir's parent: whatever the server writes relative to its working
        # directory stays next to the store, not wherever we were called from
        super().__init__("mlflow server", cmd, f"{self.url}/health", env=env, cwd=artifacts_dir.parent)

    def wait(self, timeout: float = 180.0) -> str:
        super().wait(timeout)
        return self.url


@contextmanager
def start_server(
    backend_store_uri: str,
    artifacts_dir: str | Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout: float = 180.0,
) -> Iterator[str]:
    """Run `mlflow server` (see MlflowServer) for the block: yields its base URL once `GET /health`
    answers, stops it and its children on exit. Raises ServerError (with the tail of the server's
    log) if it exits or does not answer within `timeout` seconds."""
    server = MlflowServer(backend_store_uri, artifacts_dir, host, port)
    try:
        yield server.wait(timeout)
    finally:
        server.stop()


def model_url(base: str, name: str = MODEL_NAME, version: str | int | None = None) -> str:
    """The UI page of a registered model (`version` None) or of one of its versions."""
    page = f"{base.rstrip('/')}/#/models/{urllib.parse.quote(name, safe='')}"
    return page if version is None else f"{page}/versions/{urllib.parse.quote(str(version), safe='')}"


def api_get(base: str, endpoint: str, **params) -> dict:
    """GET `<base>/api/2.0/mlflow/<endpoint>?params` -> the JSON body (HTTPError on 4xx/5xx)."""
    query = urllib.parse.urlencode(params)
    url = f"{base.rstrip('/')}/api/2.0/mlflow/{endpoint}" + (f"?{query}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


# --------------------------------------------------------------------------- browser
def find_chromium() -> str:
    """$AGENTKILN_CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        path = shutil.which(override)
        if path is None:
            raise ChromiumNotFound(f"{CHROMIUM_ENV}={override!r} is not an executable")
        return path
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise ChromiumNotFound(INSTALL_HINT)


# A content script loaded into the headless browser for the screenshots: it marks MLflow's
# assistant side panel as already auto-opened once (else it opens on a first visit and takes a
# third of the page), and lets tag tables grow instead of scrolling inside 280 px (the version
# page would show 5 tags out of 20). The rest of the UI is untouched.
_EXTENSION = {
    "manifest.json": json.dumps(
        {
            "manifest_version": 3,
            "name": "agentkiln mlflow screenshots",
            "version": "1.0",
            "content_scripts": [
                {
                    "matches": ["http://*/*", "https://*/*"],
                    "css": ["page.css"],
                    "js": ["page.js"],
                    "run_at": "document_start",
                }
            ],
        }
    ),
    "page.js": 'try { localStorage.setItem("mlflow.assistant.fab.autoOpenedOnFirstLoad_v1", "true"); } catch (e) {}\n',
    "page.css": ".du-bois-light-table-body { max-height: none !important; overflow-y: visible !important; }\n",
}


def _chromium(args: list[str], width: int, height: int, virtual_time_ms: int, timeout: float):
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="agentkiln-chromium-") as tmp:
        extension = Path(tmp) / "extension"
        extension.mkdir()
        for name, text in _EXTENSION.items():
            (extension / name).write_text(text)
        cmd = [
            binary,
            "--headless=new",
            "--disable-gpu",
            "--no-sandbox",  # root in containers has no usable sandbox
            "--disable-dev-shm-usage",  # small /dev/shm in containers
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-sync",
            "--mute-audio",
            f"--user-data-dir={Path(tmp) / 'profile'}",
            f"--load-extension={extension}",
            # Branded Chrome >= 137 ignores --load-extension unless this feature is off.
            "--disable-features=DisableLoadExtensionCommandLineSwitch",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={virtual_time_ms}",
            *args,
        ]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{binary} did not finish within {timeout:.0f}s: {' '.join(cmd)}") from e


def render(
    url: str,
    out_png: str | Path | None = None,
    width: int = 1400,
    height: int = 1000,
    virtual_time_ms: int = VIRTUAL_TIME_MS,
    timeout: float = 180.0,
) -> str:
    """Load `url` in headless Chromium for `virtual_time_ms` of virtual time (the React UI fetches
    over the REST API, then renders), save a `width`x`height` screenshot to `out_png` (if given),
    and return the rendered DOM as HTML. One browser run for both."""
    find_chromium()  # fail before touching the file system
    args = ["--dump-dom"]
    out = None
    if out_png is not None:
        out = Path(out_png).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        args.append(f"--screenshot={out}")
    res = _chromium([*args, url], width, height, virtual_time_ms, timeout)
    if res.returncode != 0 or (out is not None and not out.is_file()):
        raise RuntimeError(
            f"chromium exited with code {res.returncode}" + (f" without writing {out}" if out else "") + ":\n"
            + res.stderr.decode(errors="replace")[-3000:]
        )
    return res.stdout.decode(errors="replace")


def screenshot(
    url: str,
    out_png: str | Path,
    width: int = 1400,
    height: int = 1000,
    virtual_time_ms: int = VIRTUAL_TIME_MS,
    timeout: float = 180.0,
) -> Path:
    """Headless Chromium's `width`x`height` screenshot of `url` once the UI has rendered, saved to
    `out_png`; returns its path."""
    render(url, out_png, width, height, virtual_time_ms, timeout)
    return Path(out_png).resolve()


def dump_dom(url: str, virtual_time_ms: int = VIRTUAL_TIME_MS, timeout: float = 180.0) -> str:
    """The page's DOM as HTML once the UI has rendered."""
    return render(url, None, virtual_time_ms=virtual_time_ms, timeout=timeout)


# --------------------------------------------------------------------------- command
def _default_store() -> tuple[str, Path]:
    from agentkiln import tracking  # imports mlflow: only for the command's defaults

    return tracking.tracking_uri(), tracking.store_dir() / "mlartifacts"


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    return None


def _pick_version(base: str, name: str, version: str | None) -> tuple[str, str]:
    """(version, why): `version` if given, else the champion, else the newest version."""
    if version:
        return str(version), "requested"
    try:
        mv = api_get(base, "registered-models/alias", name=name, alias="champion")["model_version"]
        return str(mv["version"]), "champion"
    except urllib.error.HTTPError:
        pass
    found = api_get(base, "model-versions/search", filter=f"name='{name}'").get("model_versions", [])
    if not found:
        raise SystemExit(f"registered model {name!r} has no versions")
    return str(max(int(v["version"]) for v in found)), "latest"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m agentkiln.registry.ui",
        description="Start the MLflow UI on the store and screenshot the registered model's pages.",
    )
    p.add_argument("--backend-store-uri", help="default: the repository's sqlite:///<repo>/mlflow.db (or $MLFLOW_TRACKING_URI)")
    p.add_argument("--artifacts-dir", help="default: <repo>/mlartifacts")
    p.add_argument("--model", default=MODEL_NAME)
    p.add_argument("--version", help="version page to capture (default: the champion, else the latest)")
    p.add_argument("--out", default="reports/registry.png", help="model page PNG; the version page goes next to it (<stem>_v<N>.png)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1000, help="model page height; the version page grows with its tags")
    p.add_argument("--virtual-time-ms", type=int, default=VIRTUAL_TIME_MS)
    p.add_argument("--keep-running", action="store_true", help="leave the server up after the screenshots (Ctrl-C stops it)")
    args = p.parse_args(argv)

    uri, artifacts = args.backend_store_uri, args.artifacts_dir
    if uri is None or artifacts is None:
        default_uri, default_artifacts = _default_store()
        uri = uri or default_uri
        artifacts = artifacts or default_artifacts
    uri = absolute_sqlite_uri(uri)
    db = _sqlite_path(uri)
    if db is not None and not db.is_file():
        # mlflow server would silently create an empty store: say what is wrong instead.
        print(f"{db}: no such MLflow store (run the pipeline first, or pass --backend-store-uri)", file=sys.stderr)
        return 2
    try:
        find_chromium()
        no_browser = None
    except ChromiumNotFound as e:
        no_browser = str(e)

    out = Path(args.out)
    with start_server(uri, artifacts, port=args.port) as base:
        try:
            model = api_get(base, "registered-models/get", name=args.model)["registered_model"]
        except urllib.error.HTTPError as e:
            print(f"registered model {args.model!r} not found in {uri} (HTTP {e.code}): run the pipeline first", file=sys.stderr)
            return 2
        aliases = {a["alias"]: a["version"] for a in model.get("aliases", [])}
        version, why = _pick_version(base, args.model, args.version)
        mv = api_get(base, "model-versions/get", name=args.model, version=version)["model_version"]
        n_tags = len(mv.get("tags", []))
        # Fit the tags: the version page lists one tag per ~60 px row below ~450 px of header; the
        # model page one per ~22 px line in each version's row (25 versions a page).
        version_height = min(max(args.height, 500 + 64 * n_tags), 8000)
        listed = api_get(base, "model-versions/search", filter=f"name='{args.model}'", max_results=25)
        lines = sum(max(1, len(v.get("tags", []))) * 22 + 20 for v in listed.get("model_versions", []))
        model_height = min(max(args.height, 520 + lines), 8000)
        pages = [
            (model_url(base, args.model), out, model_height),
            (model_url(base, args.model, version), out.with_name(f"{out.stem}_v{version}{out.suffix or '.png'}"), version_height),
        ]
        print(f"server: {base}  (store {uri})")
        print(f"model {args.model}: aliases {json.dumps(aliases, sort_keys=True)}; version page: v{version} ({why}, {n_tags} tags)")
        for url, _, _ in pages:
            print(f"  {url}")
        if no_browser:
            print(f"no screenshots: {no_browser}", file=sys.stderr)
            if not args.keep_running:
                return 3
        else:
            for url, png, height in pages:
                print(f"  saved {screenshot(url, png, args.width, height, args.virtual_time_ms)}")
        if args.keep_running:
            print(f"MLflow UI at {model_url(base, args.model)} (Ctrl-C stops it)", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
