"""The goodput allocation policy: devices and placements that maximise the p-mean of speed-ups.

For every job j and replica count k the policy looks up the best goodput its model predicts on
the fewest nodes that can hold k devices, and turns it into a *speed-up* over the job's fair
share::

    SPEEDUP_j(k) = G_j(k) / G_j(f_j),    f_j = G_total * w_j / sum_i w_i,   w_j = 1 / n_owner(j)

so every user (not every job) is entitled to the same share of devices.  The objective is the
weighted p-mean of the speed-ups, maximised through the separable utility
``sum_j w_j v_j U(SPEEDUP_j)`` with ``U(x) = x^p / p`` (``log x`` for p = 0; p = -1 by default) and
a shortest-expected-remaining-time factor from the jobs' *ranks*::

    v_j = (rank_j / J)^gamma,   rank 1 = the longest expected remaining run time, J = the shortest

(gamma = ``rank_exponent``, 2 by default; 0 gives the plain p-mean; tied jobs share their
average rank).  Ranks, not the times themselves, after the optimal allocation for parallel
jobs with a common speed-up curve (heSRPT: every job runs, and the shares grow with the rank of
the job's remaining size), which makes the factor scale-free: ten long jobs are ordered among
themselves as firmly as ten short ones.  R_j is the job's expected remaining run time: from its
declared length when it has one (f = share of its declared epochs done, t_j its run time so
far)::

    R_j = (t_j + interval) * (1 - f) / max(f, 0.05)

and otherwise its run time so far, R_j = t_j (job lengths are heavy-tailed: a job that has run
longer is expected to run longer still).  Favouring the jobs expected to finish soonest (no job
is starved while p <= 0: its utility falls without bound as its speed-up goes to 0) lowers the
average completion time.

The search, in four steps, all on tables computed once per decision:

1. *admission* — when the jobs' minimum demands exceed the devices, the jobs with the least
   attained service run (least-attained-service favours short jobs and cuts the average
   completion time); a running job keeps its place against a waiting job unless it has
   received more than twice the waiting job's service, not counting its first round of
   service, and it wins ties (hysteresis bounds preemptions); between waiting jobs alike in
   priority and service, the owners take turns (each owner's first job in the queue, then each
   one's second, ...), so that one user's long queue does not hold another user's job back
   until all of it has started;
2. *greedy marginal gain* — devices go one increment at a time to the job whose utility rises
   most per device (looking ahead over several devices, so steps in the goodput curve such as
   crossing onto a second node are seen);
3. *local search* — moves of d devices between two jobs while the objective improves;
4. *placement* — jobs that keep their replica count keep their devices; the others are packed
   onto as few nodes as possible, avoiding devices that jobs still to be placed hold, and two
   jobs spanning several nodes never share a node; when the free devices are too fragmented
   to hold a job as tightly as the tables assumed, fewer devices on fewer nodes are taken if
   its model predicts more goodput there; a running job whose larger target does not fit
   stays where it is rather than moving.  A running job spread over more nodes than its
   count needs (placed while the cluster was fragmented) is valued at the goodput its model
   predicts where it really runs, so it moves onto fewer nodes when that pays for the restart
   and room is free.

Rigid jobs (``JobView.rigid``: scripts the policy cannot resize) hold their devices, as Sia
treats them; elastic jobs share the rest.  A running rigid job that may not be preempted keeps
its placement and is left out of the search (its devices are not offered); any other rigid
job is searched with exactly its size as the only count, so it is started on exactly that
many devices or waits, and once running it keeps its placement or (preemptible, losing
admission) is stopped.

Waiting jobs: ``Decision.waiting`` holds the facts of why each job left waiting waits (the
devices it needs and the jobs admitted ahead of it, each with the rule that put it there).

Whole nodes: a job spanning nodes takes the devices of whole nodes (the counts the n largest
nodes add up to): a partly used extra node slows every step with inter-node synchronisation and
blocks the rest of that node for other multi-node jobs.

Exploration: a job gets at most four times the largest replica count it has been profiled on
(``EXPLORATION_FACTOR``: two doublings per restart, so a job reaches its scalable size in few
restarts while its model is never trusted far beyond its data); a job
with nothing profiled starts on one node, within its fair share.

Restarts: changing a running job's allocation costs it d seconds of no progress: its own
measured cost when it has one (``JobView.warm_resize_cost_s`` for a change within its device
type, ``JobView.restart_cost_s`` otherwise), else ``restart_cost_s``.  A new allocation is expected to last as long as the job's allocations lasted so far,
H = age / (restarts + 1), but no longer than the job's expected remaining run time R_j when it
declared its length (and at least one interval).  A change to speed-up x' beats staying at x
only when it earns back m times its restart cost within H (m = ``payback_margin``, 6 by
default, a margin for optimistic predictions and for the uncertainty of H):
``x' * H >= x * (H + m * d)``; so every allocation other than the current one is discounted by
``H / (H + m * d)`` in the objective: a young job's small gain never pays for a restart, and a
job that keeps being re-allocated needs ever larger gains.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_local.core.policy.objective import (
    EXPLORATION_FACTOR,
    min_nodes_table,
    rank_weights,
    set_pinned_aside,
)
from pollux_local.core.policy.typed import TypedChoice
from pollux_local.core.types import (
    Decision,
    Holder,
    JobView,
    NodeView,
)

__all__ = ["EXPLORATION_FACTOR", "GoodputPolicy", "rank_weights"]


class GoodputPolicy(TypedChoice):
    """Pollux-style goodput allocation with a fast, deterministic search.

    ``p`` is the exponent of the p-mean (-1: harmonic, the default; 0: geometric; 1: total
    speed-up; towards -inf: max-min fairness); ``restart_cost_s`` the seconds of progress an allocation
    change costs; ``interval_s`` the time between decisions (the smallest lifetime estimate a
    running job's allocation gets); ``preempt_ratio`` how much more service a running job must
    have received than a waiting one before the waiting one takes its place;
    ``local_search_steps`` bounds the move search (per job); ``rank_exponent`` (gamma) how
    strongly jobs expected to finish sooner are favoured (0: plain p-mean); ``payback_margin``
    (m) how many times over a change must earn back its restart cost; ``type_aware`` whether
    it chooses a device type per job on a cluster of several types (off: every device counts
    alike, a job's single model serves all types); ``type_payback_margin`` is m for a move to
    another device type (10: such a move is a restart, and the value was chosen on held-out
    heterogeneous traces with warm resizes and measured restart costs, as the daemon runs;
    24 before those); a change of count within a type keeps ``payback_margin``.
    """

    name = "goodput"

    # ------------------------------------------------------------------ entry point
    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        """Place every job; zeros for jobs that do not run this round."""
        del now, rng  # the search is deterministic and needs neither
        node_sizes = [n.devices if n.up and n.devices > 0 else 0 for n in nodes]
        if not jobs:
            return Decision(placements={}, reasons={})
        if self.type_aware:
            types = {n.device_type for n, size in zip(nodes, node_sizes, strict=True) if size}
            if len(types) > 1:
                return self._decide_typed(jobs, nodes, node_sizes)
        # running rigid jobs that may not be preempted hold their devices; the others share
        # the rest
        pinned, node_sizes, multi_node_on, shared = set_pinned_aside(jobs, node_sizes)
        total = int(sum(node_sizes))
        if total == 0 or not shared:
            return self._all_waiting(jobs, shared, pinned, nodes)
        min_nodes = min_nodes_table(node_sizes, total)
        plans = self._build_plans(shared, node_sizes, total, min_nodes)
        holders = tuple(Holder(job_id, "rigid") for job_id in pinned)
        offered = sum(n.devices if n.up and n.devices > 0 else 0 for n in nodes)
        self._admit(plans, total, holders, offered)
        free = self._greedy(plans, total)
        self._local_search(plans, free)
        self._place(plans, node_sizes, min_nodes, multi_node_on)
        decision = self._decision(plans, nodes, min_nodes, total)
        if not pinned:
            return decision
        return self._with_pinned(decision, jobs, pinned)
