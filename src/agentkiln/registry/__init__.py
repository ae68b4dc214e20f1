"""Model registry: the pure promotion gate (`promotion`), lineage tags (`lineage`) and the MLflow
side effects (`model_registry`, imported on demand: it pulls in mlflow)."""
