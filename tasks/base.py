"""Prefect task of the base stage (DVC caches stage outputs, so Prefect's own cache is off). One module
per stage: a stage's flow imports only its own code, so DVC's deps can name exactly that code."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.stages.base import run_base

base_task = task(run_base, name="base-model", cache_policy=NO_CACHE)
