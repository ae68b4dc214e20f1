"""One module per pipeline stage: plain functions from params + input paths to outputs + metrics.

Prefect tasks (tasks/) and flows (flows/) wrap these; tests call them directly.
"""
