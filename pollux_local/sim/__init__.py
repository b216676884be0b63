"""Trace-driven simulation of a shared cluster (``pollux-local simulate``).

* :mod:`~pollux_local.sim.profiles` — measured model profiles and their interpolation;
* :mod:`~pollux_local.sim.workload` — workload traces;
* :mod:`~pollux_local.sim.cluster` — the simulated nodes: groups of one device type each
  (untyped: one group; ``simulate --cluster``, ``docs/heterogeneous.md``);
* :mod:`~pollux_local.sim.jobs` — a simulated job's state, the rules it follows (Pollux's
  artifact or Sia's simulator) and its progress;
* :mod:`~pollux_local.sim.models` — the jobs' models and batch choices (job libraries);
* :mod:`~pollux_local.sim.engine` — the loop that calls any ``Policy`` and the metrics.

Metrics of a run (:meth:`SimResult.summary`):

* JCT: completion - submission time; ``avg_jct_s``, ``p99_jct_s`` over completed jobs;
* ``makespan_s``: last completion - first submission;
* ``restarts_per_job``: mean number of allocation changes after each job's first start
  (being preempted to nothing is not counted, being started again is);
* finish-time fairness of a job (untyped clusters): rho = JCT / JCT_alone, where JCT_alone is
  its run time alone on an equal share of the cluster, G/n devices with n the mean number of
  active jobs during its life (packed onto as few nodes as possible, the best validated batch
  per epoch, one restart); ``max_finish_time_fairness`` is the worst rho (rho <= 1 means the
  job did no worse than with its own 1/n slice);
* ``decision_ms_median``/``decision_ms_p95``: wall time of ``policy.decide`` per round;
* ``wall_s``: wall time of the whole simulation.
"""

from pollux_local.sim.cluster import Cluster, NodeGroup, format_cluster, parse_cluster
from pollux_local.sim.engine import SimConfig, SimResult, Simulator
from pollux_local.sim.jobs import POLLUX_RULES, SIA_RULES, JobRules, SimJob
from pollux_local.sim.profiles import AppProfile, load_profiles, load_typed_profiles
from pollux_local.sim.workload import WorkloadJob, read_workload

__all__ = [
    "POLLUX_RULES",
    "SIA_RULES",
    "AppProfile",
    "Cluster",
    "JobRules",
    "NodeGroup",
    "SimConfig",
    "SimJob",
    "SimResult",
    "Simulator",
    "WorkloadJob",
    "format_cluster",
    "load_profiles",
    "load_typed_profiles",
    "parse_cluster",
    "read_workload",
]
