"""Atomic, verified checkpoints that never destroy the last good one.

File format: the 8-byte magic ``PLXCKPT1``, the 32-byte SHA-256 of the payload, then the
payload (``torch.save`` of one dict).  A checkpoint is written to a temporary file in the same
directory, flushed and fsync'ed, then renamed into place (``ckpt-<step>.pt``); the directory is
fsync'ed too.  Only after that are older checkpoints pruned (the newest ``keep`` stay).  On
restore the newest file that verifies is used; a newer file that does not verify is renamed
``*.corrupt`` and reported, never deleted, and the previous good one is used instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from pollux_local.errors import PolluxError

log = logging.getLogger("pollux_local.torch")

MAGIC = b"PLXCKPT1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def encode(payload: dict[str, Any]) -> bytes:
    """Serialise ``payload`` with its digest."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    return MAGIC + hashlib.sha256(body).digest() + body


def decode(data: bytes, source: str) -> dict[str, Any]:
    """Verify and deserialise; a damaged file raises ``PolluxError`` naming ``source``."""
    if len(data) < len(MAGIC) + 32 or not data.startswith(MAGIC):
        raise PolluxError(f"checkpoint {source} is not a pollux-local checkpoint or is truncated")
    digest = data[len(MAGIC) : len(MAGIC) + 32]
    body = data[len(MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != digest:
        raise PolluxError(f"checkpoint {source} is corrupt (checksum mismatch)")
    try:
        # The file is this job's own, written by ``save`` and verified above; user state
        # objects may be arbitrary picklable values, hence weights_only=False.
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise PolluxError(f"checkpoint {source} cannot be read: {exc}") from None
    if not isinstance(payload, dict):
        raise PolluxError(f"checkpoint {source} does not hold a checkpoint dictionary")
    return payload


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointStore:
    """The checkpoints of one job in one directory."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def files(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def save(self, step: int, payload: dict[str, Any]) -> Path:
        """Write ``payload`` atomically as the checkpoint of ``step``; return its path."""
        data = encode(payload)
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"ckpt-{step:010d}.pt"
        tmp = self.directory / f".ckpt-{step:010d}.pt.tmp.{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        for stale in self.directory.glob(".ckpt-*.pt.tmp.*"):  # left by a crash mid-write
            with contextlib.suppress(OSError):
                stale.unlink()
        for _, old in self.files()[self.keep :]:
            try:
                old.unlink()
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", old, exc)
        return final

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that verifies, or ``None`` when there is none at all.

        Files that fail to verify are renamed ``*.corrupt``; when every file fails, that is a
        ``PolluxError`` (the job must not silently start over).
        """
        failures = []
        for _, path in self.files():
            try:
                return decode(path.read_bytes(), str(path)), path
            except PolluxError as exc:
                failures.append(str(exc))
                log.warning("%s; falling back to an older checkpoint", exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".corrupt"))
            except OSError as exc:
                failures.append(f"checkpoint {path} cannot be read: {exc.strerror}")
        if failures:
            raise PolluxError(f"no usable checkpoint in {self.directory}: {failures[0]}")
        return None


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load one named checkpoint file (missing or damaged -> ``PolluxError``)."""
    p = Path(path)
    if not p.is_file():
        raise PolluxError(f"checkpoint {p} does not exist")
    return decode(p.read_bytes(), str(p))
