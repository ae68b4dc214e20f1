"""The MLflow server `agentkiln ui` starts (`mlflow server --app-name agentkiln`, registered in
pyproject's `mlflow.app` entry points): MLflow's own app, but its root URL lands in the model-training
view. MLflow 3's UI opens in its GenAI mode (traces, evaluations: empty here) unless the URL says
`workflowType=machine_learning`, and the browser then remembers that choice. The page at `/` (the
root URL, and every link into the UI, whose `#/...` route the server never sees) adds that parameter
to the route it was opened with, defaulting to the experiments list, and loads the UI: a teammate's
link to an experiment opens that experiment's training runs."""

from __future__ import annotations

from mlflow.server.fastapi_app import app as mlflow_app

LANDING = b"""<!doctype html><meta charset="utf-8"><title>MLflow (agentkiln)</title>
<script>
var route = location.hash && location.hash !== "#/" ? location.hash : "#/experiments";
if (route.indexOf("workflowType=") < 0) route += (route.indexOf("?") < 0 ? "?" : "&") + "workflowType=machine_learning";
location.replace("/?view=training" + route);
</script>
<noscript><a href="/?view=training#/experiments?workflowType=machine_learning">MLflow: model training</a></noscript>
"""


class TrainingLanding:
    """ASGI: `/` (no query) answers LANDING, everything else is MLflow's (an instance, not a function:
    MLflow would take a function for an app factory)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/" and not scope.get("query_string") and scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]})
            await send({"type": "http.response.body", "body": LANDING})
            return
        await mlflow_app(scope, receive, send)


app = TrainingLanding()
