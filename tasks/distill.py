"""Prefect task of the distill stage (DVC caches stage outputs, so Prefect's own cache is off). One module
per stage: a stage's flow imports only its own code, so DVC's deps can name exactly that code."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.stages.distill import run_distill

distill_task = task(run_distill, name="distill-student", cache_policy=NO_CACHE)
