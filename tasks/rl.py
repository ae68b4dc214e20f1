"""Prefect task of the rl stage (DVC caches stage outputs, so Prefect's own cache is off). One module
per stage: a stage's flow imports only its own code, so DVC's deps can name exactly that code."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.stages.rl import run_rl

rl_task = task(run_rl, name="train-rl", cache_policy=NO_CACHE)
