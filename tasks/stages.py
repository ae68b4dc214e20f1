"""One Prefect task per stage function. DVC caches stage outputs, so Prefect's own cache is off."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentkiln.data_checks import run_checkpoint
from agentkiln.stages.distill import run_distill
from agentkiln.stages.evaluate import run_evaluate
from agentkiln.stages.rl import run_rl
from agentkiln.stages.sft import run_sft
from agentkiln.synthesis import synthesize

synthesize_task = task(synthesize, name="synthesize-tasks", cache_policy=NO_CACHE)
checkpoint_task = task(run_checkpoint, name="data-checkpoint", cache_policy=NO_CACHE)
sft_task = task(run_sft, name="train-sft", cache_policy=NO_CACHE)
rl_task = task(run_rl, name="train-rl", cache_policy=NO_CACHE)
distill_task = task(run_distill, name="distill-student", cache_policy=NO_CACHE)
evaluate_task = task(run_evaluate, name="evaluate-panel", cache_policy=NO_CACHE)
