"""Assembling a run from an experiment config: task, runners, checkpoints, actions; roles and the smoke test."""
