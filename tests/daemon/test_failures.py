"""Which failures are not worth a retry (``daemon.failures.permanent_cause``)."""

from __future__ import annotations

import pytest

from pollux_local.daemon.failures import permanent_cause


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("ModuleNotFoundError: No module named 'pollux_local'", "install pollux-local there"),
        ("ModuleNotFoundError: No module named 'transformers'", "a module is missing"),
        ("  SyntaxError: invalid syntax", "does not parse"),
        ("AssertionError: Torch not compiled with CUDA enabled", "given CPU devices"),
        ("train.py: error: unrecognized arguments: --lr0.1", "refused its arguments"),
        # a replica that could not be set up, on any launcher (review s62)
        ("cannot enter working directory /scratch/x: No such file or directory", "entered"),
        ("cannot execute ./train.sh: Permission denied", "cannot be run"),
        ("cannot execute /opt/x/bin/python: No such file or directory", "cannot be run"),
        ("cannot execute ./train.sh: Text file busy", None),
        ("RuntimeError: Connection reset by peer", None),
        ("boom: bad input shape", None),
        ("", None),
    ],
)
def test_permanent_causes(line: str, expected: str | None) -> None:
    cause = permanent_cause(line, on_cpu=True)
    assert (cause is None) if expected is None else (cause is not None and expected in cause)
