"""Prefect task of the evaluate stage (DVC caches stage outputs, so Prefect's own cache is off). One module
per stage: a stage's flow imports only its own code, so DVC's deps can name exactly that code."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.stages.evaluate import run_evaluate

evaluate_task = task(run_evaluate, name="evaluate-panel", cache_policy=NO_CACHE)
