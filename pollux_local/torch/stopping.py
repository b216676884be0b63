"""Checkpoints and the stop for a rescale.

The launcher stops a replica with SIGTERM; the replica finishes its step, checkpoints and
exits with ``ExitCode.RESCALE`` (75).  With several replicas the stop is agreed on first (see
``collectives.py``), so a peer's flag can come before this replica's own SIGTERM; once the
stop is agreed the replica ignores SIGTERM, which, arriving during interpreter shutdown where
the handler is gone, would turn the checkpointed exit 75 into a kill.

A checkpoint payload (format 1) holds the model, the optimizer, the learning-rate schedule,
the AMP scaler, the sampler's position, the gradient statistics, the timing profile, progress
and steps, the batch configuration, torch's RNG state and the user's objects.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

import torch

from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.torch.gradstats import GradNoiseEstimator
from pollux_local.torch.profile import ProfileRecorder

log = logging.getLogger("pollux_local.torch")

#: Version of the checkpoint payload.
PAYLOAD_FORMAT = 1


class StopRequest:
    """Whether this replica was asked to stop (SIGTERM, or :meth:`request`)."""

    def __init__(self) -> None:
        self.requested = False
        self.handles_sigterm = False

    def install(self) -> None:
        """Turn SIGTERM into a stop request from now on."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.handles_sigterm = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def request(self) -> None:
        """Ask for a stop (what SIGTERM does)."""
        self.requested = True

    def ignore_sigterm(self) -> None:
        """The stop is decided: a SIGTERM from now on is ignored (when we handle it at all)."""
        if self.handles_sigterm:
            with contextlib.suppress(ValueError):  # not the main thread: nothing to guard
                signal.signal(signal.SIGTERM, signal.SIG_IGN)


class CheckpointTimer:
    """Periodic checkpoints: one is due ``interval_s`` after the last (``None``: never)."""

    def __init__(self, interval_s: float | None) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic()

    def due(self, enabled: bool = True) -> bool:
        """Whether a periodic checkpoint is due (never when not ``enabled``)."""
        if not enabled or self.interval_s is None:
            return False
        return time.monotonic() - self.last >= self.interval_s

    def reset(self) -> None:
        """A checkpoint was just written."""
        self.last = time.monotonic()


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def build_payload(
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: Any,
    sampler_state: dict[str, Any] | None,
    estimator: GradNoiseEstimator,
    profile: ProfileRecorder,
    progress: float,
    steps: int,
    batch: tuple[int, int],
    user: Mapping[str, Any],
) -> dict[str, Any]:
    """The checkpoint payload (module docstring) of a trainer's state."""
    return {
        "format": PAYLOAD_FORMAT,
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": sampler_state,
        "grad_stats": estimator.state_dict(),
        "profile": profile.state_dict(),
        "progress": progress,
        "steps": steps,
        "batch": list(batch),
        "rng": torch.get_rng_state(),
        "user": {name: _state_of(obj) for name, obj in user.items()},
    }


@dataclass(frozen=True)
class Restored:
    """What a payload restores besides the objects it loads in place."""

    progress: float
    steps: int
    sampler_state: dict[str, Any] | None


def restore_payload(
    payload: dict[str, Any],
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: Any,
    estimator: GradNoiseEstimator,
    profile: ProfileRecorder,
    user: dict[str, Any],
) -> Restored:
    """Load ``payload`` into the given objects (``PolluxError`` when it does not fit them).

    A user object with ``load_state_dict`` is loaded in place; any other saved user value
    replaces the entry of ``user``."""
    try:
        module.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        if lr_scheduler is not None and payload.get("lr_scheduler") is not None:
            lr_scheduler.load_state_dict(payload["lr_scheduler"])
        if scaler is not None and payload.get("scaler") is not None:
            scaler.load_state_dict(payload["scaler"])
        sampler_state = payload.get("sampler")
        estimator.load_state_dict(payload["grad_stats"])
        profile.load_state_dict(payload["profile"])
        restored = Restored(
            progress=float(payload["progress"]),
            steps=int(payload["steps"]),
            sampler_state=sampler_state,
        )
        if payload.get("rng") is not None:
            torch.set_rng_state(payload["rng"])
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise PolluxError(f"checkpoint does not match this job: {exc}") from None
    for name, value in payload.get("user", {}).items():
        obj = user.get(name)
        if obj is not None and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(value)
        else:
            user[name] = value
    return restored


def exit_for_rescale(
    stop: StopRequest,
    steps: int,
    *,
    checkpoint: Callable[[], object],
    report: Callable[[], None],
    leave: Callable[[], None],
) -> NoReturn:
    """The agreed stop: ignore further SIGTERMs, ``checkpoint``, send the last ``report``,
    ``leave`` the process group, exit with ``ExitCode.RESCALE``."""
    stop.ignore_sigterm()
    checkpoint()
    report()
    leave()
    log.info("checkpointed at step %d for a rescale; exiting %d", steps, ExitCode.RESCALE)
    sys.exit(ExitCode.RESCALE)
