"""The rules one job must keep under the daemon's config, whatever path it takes: a submit, an
edit, a release, a restart (through ``handlers.submit.validate_jobs``) and a start
(``loop.SchedulingLoop.hold_refused``: a job queued before a reload, or a restart of the daemon,
that tightened them is held, not started with what it asked then).  A job queued again (an
edit, a release, a restart) must also still have its owner (:func:`check_owner`)."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from pollux_local.api.errors import Conflict, InvalidRequest, LimitExceeded, PermissionDenied
from pollux_local.api.spec import Constraint, JobSpec
from pollux_local.daemon.auth import account_name, in_group
from pollux_local.daemon.commands import command_bytes
from pollux_local.daemon.config import AccountConfig, DaemonConfig
from pollux_local.daemon.executor.exits import most_retries
from pollux_local.daemon.executor.launchspec import check_host_limits, owner_missing
from pollux_local.durations import format_duration
from pollux_local.sizes import format_size


def check_job(spec: JobSpec, config: DaemonConfig, *, env_bytes: int = 0) -> JobSpec:
    """One job as it would be stored, against this daemon's config (:class:`InvalidRequest`,
    or :class:`LimitExceeded` for its size); the spec with its time limit settled."""
    check_shape(
        argv=spec.argv,
        workdir=spec.workdir,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        elastic=spec.elastic,
        config=config,
    )
    size = env_bytes + command_bytes(spec.argv)  # once per command, not per task and pass
    if size > config.max_command_bytes:
        raise LimitExceeded(
            f"limit exceeded: the job's command line and environment take {format_size(size)},"
            f" more than {format_size(config.max_command_bytes)}, the most a job may have"
            " ([limits] max_command_size)"
        )
    batch, max_batch = spec.batch_size, spec.max_batch_size
    if max_batch is not None and batch is None:
        raise InvalidRequest("max_batch_size needs batch_size")
    if max_batch is not None and batch is not None and max_batch < batch:
        raise InvalidRequest(f"max_batch_size {max_batch} is below batch_size {batch}")
    min_local, max_local = spec.min_local_batch, spec.max_local_batch
    if min_local is not None and max_local is not None and max_local < min_local:
        raise InvalidRequest(f"max_local_batch {max_local} is below min_local_batch {min_local}")
    check_sharing(spec, config)
    check_host_limits(spec, config)
    if spec.after_any and spec.after_one:
        raise InvalidRequest(
            "after_any (--after-any) and after_one (--after-one-of) cannot be combined:"
            " a job starts after all of its dependencies ended, or after one succeeded"
        )
    if spec.account is not None and configured_account(config, spec.account) is None:
        raise InvalidRequest(f"no account {spec.account!r}; {accounts_text(config)}")
    if spec.retries is not None and spec.retries > most_retries(config):
        raise LimitExceeded(
            f"limit exceeded: --retries {spec.retries} is more than {most_retries(config)}, the"
            " most a job may have (the larger of 10 and [daemon] max_retries)"
        )
    if spec.constraint is not None:
        check_constraint(spec.constraint, spec.min_gpus, config)
    limit = settle_time_limit(spec.time_limit_s, config)
    return spec if limit == spec.time_limit_s else msgspec.structs.replace(spec, time_limit_s=limit)


def configured_account(config: DaemonConfig, name: str) -> AccountConfig | None:
    """The config's ``[accounts.NAME]`` of that name, or ``None``."""
    return next((account for account in config.accounts if account.name == name), None)


def accounts_text(config: DaemonConfig) -> str:
    """What the config's accounts are, for a refusal's line."""
    names = ", ".join(account.name for account in config.accounts)
    return f"accounts: {names}" if names else "this daemon has no accounts ([accounts.NAME])"


def check_account(spec: JobSpec, config: DaemonConfig, owner_uid: int, owner_name: str) -> None:
    """A job charged to an account (``--account``) is one its owner may charge: a user it
    names, or a member of its ``unix_group`` (in the user and group databases, as
    ``auth.in_group`` reads them); :class:`PermissionDenied` in one line when not.  Checked
    whenever its owner's work is queued or changed (``handlers.submit.validate_jobs``: a
    submit, a restart, an edit, a release), so that a job held or queued while they could
    charge it does not go on charging it once they may not; :func:`check_job` checks that it
    exists on every path, a start too."""
    if spec.account is None:
        return
    account = configured_account(config, spec.account)
    if account is None:
        raise InvalidRequest(f"no account {spec.account!r}; {accounts_text(config)}")
    if owner_name in account.users:
        return
    if account.unix_group is not None and in_group(owner_uid, account.unix_group):
        return
    raise PermissionDenied(
        f"permission denied: {owner_name} may not charge account {account.name} (it is for"
        f" {_members(account)}; ask an admin to add you to [accounts.{account.name}])"
    )


def check_owner(
    job_id: int,
    owner_uid: int,
    owner_name: str,
    accounts: Callable[[int], str | None] = account_name,
) -> None:
    """A job put back in the queue (a restart, an edit, a release) can run as its owner:
    :class:`Conflict` in one line when its owner's Unix account is gone
    (``launchspec.owner_missing``, the rule a start fails a job by), so that it is refused
    now rather than failed when it would start.  Nothing is changed by a refusal: the job
    stays as it was (an admin or root may still cancel it).  ``accounts``: the user
    database's lookup (``Context.accounts``)."""
    why = owner_missing(owner_uid, owner_name, accounts)
    if why is not None:
        raise Conflict(
            f"job {job_id} cannot run again: {why} on this machine; cancel it or ask an admin"
        )


def _members(account: AccountConfig) -> str:
    names = sorted(account.users)
    if account.unix_group is not None:
        names.append(f"the members of group {account.unix_group}")
    return ", ".join(names)


def check_shape(
    *,
    argv: list[str],
    workdir: str,
    min_gpus: int,
    max_gpus: int | None,
    elastic: bool,
    config: DaemonConfig,
) -> None:
    """Command, folder and device bounds (also what ``edit`` may change)."""
    if not argv[0]:
        raise InvalidRequest("submit: the command is empty")
    if not os.path.isabs(workdir):
        raise InvalidRequest(f"submit: workdir must be an absolute path, got {workdir!r}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise InvalidRequest(f"min_gpus {min_gpus} is greater than max_gpus {max_gpus}")
    if not elastic and max_gpus is not None and max_gpus != min_gpus:
        raise InvalidRequest(
            f"a rigid job runs on exactly min_gpus devices, but max_gpus is {max_gpus} and"
            f" min_gpus {min_gpus} (a range is for elastic jobs)"
        )
    total_devices = config.total_devices
    if min_gpus > total_devices:
        raise InvalidRequest(
            f"the job needs at least {min_gpus} device(s) but this daemon has {total_devices}"
        )
    cap = config.max_devices_per_user
    if cap is not None and min_gpus > cap:
        raise InvalidRequest(
            f"the job needs at least {min_gpus} device(s) but a user may hold at most {cap}"
            " ([limits] max_devices_per_user)"
        )


def check_sharing(spec: JobSpec, config: DaemonConfig) -> None:
    """A shared job is rigid, on one device, declares its memory, and some node's devices
    are known to have that much."""
    if not spec.shared:
        return
    if spec.elastic:
        raise InvalidRequest("--shared is for rigid jobs; an elastic job never shares")
    if spec.min_gpus != 1 or (spec.max_gpus or 1) != 1:
        raise InvalidRequest(
            f"a shared job runs on one device (--gpus 1), not {spec.min_gpus}"
            + (f"-{spec.max_gpus}" if spec.max_gpus not in (None, spec.min_gpus) else "")
        )
    if spec.gpu_memory is None:
        raise InvalidRequest("--shared needs --gpu-memory (the memory the job uses)")
    sizes = [node.device_memory for node in config.nodes if node.device_memory is not None]
    if not sizes:
        raise InvalidRequest("--shared: no node declares its devices' memory ([nodes.NAME] memory)")
    if spec.gpu_memory > max(sizes):
        raise InvalidRequest(
            f"--gpu-memory {format_size(spec.gpu_memory)} is more than any device"
            f" has (at most {format_size(max(sizes))})"
        )


def settle_time_limit(limit: float | None, config: DaemonConfig) -> float | None:
    """A job's time limit under this daemon: none given is ``[limits] default_time``, else
    ``max_time``; one longer than ``max_time`` is refused."""
    longest = config.max_time_s
    if limit is None:
        return config.default_time_s if config.default_time_s is not None else longest
    if longest is not None and limit > longest:
        raise InvalidRequest(
            f"time limit {format_duration(limit)} is longer than this daemon's maximum"
            f" {format_duration(longest)} ([limits] max_time)"
        )
    return limit


def check_constraint(constraint: Constraint, min_gpus: int, config: DaemonConfig) -> None:
    """Every node named exists, the type is some node's, and the allowed nodes have
    ``min_gpus`` devices."""
    names = [node.name for node in config.nodes]
    for name in constraint.nodes:
        if name not in names:
            raise InvalidRequest(f"--constraint names no node {name!r} (nodes: {', '.join(names)})")
    types = sorted({node.device_type for node in config.nodes})
    if constraint.device_type is not None and constraint.device_type not in types:
        raise InvalidRequest(
            f"--constraint asks for device type {constraint.device_type!r}; this"
            f" daemon has {', '.join(types)}"
        )
    allowed = sum(
        len(node.devices)
        for node in config.nodes
        if constraint.allows_node(node.name, node.device_type)
    )
    if min_gpus > allowed:
        raise InvalidRequest(
            f"the job needs {min_gpus} device(s) but {constraint.describe()} offer {allowed}"
        )
