"""Launch specs: what one incarnation of a job runs (ranks, devices, the launch environment
of ``api.launch``, its host memory and CPU limits), the directories it needs, and the
launchers' own settings (SSH).

Host limits (``--mem``, ``--cpus``, else ``[limits] default_mem``/``default_cpus``) are
enforced with cgroups by this machine's launcher only.  :func:`cgroup_support` finds once per
``cgroup_root``/``cgroup_parent`` whether they can be written here; :func:`check_host_limits`
(called by ``jobrules.check_job``) refuses a job's own limits in one line where they
cannot be enforced or pass a cap; a default that cannot be enforced is dropped with one
warning in the log."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import pwd
import secrets
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pollux_local.api.errors import InvalidRequest, LimitExceeded
from pollux_local.api.launch import LaunchEnvironment, without_launch_variables
from pollux_local.api.spec import JobSpec
from pollux_local.core.types import BatchChoice
from pollux_local.daemon.auth import account_name
from pollux_local.daemon.auth import owner_gone as gone_why
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.jobfiles import job_dir_stat, make_owned_dir
from pollux_local.daemon.scheduler import Action
from pollux_local.daemon.state import JobRecord
from pollux_local.daemon.state.files import CHECKPOINT_KEY as STATE_CHECKPOINT_KEY
from pollux_local.errors import PolluxError
from pollux_local.launch import cgroups
from pollux_local.launch.base import (
    Launcher,
    LaunchSpec,
    ReplicaSlot,
    pick_master_port,
)
from pollux_local.launch.identity import id_args
from pollux_local.launch.local import memory_text, package_root
from pollux_local.launch.ssh.nodes import SshNodeConfig
from pollux_local.launch.userdirs import make_own_directory
from pollux_local.untrusted import one_line

log = logging.getLogger("pollux_local.daemon")


def build_launch_spec(
    job: JobRecord,
    action: Action,
    config: DaemonConfig,
    job_dir: Path,
    socket_path: Path,
    state_dir: Path,
) -> LaunchSpec:
    """The launch spec of one incarnation (ranks in node order, env per the contract);
    ``state_dir`` holds the key of checkpoint directory names (``checkpoint_key``)."""
    allocation = action.allocation
    order = [n for n in config.nodes if allocation.get(n.name)]
    slots: list[ReplicaSlot] = []
    for node_rank, node in enumerate(order):
        for local_rank, device in enumerate(allocation[node.name]):
            slots.append(ReplicaSlot(len(slots), node.name, device, local_rank, node_rank))
            spec = job.spec
    if config.checkpoint_root:
        checkpoint_dir = str(checkpoint_dir_under(Path(config.checkpoint_root), job, state_dir))
    else:
        checkpoint_dir = str(job_dir / "checkpoint")
    batch: BatchChoice | None = action.batch
    if not spec.elastic:
        batch = None  # a rigid job chooses its own batch: no POLLUX_LOCAL_BATCH for it
    on_cpu = all(slot.device.startswith("cpu") for slot in slots)
    limit, fraction = shared_gpu_memory(job, order, on_cpu)
    launch = LaunchEnvironment(
        world_size=len(slots),
        master_addr="127.0.0.1",
        master_port=pick_master_port(),
        job_secret=secrets.token_hex(16),
        job_id=job.job_id,
        restarts=job.restarts,
        job_dir=str(job_dir),
        checkpoint_dir=checkpoint_dir,
        daemon_socket=str(socket_path),
        num_nodes=len(order),
        local_batch=batch.local_batch if batch is not None else None,
        accum_steps=batch.accum_steps if batch is not None else None,
        device="cpu" if on_cpu else "cuda",
        pg_timeout_s=config.pg_timeout_s,
        array_id=spec.array_id,
        array_index=spec.array_index,
        time_limit_s=spec.time_limit_s,
        device_type=order[0].device_type if order else None,
        device_slowdown=order[0].slowdown if order else None,
        gpu_memory_limit=limit,
        gpu_memory_fraction=fraction,
    )
    # what describes a launch is the daemon's alone (a raw request may carry any of it): a
    # batch choice, a resize to join, a shared device's memory cap
    env = without_launch_variables(job.env or {})
    env.update(launch.common_environ())
    env.setdefault("PYTHONUNBUFFERED", "1")
    local = bool(order) and all(node.is_local for node in order)
    limits = host_limits(spec, config) if local else None
    busiest = max((len(devices) for devices in allocation.values()), default=1)
    if limits is not None and limits.cpus:  # no more threads per replica than its CPU share
        env.setdefault("OMP_NUM_THREADS", str(max(1, int(limits.cpus // max(1, busiest)))))
    if on_cpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // busiest)))
    run_as = None
    run_as_uid = None
    if os.geteuid() == 0 and job.owner_uid != 0:
        run_as, run_as_uid = job.owner_name, job.owner_uid
    return LaunchSpec(
        job_id=job.job_id,
        argv=list(spec.argv),
        workdir=Path(spec.workdir),
        env=env,
        slots=slots,
        log_dir=job_dir,
        run_as=run_as,
        run_as_uid=run_as_uid,
        limits=limits,
        umask=spec.umask,
        stdin=spec.stdin,
    )


# --- host memory and CPU limits -------------------------------------------------------------------

#: What :func:`cgroup_support` found, per (``cgroup_root``, ``cgroup_parent``).
_support: dict[tuple[str, str | None], cgroups.Support] = {}
#: The defaults already warned about (not enforceable here).
_warned: set[tuple[str, str | None, str]] = set()


def cgroup_support(config: DaemonConfig) -> cgroups.Support:
    """Whether this machine's cgroups can enforce limits (found once per root and parent)."""
    key = (config.cgroup_root, config.cgroup_parent)
    found = _support.get(key)
    if found is None:
        found = cgroups.detect(config.cgroup_root, config.cgroup_parent)
        _support[key] = found
        if found.memory is not None or found.cpu is not None:
            log.info(
                "cgroups v%d: memory under %s, cpu under %s",
                found.version, found.memory or "-", found.cpu or "-",
            )  # fmt: skip
    return found


def host_limits(spec: JobSpec, config: DaemonConfig) -> cgroups.Limits | None:
    """The limits of a job starting on this machine: its own, else the config's defaults (a
    default this machine cannot enforce is dropped, with one warning in the log)."""
    memory = spec.host_memory
    cpus = spec.cpus
    if memory is None and cpus is None and not (config.default_host_memory or config.default_cpus):
        return None
    support = cgroup_support(config)
    for controller, key, default in (
        ("memory", "default_mem", config.default_host_memory),
        ("cpu", "default_cpus", config.default_cpus),
    ):
        mine = memory if controller == "memory" else cpus
        if mine is not None or default is None:
            continue
        if support.base(controller) is None:
            warned = (config.cgroup_root, config.cgroup_parent, key)
            if warned not in _warned:
                _warned.add(warned)
                log.warning(
                    "[limits] %s is not applied: cgroups are not writable here (%s)",
                    key, support.why(controller),
                )  # fmt: skip
        elif controller == "memory":
            memory = int(default)
        else:
            cpus = float(default)
    if memory is None and cpus is None:
        return None
    return cgroups.Limits(support, memory=memory, cpus=cpus)


def check_host_limits(spec: JobSpec, config: DaemonConfig) -> None:
    """A job's own ``--mem``/``--cpus``: within ``[limits] max_mem``/``max_cpus`` and this
    machine, only for a job that cannot be placed on a remote node, and only where the
    cgroups can be written (:class:`InvalidRequest`, :class:`LimitExceeded`: one line)."""
    asked = [
        (option, controller, value)
        for option, controller, value in (
            ("--mem", "memory", spec.host_memory),
            ("--cpus", "cpu", spec.cpus),
        )
        if value is not None
    ]
    if not asked:
        return
    option = asked[0][0]
    remote = [
        node.name
        for node in config.nodes
        if not node.is_local
        and (spec.constraint is None or spec.constraint.allows_node(node.name, node.device_type))
    ]
    if remote:
        raise InvalidRequest(
            f"{option}: the job may be placed on remote node {remote[0]}, where host limits are"
            " not enforced (--constraint nodes=... keeps it on this machine)"
        )
    memory, cpus = spec.host_memory, spec.cpus
    most = config.max_host_memory
    if memory is not None and most is not None and memory > most:
        raise LimitExceeded(
            f"limit exceeded: --mem {memory_text(memory)} is more than {memory_text(most)},"
            " the most a job may ask for ([limits] max_mem)"
        )
    if cpus is not None and config.max_cpus is not None and cpus > config.max_cpus:
        raise LimitExceeded(
            f"limit exceeded: --cpus {cpus:g} is more than {config.max_cpus:g}, the most a job"
            " may ask for ([limits] max_cpus)"
        )
    have = os.cpu_count() or 1
    if cpus is not None and cpus > have:
        raise InvalidRequest(f"--cpus {cpus:g} is more than this machine's {have} CPUs")
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if memory is not None and memory > physical:
        raise InvalidRequest(
            f"--mem {memory_text(memory)} is more than this machine's memory"
            f" ({memory_text(physical)})"
        )
    support = cgroup_support(config)
    for option, controller, _ in asked:
        if support.base(controller) is None:
            raise InvalidRequest(
                f"{option}: cgroups are not writable here ({support.why(controller)})"
            )


def shared_gpu_memory(
    job: JobRecord, order: list[NodeConfig], on_cpu: bool
) -> tuple[int | None, float | None]:
    """A shared job on a GPU: its declared memory (the MPS limit) and, where the device's
    memory is known, that over it (the fraction its allocator is capped at)."""
    memory = job.spec.gpu_memory
    if not job.spec.shared or on_cpu or not memory or not order:
        return None, None
    total = order[0].device_memory
    return memory, (min(1.0, memory / total) if total else None)


async def prepare_dirs(
    job: JobRecord, spec: LaunchSpec, config: DaemonConfig, state_dir: Path, local: bool
) -> None:
    """Make the job's directory (the daemon's ``jobs/<id>``, given to the job's user) and,
    under a ``checkpoint_root`` of the daemon's, its checkpoint directory the same way.
    Nothing inside the job's directory: on this machine the job's supervisor makes the
    rest as the job's user; for remote nodes the checkpoint directory is made here by a
    ``mkdir`` run as the job's user."""
    jobs = state_dir / "jobs"
    with contextlib.suppress(FileExistsError):
        os.mkdir(jobs, 0o755)  # the server makes it; a bare state dir (tests) may lack it
    make_owned_dir(jobs, job.job_id, job.owner_uid, job.owner_gid)
    checkpoint = Path(spec.env["POLLUX_CHECKPOINT_DIR"])
    if config.checkpoint_root:
        try:
            make_owned_dir(checkpoint.parent, checkpoint.name, job.owner_uid, job.owner_gid)
        except OSError as exc:  # not a directory of the daemon's: the job's user makes it
            log.debug("job %s: checkpoint dir left to the job's user: %s", job.id, exc)
    if not local:
        await make_user_dir(job, checkpoint)


def checkpoint_dir_under(root: Path, job: JobRecord, state_dir: Path) -> Path:
    """The job's checkpoint directory under a ``checkpoint_root``: ``ROOT/<id>-<tag>``, the
    tag a keyed hash of the job's id (:func:`checkpoint_key`), so the same at every restart
    of the job and of the daemon, and one no other user can know before the job makes it:
    ids are sequential and shown to all, and under a root others may write to, a
    ``ROOT/<id>`` made first by another user would fail the job (``launch.userdirs``).  A
    ``ROOT/<id>`` already there that is the job's own user's (made before this naming) is
    kept, with the checkpoints in it."""
    legacy = root / job.job_id
    with contextlib.suppress(OSError):
        info = job_dir_stat(root, job.job_id)  # never entering a mount there
        if info.st_uid == job.owner_uid and (
            stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode)
        ):
            return legacy
    return root / checkpoint_name(job.job_id, checkpoint_key(state_dir))


def checkpoint_name(job_id: str, key: bytes) -> str:
    """``<id>-<tag>``: tag = BLAKE2b(id, key), 8 bytes in hex."""
    tag = hashlib.blake2b(job_id.encode(), key=key, digest_size=8).hexdigest()
    return f"{job_id}-{tag}"


#: the name of the daemon's key for checkpoint directory names, in its state dir (it goes
#: with the database whose job ids it names: ``state.files.set_aside``)
CHECKPOINT_KEY = STATE_CHECKPOINT_KEY
_checkpoint_keys: dict[str, bytes] = {}


def checkpoint_key(state_dir: Path) -> bytes:
    """The daemon's secret key for checkpoint directory names (``STATE_DIR/checkpoint.key``,
    0600, made once: written whole into a temporary file, then linked in place, so a crash
    leaves no empty key; never through a link)."""
    cached = _checkpoint_keys.get(str(state_dir))
    if cached is not None:
        return cached
    path = state_dir / CHECKPOINT_KEY
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        if not os.path.lexists(path):
            fd, temporary = tempfile.mkstemp(dir=state_dir, prefix=f".{CHECKPOINT_KEY}.")  # 0600
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_bytes(32))
                    fh.flush()
                    os.fsync(fh.fileno())
                with contextlib.suppress(FileExistsError):  # made meanwhile: that one is used
                    os.link(temporary, path)
            finally:
                os.unlink(temporary)
        with os.fdopen(os.open(path, flags), "rb") as fh:
            info = os.fstat(fh.fileno())
            key = fh.read(64)
    except OSError as exc:
        raise PolluxError(f"cannot read the daemon's key {path}: {exc.strerror or exc}") from None
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid != os.geteuid()
        or info.st_mode & 0o077
        or len(key) < 16
    ):
        raise PolluxError(
            f"the daemon's key {path} is not a private file of its own (0600, 32 bytes);"
            " remove it and the daemon makes a new one (jobs then checkpoint afresh)"
        )
    _checkpoint_keys[str(state_dir)] = key
    return key


def owner_gone(job: JobRecord) -> str | None:
    """Why the job cannot run as its owner (:func:`owner_missing`), or ``None``: what a start
    checks first."""
    return owner_missing(job.owner_uid, job.owner_name)


def owner_missing(
    owner_uid: int, owner_name: str, accounts: Callable[[int], str | None] = account_name
) -> str | None:
    """The one rule of a job's owner being gone: why a job of ``owner_name`` (uid
    ``owner_uid``) cannot run as them (a deleted Unix user, or a uid ``userdel`` freed that a
    new account now holds: ``auth.is_owner``), or ``None``: also for the daemon's own user
    (whose jobs run as it), and when the user database could not be read (the start then
    fails, or not, on its own).  A start fails the job by it (:func:`owner_gone`); a request
    that would queue a job again is refused by it (``jobrules.check_owner``).  ``accounts``:
    uid -> its account's name now (``auth.account_name``; tests fake users)."""
    if owner_uid == os.geteuid():
        return None
    try:
        return gone_why(owner_uid, owner_name, accounts)
    except OSError as exc:
        log.warning("cannot look up the owner uid %s of a job: %s", owner_uid, exc)
    return None


async def make_user_dir(job: JobRecord, path: Path) -> None:
    """``mkdir -p PATH`` as the job's user (as the daemon's own user when that is the job's,
    or when the daemon is not root), then the check that it is theirs alone
    (``launch.userdirs``), made as them too."""
    if os.geteuid() != 0 or job.owner_uid in (0, os.geteuid()):
        problem = make_own_directory(str(path))
    else:
        problem = await _make_as_owner(job, path)
    if problem is not None:
        raise PolluxError(f"refusing the checkpoint dir: {problem}")


async def _make_as_owner(job: JobRecord, path: Path) -> str | None:
    entry = pwd.getpwuid(job.owner_uid)
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    # started as root: it takes the user's effective ids itself, root staying its real uid,
    # so that the user cannot stop it while the pass waits for it
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-s", "-m", "pollux_local.launch.userdirs", str(path),
        *id_args(entry.pw_uid, entry.pw_gid, groups),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd="/",
        env={"PATH": "/usr/bin:/bin", "LANG": "C", "PYTHONPATH": package_root()},
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise PolluxError(f"mkdir {path} as {entry.pw_name} did not finish in 30 s") from None
    if proc.returncode == 0:
        return None
    said = out.decode(errors="replace").strip() or err.decode(errors="replace")
    return one_line(f"as {entry.pw_name}: {said}")


def make_ssh_launcher(config: DaemonConfig, state_dir: Path) -> Launcher:
    """The SSH launcher for the config's remote nodes (imported only when one is used)."""
    try:
        from pollux_local.launch.ssh import SshLauncher
    except ImportError:
        raise PolluxError("remote nodes need the SSH launcher (pollux_local.launch.ssh)") from None
    return SshLauncher(
        ssh_nodes(config),
        ssh_control_dir(state_dir),
        max_log_bytes=config.max_log_bytes,
        log_keep_free=config.log_keep_free,
    )


def ssh_control_dir(state_dir: Path) -> Path:
    """Where ssh keeps its shared connections: ``STATE_DIR/ssh``, or, when that path is too
    long for a Unix socket, a private directory named after the state dir (the SSH
    launcher names its exit records on the nodes after it) in a directory only this
    process's user (or root) may write to: ``/run`` for root, the user's runtime directory
    otherwise.  Where there is none, a directory of a name nobody can guess beforehand
    (``mkdtemp``, once per daemon process): a name in ``/tmp`` that anyone could take first
    would stop the daemon's SSH."""
    preferred = state_dir / "ssh"
    if len(str(preferred)) + 42 <= 104:
        return preferred
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()[:12]
    me = os.geteuid()
    bases = ["/run"] if me == 0 else [os.environ.get("XDG_RUNTIME_DIR", ""), f"/run/user/{me}"]
    for base in filter(None, bases):
        short = Path(base) / f"pollux-ssh-{digest}"
        if len(str(short)) + 42 > 104 or not _only_writable_by_me(Path(base)):
            continue
        with contextlib.suppress(OSError):
            os.mkdir(short, 0o700)
        if _private_dir(short):
            return short
    made = _SSH_CONTROL_DIRS.get(str(state_dir))
    if made is None or not _private_dir(made):
        made = Path(tempfile.mkdtemp(prefix=f"pollux-ssh-{me}-"))  # 0700, a fresh name
        _SSH_CONTROL_DIRS[str(state_dir)] = made
    return made


#: the control directories :func:`ssh_control_dir` made with ``mkdtemp``, by state dir
_SSH_CONTROL_DIRS: dict[str, Path] = {}


def _only_writable_by_me(path: Path) -> bool:
    """``path`` is a directory (no link) of root's or this user's that no one else may
    write to."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode) and info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o022
    )


def _private_dir(path: Path) -> bool:
    """``path`` is a directory (no link) of this user's that only they may enter."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def ssh_nodes(config: DaemonConfig) -> list[SshNodeConfig]:
    """The config's remote nodes as the SSH launcher takes them (checked as it was read)."""
    return [node.ssh for node in config.nodes if node.ssh is not None]
