"""One Prefect flow per DVC stage (`python -m flows.<stage>`), plus the scheduled pipeline."""
