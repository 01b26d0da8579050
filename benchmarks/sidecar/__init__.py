"""The sidecar evaluator: a commit to its evaluation starting."""
