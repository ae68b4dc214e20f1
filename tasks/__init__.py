"""Thin Prefect tasks over the library's stage functions (retries, logs, artifacts live here)."""
