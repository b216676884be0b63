"""The lists a newcomer reads in docs/architecture.md stay true to the code: the table of
requests (every type of ``api.messages.REQUEST_TYPES``, each with the handler ``dispatch``
calls) and the tables of ``POLLUX_*`` variables (every one the package sets or reads)."""

from __future__ import annotations

import ast
import inspect
import re
import typing
from importlib import import_module
from pathlib import Path

import pollux_local
from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.messages import REQUEST_TYPES
from pollux_local.daemon import dispatch

PACKAGE = Path(pollux_local.__file__).resolve().parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
#: A variable's name as the code spells it (``POLLUX_`` alone, a prefix, is not one).
VARIABLE = re.compile(r"POLLUX_[A-Z0-9_]*[A-Z0-9]")


def section(heading: str) -> str:
    """The text of architecture.md under ``heading`` up to the next heading of any level."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"^#+ ", text[start:], flags=re.MULTILINE)
    return text[start : start + following.start()] if following else text[start:]


def table_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (header and rule left out)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def first_column_variables(heading: str) -> set[str]:
    """The ``POLLUX_*`` names of the first column of the table under ``heading``."""
    rows = table_rows(section(heading))
    assert rows, f"no table under {heading!r}"
    return {name for row in rows for name in VARIABLE.findall(row[0])}


# --- requests -------------------------------------------------------------------------------


def request_table() -> dict[str, tuple[str, str]]:
    """type -> (class, handler) as the architecture page's table of requests says."""
    rows = table_rows(section("### Client ↔ daemon protocol"))
    table = {}
    for row in rows:
        kind, cls, handler = (cell.strip("`") for cell in row[:3])
        assert kind not in table, f"{kind} twice in the table of requests"
        table[kind] = (cls, handler)
    return table


def dispatched_handlers() -> dict[str, str]:
    """Request class name -> ``module.function`` that ``daemon/dispatch.py`` calls for it."""
    tree = ast.parse(inspect.getsource(dispatch))
    found: dict[str, str] = {}
    for case in (node for node in ast.walk(tree) if isinstance(node, ast.match_case)):
        pattern = case.pattern
        assert isinstance(pattern, ast.MatchClass) and isinstance(pattern.cls, ast.Name)
        calls = [
            node.func
            for statement in case.body
            for node in ast.walk(statement)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        ]
        assert len(calls) == 1, f"case {pattern.cls.id}: one handler call expected"
        func = calls[0]
        assert isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        found[pattern.cls.id] = f"{func.value.id}.{func.attr}"
    return found


def test_the_table_of_requests_lists_every_request_type() -> None:
    table = request_table()
    assert set(table) == set(REQUEST_TYPES), (
        "docs/architecture.md's table of requests and api.messages.REQUEST_TYPES differ: "
        f"missing {sorted(set(REQUEST_TYPES) - set(table))}, "
        f"unknown {sorted(set(table) - set(REQUEST_TYPES))}"
    )
    for kind, (cls, _) in table.items():
        assert REQUEST_TYPES[kind].__name__ == cls, kind


def test_every_request_type_has_the_handler_the_table_names() -> None:
    dispatched = dispatched_handlers()
    for kind, (cls, handler) in request_table().items():
        assert dispatched.get(cls) == handler, (
            f"{kind}: the table names {handler}, dispatch calls {dispatched.get(cls)}"
        )
        module_name, function_name = handler.split(".")
        function = getattr(
            import_module(f"pollux_local.daemon.handlers.{module_name}"), function_name
        )
        hints = typing.get_type_hints(function)
        assert hints["request"] is REQUEST_TYPES[kind], f"{handler} does not take {cls}"
        assert hints["return"] is REQUEST_TYPES[kind].Reply, f"{handler} does not return its reply"


# --- POLLUX_* variables ----------------------------------------------------------------------


def variables_in_code() -> dict[str, list[str]]:
    """Every ``POLLUX_*`` name the package spells as a string (a variable it sets or reads),
    with the files that spell it; docstrings, messages and the Python names of ``__all__``
    (``sim.POLLUX_RULES``) are not counted."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        } | {
            id(name)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for name in ast.walk(node.value)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skipped
                and VARIABLE.fullmatch(node.value)
            ):
                found.setdefault(node.value, []).append(str(path.relative_to(PACKAGE.parent)))
    return found


def documented_variables() -> set[str]:
    return first_column_variables("### Launch environment (daemon → job)") | (
        first_column_variables("### Other `POLLUX_*` variables")
    )


def test_every_variable_the_code_uses_is_documented_and_back() -> None:
    code = variables_in_code()
    documented = documented_variables()
    undocumented = {name: files for name, files in code.items() if name not in documented}
    assert not undocumented, f"POLLUX_* variables missing from docs/architecture.md: {undocumented}"
    unused = documented - set(code)
    assert not unused, f"docs/architecture.md lists variables no code uses: {sorted(unused)}"


def test_the_launch_table_is_what_a_replica_gets() -> None:
    every_field = LaunchEnvironment(
        rank=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
        job_id="7",
        job_dir="/state/jobs/7",
        checkpoint_dir="/state/jobs/7/checkpoint",
        daemon_socket="/state/daemon.sock",
        local_batch=32,
        accum_steps=2,
        device="cpu",
        array_id="5",
        array_index=2,
        time_limit_s=3600.0,
        device_type="cpu",
        device_slowdown=2.0,
        gpu_memory_fraction=0.25,
        resize_file="/state/resize/7.json",
        resize_join=1,
        job_secret="0123456789abcdef0123456789abcdef",
    )
    given = {name for name in every_field.to_environ() if name.startswith("POLLUX_")}
    assert given == first_column_variables("### Launch environment (daemon → job)")
    assert LaunchEnvironment.from_environ(every_field.to_environ()) == every_field


def test_the_lists_fail_on_a_missing_entry() -> None:
    # the parsers see what they check: a row taken out of a table is missed
    rows = table_rows(section("### Client ↔ daemon protocol"))
    assert len(rows) == len(REQUEST_TYPES)
    launch = section("### Launch environment (daemon → job)")
    without = "\n".join(line for line in launch.splitlines() if "POLLUX_DEVICE_TYPE" not in line)
    names = {name for row in table_rows(without) for name in VARIABLE.findall(row[0])}
    assert "POLLUX_DEVICE_TYPE" not in names
    assert "POLLUX_DEVICE_TYPE" in variables_in_code()
