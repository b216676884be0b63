"""SQLite state and TOML config: durability, errors that name the problem."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import msgspec
import pytest

from pollux_local.api.report import JobReport
from pollux_local.api.spec import decode_spec
from pollux_local.api.states import TERMINAL_STATES, TRANSITIONS, DecisionKind, JobState
from pollux_local.daemon.config import load_config, parse_devices
from pollux_local.daemon.state import (
    MIGRATIONS,
    SCHEMA_VERSION,
    DecisionEntry,
    IllegalTransition,
    StateStore,
)
from pollux_local.errors import PolluxError


def add(store: StateStore, name: str) -> int:
    job = store.add_job(
        name=name, owner_uid=1, owner_gid=1, owner_name="ann",
        spec={"argv": ["x"], "workdir": "/tmp"}, priority=0, submit_time=1.0, env={"A": "1"},
    )  # fmt: skip
    return job.id


def test_jobs_survive_reopen_and_updates_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.db")
    ids = [add(store, f"j{i}") for i in range(3)]
    store.transition(ids[1], JobState.RUNNING, 2.0, None, placement={"n": ["cpu:0"]})
    store.update_job(ids[1], report={"progress": 2})
    store.record_decision(ids[1], 2.0, "start", "why", {"n": ["cpu:0"]}, {"replicas": 1})
    store.close()
    again = StateStore(tmp_path / "s.db")
    jobs = again.jobs()
    assert [j.name for j in jobs] == ["j0", "j1", "j2"]
    assert jobs[1].placement == {"n": ["cpu:0"]} and jobs[1].report == JobReport(progress=2.0)
    assert jobs[1].env is None  # listings leave the (large) environments out
    loaded = again.get_job(ids[1])
    assert loaded is not None and loaded.env == {"A": "1"}
    assert [j.id for j in again.jobs(["queued"])] == [ids[0], ids[2]]
    decisions = again.decisions(ids[1])
    assert decisions[0]["reason"] == "why" and decisions[0]["batch"] == {"replicas": 1}
    with pytest.raises(KeyError):
        again.update_job(ids[0], owner="mallory")


def test_database_is_in_wal_mode(tmp_path: Path) -> None:
    StateStore(tmp_path / "s.db").close()
    mode = sqlite3.connect(tmp_path / "s.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_parse_devices() -> None:
    assert parse_devices("cpu:2") == ("cpu:0", "cpu:1")
    assert parse_devices("cuda:0,3") == ("cuda:0", "cuda:3")
    assert parse_devices(["cuda:1"]) == ("cuda:1",)
    for bad in ("cpu:0", "cpu:x", "gpu:1", "cuda:0,0", "4"):
        with pytest.raises(PolluxError):
            parse_devices(bad)


def test_embedded_default_has_devices() -> None:
    config = load_config(None, "cpu:3")
    assert config.total_devices == 3 and config.nodes[0].is_local
    assert load_config(None).total_devices >= 1  # GPUs via NVML, else cpu:2


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[scheduler]\npolicy = "fifo"\ninterval_s = 2\n[daemon]\nmax_retries = 1\n'
        '[nodes.box]\ndevices = "cpu:2"\n'
        '[nodes.far]\nhost = "far.example"\ndevices = 4\ndevice_type = "cuda"\n'
    )
    config = load_config(path)
    assert config.policy == "fifo" and config.interval_s == 2 and config.max_retries == 1
    assert [n.name for n in config.nodes] == ["box", "far"]
    assert config.nodes[1].devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert not config.nodes[1].is_local and config.nodes[0].is_local


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[scheduler\n", "not valid TOML"),
        ('[scheduler]\npolicy = "best"\n', "policy must be one of"),
        ("[scheduler]\ninterval_s = -1\n", "interval_s must be at least"),
        ('[[nodes]]\nhost = "far"\n', "remote node needs 'devices'"),
        ("[bogus]\n", "unknown section"),
        (
            '[nodes.a]\ndevices = "cpu:2"\n[nodes.b]\ndevices = "cpu:1"\n',
            "device cpu:0 is listed by both local nodes a and b",
        ),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(PolluxError, match=fragment) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(PolluxError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_remote_nodes_reach_the_ssh_launcher(tmp_path: Path) -> None:
    from pollux_local.daemon.executor import make_ssh_launcher

    path = tmp_path / "c.toml"
    path.write_text(
        '[daemon]\ncheckpoint_root = "/shared/ckpt"\n'
        '[nodes.here]\ndevices = "cpu:1"\n'
        '[nodes.far]\nhost = "me@far"\ndevices = "cpu:2"\ngloo_ifname = "eth0"\n'
        'ssh_options = ["-p", "2222"]\n'
    )
    config = load_config(path)
    assert config.checkpoint_root == "/shared/ckpt"
    launcher = make_ssh_launcher(config, tmp_path)
    far = launcher.nodes["far"]  # type: ignore[attr-defined]
    assert (far.host, far.devices, far.gloo_ifname) == ("me@far", ("cpu:0", "cpu:1"), "eth0")
    assert far.ssh_options == ("-p", "2222") and "here" not in launcher.nodes  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("ssh_options = 5", "node far: 'ssh_options' must be a list of strings"),
        ("gloo_ifname = 1", "node far: 'gloo_ifname' must be a string"),
        ('host = "-oProxyCommand=x"\n', "node far: 'host' must be an ssh destination"),
        ('adress = "10.0.0.2"', "unknown key 'adress' in [nodes.far] (did you mean 'address'?)"),
    ],
)
def test_a_node_setting_the_ssh_launcher_refuses_is_refused_when_the_config_is_read(
    tmp_path: Path, setting: str, expected: str
) -> None:
    path = tmp_path / "c.toml"
    host = "" if setting.startswith("host") else 'host = "me@far"\n'
    path.write_text(f'[nodes.far]\n{host}devices = "cpu:2"\n{setting}\n')
    with pytest.raises(PolluxError) as refused:
        load_config(path)
    message = str(refused.value)
    assert expected in message and "\n" not in message and message.startswith(str(path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[scheduler]\ninterval = 5\n", "unknown key 'interval' in [scheduler] (did you mean 'interval_s'?)"),
        ("[daemon]\nmax_retry = 5\n", "unknown key 'max_retry' in [daemon] (did you mean 'max_retries'?)"),
        ("[limits]\nzzz = 1\n", "unknown key 'zzz' in [limits] (known: "),
    ],
)  # fmt: skip
def test_unknown_config_keys_are_refused_with_a_suggestion(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(PolluxError, match=re.escape(expected)):
        load_config(path)


# --- environments and commands stored once (migration 4) -------------------------------------


def _db_bytes(store: StateStore) -> int:
    """The database's pages after a checkpoint (what its tables and indexes take)."""
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    return int(pages) * int(store.db.execute("PRAGMA page_size").fetchone()[0])


def test_an_arrays_environment_and_command_are_stored_once(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.db")
    env = {f"BIG{i}": str(i) * 100_000 for i in range(10)}  # ~1 MB
    argv = ["/bin/echo", "y" * 100_000]
    before = _db_bytes(store)
    spec = decode_spec({"argv": argv, "workdir": "/tmp"})
    tasks = [msgspec.structs.replace(spec, array_index=i) for i in range(100)]
    jobs = store.add_jobs(
        name=[f"t[{i}]" for i in range(100)], owner_uid=1, owner_gid=1, owner_name="ann",
        specs=tasks, priority=0, submit_time=1.0, env=env, array=True,
    )  # fmt: skip
    assert _db_bytes(store) - before < 2_000_000  # not 100 copies of 1.1 MB
    assert all(job.env is None for job in jobs)  # the reply's records leave it out
    listed = store.jobs(["queued"])
    assert [job.spec.argv for job in listed] == [argv] * 100
    assert [job.spec.array_id for job in listed] == [str(jobs[0].id)] * 100
    assert all(job.env is None for job in listed)  # a pass never reads the environment
    full = store.get_job(jobs[57].id)
    assert full is not None and full.env == env and full.spec.array_index == 57
    # a hundred restarts share the original's environment and command
    before = _db_bytes(store)
    for _ in range(100):
        store.add_job(
            name="again", owner_uid=1, owner_gid=1, owner_name="ann", spec=full.spec,
            priority=0, submit_time=2.0, held=True, env_of=full.id,
        )  # fmt: skip
    assert _db_bytes(store) - before < 500_000
    assert store.count_active(1) == 200 and store.count_active(2) == 0
    # an edited command is stored as its own blob; the others keep theirs
    store.update_job(jobs[0].id, spec=msgspec.structs.replace(full.spec, argv=["/bin/true"]))
    reopened = StateStore(tmp_path / "s.db")
    assert [job.spec.argv for job in reopened.jobs()[:2]] == [["/bin/true"], argv]
    assert reopened.get_job(jobs[1].id).env == env  # type: ignore[union-attr]


def test_migration_4_keeps_the_jobs_of_an_older_database(tmp_path: Path) -> None:
    """A version-3 database (environments and commands inline in each row) is migrated in
    place: its jobs read as before, and a restart of one moves its environment into a blob."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    for _number, _what, sql in MIGRATIONS[:3]:
        db.executescript(sql)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '3')")
    old_spec = '{"argv": ["python", "train.py", "--lr", "0.1"], "workdir": "/w", "min_gpus": 2}'
    db.execute(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, env, submit_time,"
        " end_time) VALUES ('kept', 7, 7, 'ann', 'succeeded', ?, '{\"SEED\": \"42\"}', 1.0, 2.0)",
        (old_spec,),
    )
    db.execute(
        "INSERT INTO decisions (time, job_id, kind, reason) VALUES (1.0, 1, 'submitted', 'by ann')"
    )
    db.commit()
    db.close()
    path.chmod(0o600)

    store = StateStore(path)
    assert store.version == SCHEMA_VERSION == 9
    [kept] = store.jobs()
    assert kept.name == "kept" and kept.state.value == "succeeded"
    assert kept.spec.argv == ["python", "train.py", "--lr", "0.1"] and kept.spec.min_gpus == 2
    loaded = store.get_job(kept.id)
    assert loaded is not None and loaded.env == {"SEED": "42"}
    assert store.decisions(kept.id)[0]["reason"] == "by ann"
    again = store.add_job(
        name="kept", owner_uid=7, owner_gid=7, owner_name="ann", spec=loaded.spec,
        priority=0, submit_time=3.0, env_of=kept.id,
    )  # fmt: skip
    assert store.get_job(again.id).env == {"SEED": "42"}  # type: ignore[union-attr]
    assert store.get_job(kept.id).env == {"SEED": "42"}  # type: ignore[union-attr]
    refs = store.db.execute("SELECT env_ref FROM jobs ORDER BY id").fetchall()
    assert refs[0][0] is not None and refs[0][0] == refs[1][0]  # one blob, both reference it


# --- the one way a job's state changes ---------------------------------------------------------


def test_the_state_machines_docstring_and_its_table_agree() -> None:
    documented: dict[JobState, frozenset[JobState]] = {}
    for line in (JobState.__doc__ or "").splitlines():
        match = re.fullmatch(r"\s*(\w+)\s+->\s+(.+)", line)
        if match:
            targets = match[2].strip()
            documented[JobState(match[1])] = frozenset(
                () if targets == "(none)" else (JobState(t.strip()) for t in targets.split(","))
            )
    assert documented == dict(TRANSITIONS)
    assert set(TRANSITIONS) == set(JobState)
    assert all(not TRANSITIONS[state] for state in TERMINAL_STATES)  # an end is final
    assert JobState.QUEUED.can_become(JobState.RUNNING)
    assert not JobState.HELD.can_become(JobState.RUNNING)


def test_an_illegal_transition_is_refused_in_one_line_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "s.db")
    job_id = add(store, "j")
    store.transition(
        job_id, JobState.CANCELLED, 5.0, DecisionEntry(DecisionKind.CANCELLED, "by ann"),
        reason="cancelled", end_time=5.0,
    )  # fmt: skip
    before = store.get_job(job_id), store.decisions(job_id), store.pending_ends()
    with pytest.raises(IllegalTransition) as caught:
        store.transition(
            job_id, JobState.RUNNING, 6.0, DecisionEntry(DecisionKind.START, "late"),
            placement={"n": ["cpu:0"]}, reason="late",
        )  # fmt: skip
    assert str(caught.value) == f"job {job_id} cannot become running: it is cancelled"
    assert "\n" not in str(caught.value)
    assert (store.get_job(job_id), store.decisions(job_id), store.pending_ends()) == before
    with pytest.raises(ValueError, match="transition"):  # nothing bypasses the machine
        store.update_job(job_id, state=JobState.RUNNING)
    assert store.get_job(job_id) == before[0]


def test_a_transition_and_its_decision_are_one_transaction(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.db")
    job_id = add(store, "j")
    store.transition(job_id, JobState.RUNNING, 2.0, None, placement={"n": ["cpu:0"]})
    original = store.record_decision

    def failing(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    store.record_decision = failing  # type: ignore[method-assign]
    with pytest.raises(sqlite3.OperationalError):
        store.transition(
            job_id, JobState.FAILED, 3.0, DecisionEntry(DecisionKind.FAILED, "exit 1"),
            reason="exit 1", end_time=3.0, placement={},
        )  # fmt: skip
    job = store.get_job(job_id)
    assert job is not None and job.state == JobState.RUNNING and job.placement  # rolled back
    assert store.pending_ends() == [] and store.decisions(job_id) == []

    store.record_decision = original  # type: ignore[method-assign]
    assert store.transition(
        job_id, JobState.FAILED, 3.0, DecisionEntry(DecisionKind.FAILED, "exit 1"),
        reason="exit 1", end_time=3.0, placement={},
    )  # fmt: skip
    job = store.get_job(job_id)
    assert job is not None and job.state == JobState.FAILED and job.end_time == 3.0
    assert [(d["kind"], d["reason"]) for d in store.decisions(job_id)] == [("failed", "exit 1")]
    assert [(e.job_id, e.state, e.reason) for e in store.pending_ends()] == [
        (job_id, JobState.FAILED, "exit 1")
    ]


def test_a_requeue_of_a_job_no_longer_placed_leaves_it_as_it_is(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.db")
    running, ended = add(store, "a"), add(store, "b")
    for job_id in (running, ended):
        store.transition(job_id, JobState.RUNNING, 1.0, None, placement={"n": ["cpu:0"]})
    store.transition(ended, JobState.SUCCEEDED, 2.0, None, end_time=2.0)
    assert store.requeue_if_placed(running, "gone", 3.0)
    assert not store.requeue_if_placed(ended, "gone", 3.0)
    assert not store.requeue_if_placed(999, "gone", 3.0)
    states = store.states_of([running, ended])
    assert states == {running: JobState.QUEUED, ended: JobState.SUCCEEDED}
    assert [d["kind"] for d in store.decisions(running)] == ["requeued"]
    assert store.decisions(ended) == []


def test_a_jobs_decisions_are_kept_to_the_newest_limit(tmp_path: Path) -> None:
    """A user's loop of edits (or holds and releases) on one active job added a decision row
    each, 850 a second, for as long as the job lived; each job keeps its newest
    ``DECISIONS_LIMIT`` (``show`` reads 100), the others' are untouched."""
    from pollux_local.daemon.state.schema import DECISIONS_LIMIT

    store = StateStore(tmp_path / "s.db")
    busy, other = add(store, "busy"), add(store, "other")
    store.record_decision(other, 0.5, DecisionKind.HELD, "held by ann")
    for number in range(DECISIONS_LIMIT + 50):
        store.record_decision(busy, 1.0 + number, DecisionKind.EDITED, f"edit {number}")
    kept = store.db.execute(
        "SELECT MIN(time), COUNT(*) FROM decisions WHERE job_id = ?", (busy,)
    ).fetchone()
    assert tuple(kept) == (1.0 + 50, DECISIONS_LIMIT)
    assert store.decisions(busy, limit=1)[0]["reason"] == f"edit {DECISIONS_LIMIT + 49}"
    assert [d["reason"] for d in store.decisions(other)][-1] == "held by ann"


def test_what_an_owners_jobs_keep_is_counted_from_an_index(tmp_path: Path) -> None:
    """``stored_bytes`` sums each active row's size through the index ``jobs_owner_kept``
    (migration 6) and never reads the rows: 1,000 jobs with long ``--notify`` lists took 86
    ms a count when it did.  The query's expression must match the index's."""
    store = StateStore(tmp_path / "s.db")
    for name in ("a", "b"):
        add(store, name)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    kept = store.stored_bytes(1)
    store.db.set_trace_callback(None)
    assert kept > 0
    plans = [
        " ".join(str(row[3]) for row in store.db.execute(f"EXPLAIN QUERY PLAN {sql}"))
        for sql in statements
        if sql.lstrip().startswith("SELECT") and "LENGTH(spec)" in sql
    ]
    assert plans and all("jobs_owner_kept" in plan for plan in plans), plans


def test_a_change_of_state_is_on_the_disk_before_it_returns(tmp_path: Path) -> None:
    """A job's end (after which its run file is removed) and an acknowledged cancel or hold
    are committed with ``synchronous=FULL``: with ``NORMAL`` a power cut could undo them, and
    a finished job run again.  Other writes stay ``NORMAL``."""
    store = StateStore(tmp_path / "state.db")
    job_id = add(store, "a")
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)

    def level() -> int:
        return int(store.db.execute("PRAGMA synchronous").fetchone()[0])

    store.transition(job_id, JobState.RUNNING, 1.0, None)
    full = statements.index("PRAGMA synchronous=FULL")
    assert full < statements.index("COMMIT") < statements.index("PRAGMA synchronous=NORMAL")
    assert level() == 1  # NORMAL again
    statements.clear()
    store.update_job(job_id, reason="x")
    assert "PRAGMA synchronous=FULL" not in statements


def test_make_durable_syncs_the_write_ahead_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes committed without a sync each are on the disk once ``make_durable`` returns:
    WAL keeps them in the ``-wal`` file, which it fsyncs."""
    import os

    from pollux_local.daemon.state import base

    store = StateStore(tmp_path / "state.db")
    job_id = add(store, "a")
    store.transition(job_id, JobState.HELD, 1.0, None, durable=False)
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(base.os, "fsync", fsync)
    store.make_durable()
    assert synced == [f"{tmp_path / 'state.db'}-wal"]
