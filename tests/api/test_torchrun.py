"""torch's launcher as a job's command, however the interpreter's options spell ``-m``: the one
rule (``api.torchrun``) the client and the daemon refuse it by."""

from __future__ import annotations

import pytest

from pollux_local.api.torchrun import python_module, torch_launcher, torchrun_refusal

#: Commands that run torch's launcher (before its own arguments), and how a refusal names it.
LAUNCHERS = [
    (["torchrun"], "torchrun"),
    (["/opt/venv/bin/torchrun"], "torchrun"),
    (["python", "-m", "torch.distributed.run"], "python -m torch.distributed.run"),
    (["python", "-u", "-m", "torch.distributed.run"], "python -m torch.distributed.run"),
    (["python3", "-X", "utf8", "-m", "torch.distributed.launch"],
     "python -m torch.distributed.launch"),
    (["/usr/bin/python3.11", "-m", "torch.distributed.run"], "python -m torch.distributed.run"),
    (["python", "-mtorch.distributed.run"], "python -m torch.distributed.run"),
    (["python", "-um", "torch.distributed.run"], "python -m torch.distributed.run"),
    (["python", "-uBmtorch.distributed.launch"], "python -m torch.distributed.launch"),
    (["python3", "-W", "ignore", "-Xutf8", "-B", "-m", "torch.distributed.run"],
     "python -m torch.distributed.run"),
    (["python", "-Wignore::DeprecationWarning", "-m", "torch.distributed.run"],
     "python -m torch.distributed.run"),
    (["python", "--check-hash-based-pycs", "never", "-m", "torch.distributed.run"],
     "python -m torch.distributed.run"),
]  # fmt: skip

#: Commands that mention torch's launcher but do not run it (or are no interpreter).
NOT_LAUNCHERS = [
    ["python", "-c", "import sys", "-m", "torch.distributed.run"],  # -m is -c's argument
    ["python", "-cimport sys", "-m", "torch.distributed.run"],
    ["python", "-uc", "pass", "-m", "torch.distributed.run"],
    ["python", "train.py", "-m", "torch.distributed.run"],  # the script's arguments
    ["python", "-X", "-m", "torch.distributed.run"],  # -X takes "-m": a script follows
    ["python", "-W", "-m", "torch.distributed.run"],
    ["python", "--", "-m", "torch.distributed.run"],  # a script named -m
    ["python", "-", "-m", "torch.distributed.run"],  # standard input
    ["python", "-m", "http.server"],
    ["python", "-u", "-m", "torch.distributed.runner"],
    ["python", "-m"],
    ["pythonista", "-m", "torch.distributed.run"],
    ["/usr/bin/sleep", "5"],
    [],
]


@pytest.mark.parametrize(("launcher", "named"), LAUNCHERS)
def test_every_spelling_of_the_launcher_is_found(launcher: list[str], named: str) -> None:
    argv = [*launcher, "--nproc-per-node", "2", "/w/train.py", "--lr", "0.1"]
    assert torch_launcher(argv) == named
    refused = torchrun_refusal(argv)
    assert refused is not None and "\n" not in refused
    assert refused == (
        f"{named} would start ranks of its own inside the job; submit the script itself with"
        " the number of ranks as --gpus (pollux-local submit --gpus N /w/train.py ...): the"
        " daemon starts each rank with torchrun's environment"
    )


@pytest.mark.parametrize("argv", NOT_LAUNCHERS)
def test_what_does_not_run_the_launcher_is_left_alone(argv: list[str]) -> None:
    assert torch_launcher(argv) is None and torchrun_refusal(argv) is None


def test_the_module_is_read_as_cpython_reads_its_options() -> None:
    assert python_module(["-m", "pkg.mod", "-m", "other"]) == "pkg.mod"
    assert python_module(["-I", "-OO", "-mpkg"]) == "pkg"
    assert python_module(["-X", "dev", "-Wd", "-q", "-m", "pkg"]) == "pkg"
    assert python_module(["--version"]) is None
    assert python_module(["-E", "script.py", "-m", "pkg"]) is None
