"""Evaluation: statistics (Wilson intervals), per-policy summaries and reports."""
