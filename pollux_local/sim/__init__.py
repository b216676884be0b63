"""Trace-driven simulation of a shared cluster (``pollux-local simulate``).

* :mod:`~pollux_local.sim.profiles` — measured model profiles and their interpolation;
* :mod:`~pollux_local.sim.workload` — workload traces;
* :mod:`~pollux_local.sim.simulator` — the loop that calls any ``Policy`` and the metrics;
* :mod:`~pollux_local.sim.hetero` — the same on nodes of several device types, each with its
  own profiles (``simulate --cluster``; ``docs/heterogeneous.md``).

Metrics of a run (:meth:`SimResult.summary`):

* JCT: completion - submission time; ``avg_jct_s``, ``p99_jct_s`` over completed jobs;
* ``makespan_s``: last completion - first submission;
* ``restarts_per_job``: mean number of allocation changes after each job's first start
  (being preempted to nothing is not counted, being started again is);
* finish-time fairness of a job: rho = JCT / JCT_alone, where JCT_alone is its run time alone on
  an equal share of the cluster, G/n devices with n the mean number of active jobs during its
  life (packed onto as few nodes as possible, the best validated batch per epoch, one restart);
  ``max_finish_time_fairness`` is the worst rho (rho <= 1 means the job did no worse than
  with its own 1/n slice);
* ``decision_ms_median``/``decision_ms_p95``: wall time of ``policy.decide`` per round;
* ``wall_s``: wall time of the whole simulation.
"""

from pollux_local.sim.profiles import AppProfile, load_profiles
from pollux_local.sim.simulator import SimConfig, SimResult, Simulator
from pollux_local.sim.workload import WorkloadJob, read_workload

__all__ = [
    "AppProfile",
    "SimConfig",
    "SimResult",
    "Simulator",
    "WorkloadJob",
    "load_profiles",
    "read_workload",
]
