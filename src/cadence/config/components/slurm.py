"""``trainer.slurm``: what a training run does as a Slurm job (read by the preemption action that
:func:`cadence.torch.experiments.actions.build_actions` builds, through :mod:`cadence.cluster.slurm`)."""

from __future__ import annotations

from pydantic import Field, StrictBool

from cadence.config.base import ConfigModel

__all__ = ["SlurmConfig"]


class SlurmConfig(ConfigModel):
    """A run under Slurm. Its ranks come from `srun`'s environment without any setting here (see the
    guide's Faults page); these settings are for the end of a job's time."""

    requeue: StrictBool = Field(
        default=False,
        description=("After the checkpoint that a SIGUSR1 makes the run commit (`#SBATCH --signal=USR1@SECONDS` "
                     "before the time limit), rank 0 runs `scontrol requeue $SLURM_JOB_ID` once and the run exits "
                     "0: the job goes back to the queue and resumes from that checkpoint. Not on SIGTERM "
                     "(`scancel`, preemption: saved, not requeued), and never once training reached its last "
                     "step. Needs `save_on_preemption`; outside a Slurm job, a warning. `cadence train "
                     "--requeue` sets it."),
    )
