"""Evaluation on the serving path: one-pass compressed attention, metrics, tasks."""
