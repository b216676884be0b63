"""Fixtures of the abuse tests: two ordinary Unix users per module (``alice`` and ``bob``,
removed with ``userdel -r`` at the end, even on failure) and a scratch :class:`Lab` per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.abuse.lab import Lab
from tests.labinstall import LabInstall, LabUser, two_users


@pytest.fixture(scope="module")
def users(lab_install: LabInstall) -> Iterator[tuple[LabUser, LabUser]]:
    with two_users(lab_install, "pxalice", "pxbob") as made:
        yield made


@pytest.fixture()
def alice(users: tuple[LabUser, LabUser]) -> LabUser:
    return users[0]


@pytest.fixture()
def bob(users: tuple[LabUser, LabUser]) -> LabUser:
    return users[1]


@pytest.fixture()
def lab(lab_install: LabInstall, users: tuple[LabUser, LabUser]) -> Iterator[Lab]:
    scratch = Lab(lab_install, users)
    try:
        yield scratch
    finally:
        scratch.close()
