"""Prefect task of the sft stage (DVC caches stage outputs, so Prefect's own cache is off). One module
per stage: a stage's flow imports only its own code, so DVC's deps can name exactly that code."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.stages.sft import run_sft

sft_task = task(run_sft, name="train-sft", cache_policy=NO_CACHE)
