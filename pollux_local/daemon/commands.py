"""What the daemon works out from a job's command, once per command: its digest (the part of a
job's kind, ``scheduler.job_kind``, that the command makes) and its size as exec counts it
(``jobrules.check_job``'s ``max_command_size``).

Both were made again for every job each time they were asked: every pass asks the kind of
every queued and running job, a submit checks the size of every task of an array, and the
first pass after it checks every new job again (``loop.hold_refused``).  A command of 3.7 MB
of two-byte characters took 36 ms a job to digest (as escaped JSON) and 1.3 ms to measure:
one user's 200-task array sharing it held each pass 15 s under the daemon's mutex, and a
999-task submit held the event loop (everyone's requests, pings included) 4.5 s.  The tasks
of an array, and every load of a stored command, share one command's strings, so a command
is remembered by itself: its strings hash once each, and the same strings compare at once.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

__all__ = [
    "COMMAND_MEMORY_BYTES",
    "CommandFacts",
    "StoredEnvironment",
    "command_bytes",
    "command_digest",
    "environment_bytes",
]

#: Bytes (of memory) of the commands :data:`FACTS` remembers (at least the last one): the
#: commands of the jobs a pass reads, which the store's blob cache shares while it holds them.
COMMAND_MEMORY_BYTES = 64 * 1024 * 1024


class CommandFacts:
    """Each command's SHA-256 (of its JSON, hex) and its bytes as exec counts them (each
    argument's UTF-8 and its NUL), keyed by the command, the least recently used forgotten
    past ``limit_bytes``.  Passes ask from their thread and requests from the event loop:
    one lock.  ``made`` counts the commands worked out (not remembered)."""

    def __init__(self, limit_bytes: int = COMMAND_MEMORY_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.made = 0
        self._facts: OrderedDict[tuple[str, ...], tuple[str, int, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __call__(self, argv: Sequence[str]) -> tuple[str, int]:
        """``argv``'s digest and size."""
        key = tuple(argv)
        with self._lock:
            found = self._facts.get(key)
            if found is not None:
                self._facts.move_to_end(key)
                return found[0], found[1]
        digest = hashlib.sha256(msgspec.json.encode(key)).hexdigest()
        size = sum(len(arg.encode()) + 1 for arg in key)
        held = sum(map(sys.getsizeof, key))
        with self._lock:
            self.made += 1
            if key not in self._facts:
                self._facts[key] = (digest, size, held)
                self._bytes += held
            while self._bytes > self.limit_bytes and len(self._facts) > 1:
                _, (_, _, gone) = self._facts.popitem(last=False)
                self._bytes -= gone
        return digest, size


#: The daemon's one memory of commands.
FACTS = CommandFacts()


def command_digest(argv: Sequence[str]) -> str:
    """The SHA-256 (hex) of ``argv`` as JSON, remembered (:data:`FACTS`)."""
    return FACTS(argv)[0]


def command_bytes(argv: Sequence[str]) -> int:
    """``argv``'s bytes as exec counts them (each argument's UTF-8 and its NUL), remembered
    (:data:`FACTS`)."""
    return FACTS(argv)[1]


def environment_bytes(env: Mapping[str, str]) -> int:
    """Bytes of an environment as exec counts them: ``NAME=value`` and its NUL, each."""
    return sum(len(name.encode()) + len(value.encode()) + 2 for name, value in env.items())


@dataclass(frozen=True)
class StoredEnvironment:
    """An environment the store keeps, as a job's checks need it (``submit.validate_jobs``):
    its blob's ``digest`` and its bytes as exec counts them (:func:`environment_bytes`),
    worked out once per environment (``StateStore.stored_environment``).  A stored job
    released, edited or restarted is checked with it rather than with the environment
    itself: loading and measuring 200,000 variables took about 70 ms a job, and a ``release
    --all`` of 999 held tasks sharing one held the event loop for tens of seconds."""

    digest: str
    exec_bytes: int
