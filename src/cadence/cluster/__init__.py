"""Roles in a cluster, the processes cadence starts side by side, and Slurm (a step's tasks as ranks,
the job's requeue: :mod:`cadence.cluster.slurm`)."""
