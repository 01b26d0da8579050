"""Roles in a cluster and the processes cadence starts side by side."""
