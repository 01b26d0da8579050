"""Continuous evaluation in a process of its own: the sidecar evaluator."""
