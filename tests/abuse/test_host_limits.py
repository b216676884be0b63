"""Host memory and CPU limits (``submit --mem``, ``--cpus``) on a root daemon of the lab
install, jobs of ordinary Unix users (``alice``, ``bob``), this machine's real cgroups:

* alice's job with ``--mem 64M`` that fills 300 MB is killed alone, not retried, its reason
  naming the limit, while bob's job beside it succeeds; its cgroups are gone afterwards;
* a ``--cpus 0.5`` job runs in its own cgroup with the quota written (read while it runs) and
  one OpenMP thread, it cannot move itself out (the group is root's), and the group is removed
  when it ends;
* ``[limits] default_mem`` gives a job submitted without ``--mem`` its limit;
* where the cgroups cannot be written (``cgroup_root`` pointing nowhere), ``--mem`` and
  ``--cpus`` are refused in one line, and a configured default only warns once in the log.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pollux_local.launch import cgroups
from tests.abuse.lab import Lab, cli, job, submit, wait_state
from tests.labinstall import LabUser, one_line, wait_until

pytestmark = [pytest.mark.timeout(240)]

#: Fills 300 MB (every page written), then lingers a second.
HOG = "b = b'x' * (300 << 20); import time; time.sleep(1)"


def usable_cgroups() -> cgroups.Support:
    support = cgroups.detect()
    if support.memory is None or support.cpu is None:
        pytest.skip(f"no writable memory and cpu cgroups here: {support.memory_why}")
    return support


def job_cgroups(pid: int) -> dict[str, str]:
    """Controller -> the cgroup (path) process ``pid`` is in."""
    return cgroups.own_cgroups(Path(f"/proc/{pid}/cgroup").read_text())


def cgroup_dir(support: cgroups.Support, controller: str, path: str) -> Path:
    """Where the cgroup ``path`` of ``controller`` lies under the mounted hierarchy."""
    root = Path(cgroups.CGROUP_ROOT)
    return root / path.lstrip("/") if support.version == 2 else root / controller / path.lstrip("/")


def job_of_group(name: str) -> str | None:
    """The job id of a job cgroup's name ``job-<daemon>-<id>-<incarnation>-<token>``."""
    found = re.fullmatch(r"job-[0-9a-f]{8}-([0-9]+)-[0-9]+-[0-9a-f]{8}", name)
    return found.group(1) if found else None


def test_a_job_over_its_memory_is_killed_alone(lab: Lab, alice: LabUser, bob: LabUser) -> None:
    support = usable_cgroups()
    daemon = lab.daemon(devices="cpu:2")
    python = str(lab.install.python)
    hog = submit(alice, daemon, lab, "--mem", "64M", "--retries", "2", "--", python, "-c", HOG)
    mark = lab.work / "neighbour"
    neighbour = submit(
        bob, daemon, lab, "--", python, "-c",
        f"b = b'y' * (100 << 20); import time; time.sleep(3); open({str(mark)!r}, 'w').write('ok')",
    )  # fmt: skip
    failed = wait_state(daemon, hog, ("failed", "succeeded"), 120)
    assert failed["state"] == "failed"
    assert failed["reason"] == (
        "killed: over its host memory limit --mem 64M: a retry would be killed again; not retried"
    )
    assert wait_state(daemon, neighbour, ("succeeded", "failed"), 120)["state"] == "succeeded"
    assert mark.read_text() == "ok"
    assert job(daemon, hog)["restarts"] == 0  # --retries 2, yet not run again
    base = support.memory
    assert base is not None
    assert not [p for p in Path(base).glob("pollux-local/job-*") if job_of_group(p.name) == hog]
    shown = cli(alice, daemon, "show", hog)
    assert "killed: over its host memory limit --mem 64M" in shown.stdout


def test_a_cpu_quota_is_written_and_removed_with_the_job(lab: Lab, alice: LabUser) -> None:
    support = usable_cgroups()
    daemon = lab.daemon(devices="cpu:1", extra_toml='[limits]\ndefault_mem = "512M"\n')
    pid_file, escape = lab.work / "pid", lab.work / "escape"
    top = Path(cgroups.CGROUP_ROOT) / ("" if support.version == 2 else "cpu") / "cgroup.procs"
    script = lab.script(
        "quota.sh",
        f"echo $OMP_NUM_THREADS > {lab.work}/threads\n"
        # the job tries to leave its group: the group is root's, so the write is refused
        f"if echo $$ > {top} 2>/dev/null; then echo moved; else echo refused; fi > {escape}\n"
        f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}\n"  # written last
        "exec sleep 60\n",
    )
    job_id = submit(alice, daemon, lab, "--cpus", "0.5", "--", str(script))
    wait_state(daemon, job_id, ("running",), 60)
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "pid"))
    assert escape.read_text().strip() == "refused"
    assert (lab.work / "threads").read_text().strip() == "1"  # its share, not the machine's
    groups = job_cgroups(pid)
    # (on v2 the replica is in a group of its own below the limits': the fence's, replica-PID)
    cpu_path = re.sub(r"/replica-[0-9]+$", "", groups["" if support.version == 2 else "cpu"])
    memory_path = re.sub(r"/replica-[0-9]+$", "", groups["" if support.version == 2 else "memory"])
    for path in (cpu_path, memory_path):  # job-<daemon>-<id>-<incarnation>-<token>
        assert re.fullmatch(rf".*/pollux-local/job-[0-9a-f]{{8}}-{job_id}-0-[0-9a-f]{{8}}", path), (
            groups
        )
    cpu_dir = cgroup_dir(support, "cpu", cpu_path)
    memory_dir = cgroup_dir(support, "memory", memory_path)
    if support.version == 2:
        assert (cpu_dir / "cpu.max").read_text().split() == ["50000", "100000"]
        assert (memory_dir / "memory.max").read_text().strip() == str(512 << 20)
    else:
        assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (cpu_dir / "cpu.cfs_period_us").read_text().strip() == "100000"
        assert (memory_dir / "memory.limit_in_bytes").read_text().strip() == str(512 << 20)
    for path in (
        cpu_dir,
        cpu_dir / "cgroup.procs",
        memory_dir,
        memory_dir / "memory.limit_in_bytes",
    ):
        if path.exists():  # root's, written by no one else: the job cannot loosen its limits
            info = path.stat()
            assert info.st_uid == 0 and not info.st_mode & 0o022, path
    done = cli(alice, daemon, "cancel", job_id)
    assert done.returncode == 0, done.stderr
    wait_state(daemon, job_id, ("cancelled",), 60)
    wait_until(lambda: not cpu_dir.exists() and not memory_dir.exists(), 30, "the groups to go")


def test_limits_are_refused_where_cgroups_are_not_writable(
    lab: Lab, alice: LabUser, tmp_path: Path
) -> None:
    nowhere = tmp_path / "no-cgroups"
    daemon = lab.daemon(extra_toml=f'[limits]\ncgroup_root = "{nowhere}"\ndefault_mem = "1G"\n')
    why = f"no cgroup v1 memory or cpu controller and no cgroup v2 hierarchy under {nowhere}"
    for option, value in (("--mem", "64M"), ("--cpus", "0.5")):
        done = cli(alice, daemon, "submit", "--workdir", str(lab.work), option, value, "true")
        assert done.returncode != 0, done.stdout
        assert one_line(done.stderr) == (
            f"pollux-local: error: {option}: cgroups are not writable here ({why})"
        )
    # without the options the job runs; the default is not enforced, said once in the log
    for _ in range(2):
        ran = submit(alice, daemon, lab, "--", "true")
        assert wait_state(daemon, ran, ("succeeded", "failed"), 60)["state"] == "succeeded"
    log = (daemon.state_dir / "daemon.log").read_text()
    assert (
        log.count(f"[limits] default_mem is not applied: cgroups are not writable here ({why})")
        == 1
    )
