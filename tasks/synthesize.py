"""Prefect tasks of the synthesize stage (DVC caches stage outputs, so Prefect's own cache is off)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.data_checks import run_checkpoint
from agentkiln.synthesis.stage import synthesize

synthesize_task = task(synthesize, name="synthesize-tasks", cache_policy=NO_CACHE)
checkpoint_task = task(run_checkpoint, name="data-checkpoint", cache_policy=NO_CACHE)
