"""Replicas as job steps of the Slurm allocation the daemon runs in.

A daemon started inside an allocation (``salloc``, an ``sbatch`` script; ``SLURM_JOB_ID``)
schedules the allocation's nodes and GPUs (``allocation.py``: the node list expanded by
``scontrol show hostnames``, the GPUs and their gres type from ``scontrol show job -d``).
Every incarnation of a job is one step, ``srun --jobid=... --nodelist=... --ntasks-per-node=...
--gres=gpu:N --kill-on-bad-exit``, whose tasks take their ranks from Slurm's step environment
through a one-line wrapper and get the launch environment the local launcher builds
(``launcher.py``).  A keeper process per step (``keeper.py``, its own session) runs ``srun``
and records the step's id and its end, so that a daemon killed and restarted inside the same
allocation finds its running steps and the ends it missed (``step.py``).  A stop is
``scancel --signal=TERM`` of the step, then ``scancel`` after the grace.  Tasks run as the user
who owns the allocation (the daemon's user).
"""

from pollux_local.launch.slurm.allocation import (
    Allocation,
    SlurmNode,
    in_allocation,
    read_allocation,
)
from pollux_local.launch.slurm.launcher import SlurmLauncher
from pollux_local.launch.slurm.step import SlurmStepGroup

__all__ = [
    "Allocation",
    "SlurmLauncher",
    "SlurmNode",
    "SlurmStepGroup",
    "in_allocation",
    "read_allocation",
]
