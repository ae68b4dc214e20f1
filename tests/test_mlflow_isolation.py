"""A test that points MLflow at another store (mlflow.set_tracking_uri exports it process-wide) does not
move the tests after it: tests/conftest.py puts MLflow back where it pointed. The two tests run in order
in one process (one module, one xdist worker under --dist loadfile)."""

from __future__ import annotations

import os

import mlflow

_before: dict = {}


def test_a_test_points_mlflow_at_a_server_that_is_gone():
    from agentkiln import tracking

    _before.update(uri=mlflow.get_tracking_uri(), env=os.environ.get("MLFLOW_TRACKING_URI"),
                   ours=tracking.tracking_uri(), registry=mlflow.get_registry_uri())
    gone = "http://127.0.0.1:9/"  # the discard port: nothing answers
    mlflow.set_tracking_uri(gone)
    mlflow.set_registry_uri(gone)
    assert os.environ["MLFLOW_TRACKING_URI"] == gone == tracking.tracking_uri()


def test_the_next_test_finds_mlflow_where_it_was():
    from agentkiln import tracking

    assert _before, "runs after the test above (same module, same process)"
    assert mlflow.get_tracking_uri() == _before["uri"]
    assert os.environ.get("MLFLOW_TRACKING_URI") == _before["env"]
    assert tracking.tracking_uri() == _before["ours"] != "http://127.0.0.1:9/"
    assert mlflow.get_registry_uri() == _before["registry"]
