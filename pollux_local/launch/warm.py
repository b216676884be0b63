"""The launcher's side of a warm resize (``api/resize.py``, ``torch/resizing.py``): write an
order for the running replicas, and see whether the joining ones are ready."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from pollux_local.api.resize import ResizeOrder, encode_order, ready_name


def write_order(path: Path, order: ResizeOrder) -> None:
    """Replace ``path`` with ``order`` atomically (a temporary file beside it, then a rename;
    never through a symlink)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, encode_order(order))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def joiners_ready(job_dir: Path, generation: int, ranks: Iterable[int]) -> bool:
    """Whether every joining replica of ``ranks`` announced itself for ``generation`` (its
    file in the job's directory; only its existence is looked at)."""
    return all(os.path.lexists(job_dir / ready_name(generation, rank)) for rank in ranks)
