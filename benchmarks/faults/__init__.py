"""Faults: goodput with ranks or nodes killed, and kill -9 of runs checkpointing to S3."""
