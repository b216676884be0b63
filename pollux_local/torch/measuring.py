"""When the trainer measures gradient statistics: the spacing of *measuring* steps.

A measuring step costs more than an ordinary one (one replica: hooks sum the first quarter's
gradient norm and one fused norm of ``.grad`` is read, or, for models the hooks do not cover,
the step is dealt out as two half micro-batches and two norms are read; several replicas: the
gradients are all-reduced by hand instead of overlapped by DDP).  Ordinary steps cost
nothing: no hook, no norm, no host synchronisation.  With T the mean time of the last
PLAIN_WINDOW ordinary steps and T' that of the last MEASURED_WINDOW measuring steps, each
without steps stretched to a multiple of its median (:func:`typical_time`: a step stretched
by another process moves neither; times are the process's CPU time for one replica on the
CPU, the wall clock on CUDA or with several replicas: ``ElasticTrainer._cost_clock``),
measuring steps are spaced

    k = min(max(stats_interval, ceil(((T' - T) / T) / stats_budget)), MAX_STATS_INTERVAL)

steps apart (a measuring step every k steps), so that their extra cost stays within
``stats_budget`` of training time (0.5% by default), unless keeping it there would make the
estimate stale.  The trade-off: spacing measurements k steps apart leaves the estimate's noise
as it is (the EMA averages the same number of measurements, ~19 at beta = 0.9) but makes it
k times older (lag k * beta / (1 - beta) = 9k steps), so a drifting statistic is followed
with a bias that grows with k while the confidence band stays put.  Measured on the probe
model of ``benchmarks/job_overhead.py`` training at a quick pace (tr(S) falls 3x in 2,500
steps; ``python benchmarks/job_overhead.py --spacing``, docs/design-notes.md), the smoothed
tr(S) lies within its own 95% band (``GradNoiseEstimator.stderr``) on 91% of the steps when
measured every step, 88% every 16 steps, 80% every 32 (median error 1.05 standard errors:
inside the band) and 68% every 64 (median error 1.44): MAX_STATS_INTERVAL is 32.  A job
whose statistics drift more slowly per step (any job with longer epochs) could be measured
more sparsely still; the cap is the quick case's.

With several replicas the stop requests ride on the measuring steps' all-reduce, so k is also
at most STOP_LATENCY_S / T: a rescale waits at most that long.  The spacing is rank 0's,
carried to the other replicas by that same all-reduce.

On CUDA a step's time is known only after a synchronisation, so only *timed* steps (measuring
steps and the step just before each) synchronise and are profiled; on the CPU every step is
timed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

#: The default fraction of training time that measuring steps may cost.
DEFAULT_STATS_BUDGET = 0.005
#: Upper bound on the spacing of gradient-statistics measurements (optimizer steps).
MAX_STATS_INTERVAL = 32
#: With several replicas, stop requests are agreed on at measuring steps, which are spaced at
#: most this many seconds of training apart.
STOP_LATENCY_S = 3.0
#: Step times the spacing rule keeps, per kind of step (the last ones).
PLAIN_WINDOW = 31
MEASURED_WINDOW = 9
#: A step time over this many times its window's median is a stretched step, left out.
STRETCHED = 3.0


def typical_time(times: Sequence[float]) -> float:
    """The mean of ``times`` without those over STRETCHED x their median.

    A mean, not a median: where step times are not one value plus noise (two replicas on
    the CPU: some steps find the other rank waiting, some wait for it), a measuring step's
    extra time shows whole in the mean, while the difference of medians saw about half of it
    and the spacing let measuring cost twice its budget (``benchmarks/job_overhead.py``).
    Steps stretched by another process (a multiple of the median) are left out."""
    ordered = sorted(times)
    middle = len(ordered) // 2
    median = (ordered[middle] + ordered[~middle]) / 2
    kept = [t for t in ordered if t <= STRETCHED * median]
    return math.fsum(kept) / len(kept)


class MeasuringSchedule:
    """Decides, step by step, whether the next optimizer step measures (the first one does)."""

    def __init__(self, stats_interval: int, stats_budget: float | None, replicas: int) -> None:
        self.stats_interval = stats_interval
        self.stats_budget = stats_budget
        self.replicas = replicas
        #: Steps between measuring steps now.
        self.interval = stats_interval
        #: Steps since the last measuring step (counting it: 1 right after it).
        self.since = stats_interval  # measure the very first step
        #: Whether the current step measures.
        self.measuring = True
        self._times_plain: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self._times_measured: deque[float] = deque(maxlen=MEASURED_WINDOW)

    def begin_step(self) -> bool:
        """Start an optimizer step; returns whether it measures."""
        self.measuring = self.since >= self.interval
        return self.measuring

    def timed(self) -> bool:
        """Whether the current step is timed where timing costs a synchronisation (CUDA): a
        measuring step, or the ordinary step just before one."""
        return self.measuring or self.since + 1 >= self.interval

    def end_step(self) -> None:
        """The step is done (optimizer stepped)."""
        self.since = 1 if self.measuring else self.since + 1

    def record_time(self, seconds: float) -> None:
        """Keep a step's time with the last ones of its kind; one replica re-spaces after each
        measuring step (several: rank 0 proposes at the measuring step's all-reduce)."""
        (self._times_measured if self.measuring else self._times_plain).append(seconds)
        if self.replicas == 1 and self.measuring:
            self.interval = self.proposed()

    def proposed(self) -> int:
        """n of the module docstring (``stats_interval`` when there is no budget; the current
        spacing until both kinds of step were timed)."""
        if self.stats_budget is None:
            return self.stats_interval
        if not self._times_plain or not self._times_measured:
            return self.interval
        plain = typical_time(self._times_plain)
        measured = typical_time(self._times_measured)
        if plain <= 0:
            return self.interval
        extra = max(measured - plain, 0.0) / plain
        wanted = max(self.stats_interval, math.ceil(extra / self.stats_budget))
        if self.replicas > 1:
            # a rescale request is acted on at a measuring step: bound the wait
            wanted = min(wanted, max(1, int(STOP_LATENCY_S / plain)))
        return int(min(wanted, MAX_STATS_INTERVAL))

    def adopt(self, interval: int | None) -> None:
        """Take rank 0's spacing (the same on every replica); ``None``: keep the current."""
        if interval is not None:
            self.interval = interval
