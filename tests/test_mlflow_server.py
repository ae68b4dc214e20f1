"""The registered model as the MLflow UI serves it: a real `mlflow server` on loopback over a
SQLite store holding two versions of a tiny policy (lineage tags, champion/previous/challenger
aliases). The REST API must return what was registered; with Chromium installed, the UI's model
page must render it (DOM) and a screenshot of it is saved.

AGENTKILN_SAVE_SCREENSHOT=1 also copies the screenshot to the repository's
reports/mlflow_registry.png (otherwise nothing is written outside the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import mlflow
import pytest
import requests

from agentkiln import tracking
from agentkiln.registry import lineage
from agentkiln.registry import model_registry as mr
from agentkiln.registry import ui
from tests.test_tracking_registry import _isolated_mlflow_env, _tiny_policy

pytestmark = pytest.mark.e2e

NAME = ui.MODEL_NAME  # "agentkiln-policy"
REPO = Path(__file__).resolve().parents[1]
API = "/api/2.0/mlflow"


def _lineage_root(root: Path) -> Path:
    """A git repository with params.yaml and dvc.lock, as lineage_tags reads them."""
    root.mkdir()
    (root / "params.yaml").write_text("seed: 0\n")
    (root / "dvc.lock").write_text(
        "schema: '2.0'\n"
        "stages:\n"
        "  synthesize:\n"
        "    cmd: python -m flows.synthesize\n"
        "    outs:\n"
        "    - path: data/tasks\n      hash: md5\n      md5: 0123456789abcdef0123456789abcdef.dir\n"
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=root, check=True)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two registered versions (v1 promoted, then v2) and `mlflow server` on that store. The
    server starts as soon as the store's tables exist: its start-up overlaps the registration."""
    tmp = tmp_path_factory.mktemp("mlflow_server")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    root = _lineage_root(tmp / "repo")
    registered = {
        "1": lineage.lineage_tags(root, {"candidate": "sft", "stage": "sft", "eval.panel": "panel-0a1b", "eval.success": "0.5000"}),
        "2": lineage.lineage_tags(root, {"candidate": "rl", "stage": "rl", "eval.panel": "panel-0a1b", "eval.success": "0.7500"}),
    }
    assert {"lineage.git_commit", "lineage.params_hash", "lineage.data.data/tasks"} <= set(registered["2"])
    assert registered["2"]["lineage.git_commit"] not in ("", "unknown")
    metrics = {"1": 0.5, "2": 0.75}
    proc = None
    try:
        with _isolated_mlflow_env(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", uri)
            os.environ.pop("MLFLOW_REGISTRY_URI", None)
            os.environ.pop(tracking.PARENT_ENV, None)
            mp.chdir(tmp)
            tracking._setup_state = None
            tracking.setup()  # creates the store's tables
            proc = ui.MlflowServer(uri, tmp / "mlartifacts")
            for v, seed in (("1", 0), ("2", 1)):
                policy = _tiny_policy(tmp / f"m{v}", seed)
                assert mr.register_candidate(policy, NAME, registered[v], {"success": metrics[v]}) == v
                registered[v]["metric.success"] = f"{metrics[v]:.6g}"
                mr.promote(NAME, v)
            assert mr.aliases(NAME) == {"champion": "2", "previous": "1", "challenger": "2"}
            client = mlflow.MlflowClient()
            stored = {v: dict(client.get_model_version(NAME, v).tags) for v in registered}
        base = proc.wait()
        yield {"base": base, "tmp": tmp, "registered": registered, "stored": stored}
    finally:
        if proc is not None:
            proc.stop()


def _get(base: str, endpoint: str, **params) -> dict:
    r = requests.get(f"{base}{API}/{endpoint}", params=params, timeout=30)
    assert r.status_code == 200, (endpoint, r.status_code, r.text[:500])
    return r.json()


def _tags(mv: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in mv.get("tags", [])}


def test_rest_api_serves_aliases_and_lineage_tags(server):
    base, registered, stored = server["base"], server["registered"], server["stored"]
    assert base.startswith("http://127.0.0.1:")
    assert requests.get(f"{base}/health", timeout=10).text.strip() == "OK"

    model = _get(base, "registered-models/get", name=NAME)["registered_model"]
    assert {a["alias"]: a["version"] for a in model["aliases"]} == {"champion": "2", "previous": "1", "challenger": "2"}
    assert "agentkiln" in model["description"]

    # MLflow 3's "get model version by alias" is GET registered-models/alias.
    for alias, version in (("champion", "2"), ("previous", "1"), ("challenger", "2")):
        mv = _get(base, "registered-models/alias", name=NAME, alias=alias)["model_version"]
        assert mv["version"] == version, alias
        # What the store holds (promote() may add tags of its own), with every registered tag.
        assert _tags(mv) == stored[version], alias
        assert registered[version].items() <= _tags(mv).items(), alias
        assert alias in mv["aliases"]
    champion = _get(base, "registered-models/alias", name=NAME, alias="champion")["model_version"]
    assert _tags(champion)["lineage.data.data/tasks"] == "0123456789abcdef0123456789abcdef.dir"
    assert _tags(champion)["eval.success"] == "0.7500" and _tags(champion)["eval.panel"] == "panel-0a1b"

    found = _get(base, "model-versions/search", filter=f"name='{NAME}'")["model_versions"]
    assert sorted(mv["version"] for mv in found) == ["1", "2"]
    for mv in found:
        assert mv["status"] == "READY"
        assert _tags(mv) == stored[mv["version"]]
        assert registered[mv["version"]].items() <= _tags(mv).items()
        # Lineage to the run that logged the model: the run exists on the same server.
        run = _get(base, "runs/get", run_id=mv["run_id"])["run"]
        assert run["info"]["run_id"] == mv["run_id"]

    missing = requests.get(f"{base}{API}/registered-models/get", params={"name": "no-such-model"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"


def test_ui_model_page_renders_and_screenshot(server):
    try:
        ui.find_chromium()
    except ui.ChromiumNotFound:
        pytest.skip("chromium not installed: apt-get install chromium")
    from PIL import Image, ImageStat

    base, registered = server["base"], server["registered"]
    url = ui.model_url(base, NAME)
    assert url == f"{base}/#/models/{NAME}"
    png = server["tmp"] / "reports" / "registry_model.png"

    # One browser run: the screenshot, and the DOM the React app rendered after fetching the
    # model (name, versions, aliases, lineage tags).
    dom = ui.render(url, png).replace("&nbsp;", " ")
    for text in (NAME, "Version 1", "Version 2", "@ champion", "@ previous", "@ challenger",
                 "lineage.git_commit", registered["2"]["lineage.git_commit"], "lineage.data.data/tasks",
                 "eval.panel", "eval.success"):
        assert text in dom, text

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        assert im.size == (1400, 1000)
        gray = im.convert("L")
        # Measured: a blank page is one flat colour (6 KB, stddev 0, 1 colour); the rendered
        # model page has text, tables and a tinted sidebar (~165 KB, stddev ~26, ~3000 colours).
        assert ImageStat.Stat(gray).stddev[0] > 10
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 100
    assert png.stat().st_size > 50_000

    if os.environ.get("AGENTKILN_SAVE_SCREENSHOT"):
        dst = REPO / "reports" / "mlflow_registry.png"
        dst.parent.mkdir(exist_ok=True)
        shutil.copyfile(png, dst)


def test_chromium_override_and_model_urls(monkeypatch):
    monkeypatch.setenv(ui.CHROMIUM_ENV, "/nonexistent/chromium")
    with pytest.raises(ui.ChromiumNotFound, match="AGENTKILN_CHROMIUM"):
        ui.find_chromium()
    monkeypatch.delenv(ui.CHROMIUM_ENV)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ui.ChromiumNotFound, match="apt-get install chromium"):
        ui.screenshot("http://127.0.0.1:1/", Path("/nonexistent/x.png"))
    assert ui.model_url("http://h:1/", "a b", 3) == "http://h:1/#/models/a%20b/versions/3"


def test_root_url_and_experiment_links_open_model_training(server):
    """The server agentkiln starts (registry.mlflow_app): its root URL, and a link into the UI, load MLflow
    in its model-training view (MLflow 3's default is GenAI: traces and evaluations, empty here), the
    link's own route kept."""
    import urllib.request

    base = server["base"]
    landing = urllib.request.urlopen(base + "/", timeout=30).read().decode()
    assert "workflowType=machine_learning" in landing and "location.replace" in landing
    ui_page = urllib.request.urlopen(base + "/?view=training", timeout=30).read().decode()
    assert "<div id=\"root\"" in ui_page or "static-files" in ui_page  # MLflow's own index.html
    assert urllib.request.urlopen(base + "/health", timeout=30).read() == b"OK"  # the rest is MLflow's
    try:
        ui.find_chromium()
    except ui.ChromiumNotFound:
        pytest.skip("chromium not installed: apt-get install chromium")
    for url, page in ((base + "/", "Experiments"), (f"{base}/#/models/{NAME}", "Version 2")):  # the link's own page
        dom = ui.dump_dom(url).replace("&nbsp;", " ")
        assert "Model registry" in dom and "MCP registry" not in dom, url  # the training sidebar, not GenAI's
        assert page in dom, url
