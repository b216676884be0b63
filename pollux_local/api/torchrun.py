"""torch's launcher as a job's command: the one rule the client (``submission.command_argv``)
and the daemon (``handlers.submit.validate_jobs``: a submit, an edit, a restart, a release)
refuse it by.  The daemon starts each rank itself with torchrun's environment (``launch.py``);
a ``torchrun`` inside the job would start ranks of its own on the devices of one
(``--nproc-per-node 4`` on a job's one GPU).

torch's launcher is ``torchrun`` (any path), or a Python interpreter (``python``,
``python3``, ``/usr/bin/python3.11``) running the module ``torch.distributed.run`` or
``torch.distributed.launch``, however ``-m`` is spelled among the interpreter's own options
(``python -u -m MOD``, ``python3 -X utf8 -m MOD``, ``python -mMOD``, ``python -um MOD``):
:func:`python_module` reads them as CPython's option parser does."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

#: Program names that are a Python interpreter (``python``, ``python3``, ``python3.11``).
PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
#: torch's launcher run as a program.
TORCHRUN = "torchrun"
#: torch's launcher run as a module (``python -m torch.distributed.run``).
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")

#: CPython's short options that take an argument, attached (``-Xutf8``) or the next one
#: (``-X utf8``); ``-c`` and ``-m`` take one too, and end the interpreter's options.
_SHORT_WITH_ARGUMENT = frozenset("WX")
#: CPython's long options that take the next argument (``--check-hash-based-pycs always``).
_LONG_WITH_ARGUMENT = frozenset({"--check-hash-based-pycs"})


def python_module(args: Sequence[str]) -> str | None:
    """The module a Python interpreter given ``args`` (its arguments, the program's name not
    among them) runs with ``-m``, or ``None``: it runs a script, ``-c`` code or standard
    input.  Options are read as CPython reads them: short ones may be grouped (``-uB``), an
    option's argument attached or the next argument, ``--`` and the first argument that is
    not an option end them."""
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in ("-", "--") or not arg.startswith("-"):
            return None  # standard input, or a script
        index += 1
        if arg.startswith("--"):
            if arg in _LONG_WITH_ARGUMENT:
                index += 1
            continue
        for at, letter in enumerate(arg[1:], start=2):
            if letter in "cm":
                value = arg[at:] if at < len(arg) else (args[index] if index < len(args) else "")
                return value if letter == "m" and value else None
            if letter in _SHORT_WITH_ARGUMENT:
                if at == len(arg):  # its argument is the next one
                    index += 1
                break
    return None


def torch_launcher(argv: Sequence[str]) -> str | None:
    """How ``argv`` runs torch's launcher, as a refusal names it (``torchrun``, ``python -m
    torch.distributed.run``), or ``None`` when it does not."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name == TORCHRUN:
        return TORCHRUN
    if PYTHON_NAME.match(name):
        module = python_module(argv[1:])
        if module in TORCHRUN_MODULES:
            return f"python -m {module}"
    return None


def torchrun_refusal(argv: Sequence[str]) -> str | None:
    """The one line a command that runs torch's launcher is refused with (naming the form that
    runs: the script itself, its ranks as ``--gpus``), or ``None`` for any other command."""
    launcher = torch_launcher(argv)
    if launcher is None:
        return None
    script = next((arg for arg in argv[1:] if arg.endswith(".py")), "train.py")
    return (
        f"{launcher} would start ranks of its own inside the job; submit the script itself "
        f"with the number of ranks as --gpus (pollux-local submit --gpus N {script} ...): "
        "the daemon starts each rank with torchrun's environment"
    )
