"""``groups``, ``set_group``, ``delete_group``, ``pause_group``, ``resume_group``: groups of jobs
with their own caps (``submit --group NAME``).

Two kinds of group share one name space:

* an admin's group is a ``[groups.NAME]`` table of the config (``max_devices``,
  ``max_running``): any job may join it, its caps change only in the file (``SIGHUP``), and
  only an admin may pause it;
* a user's group is made at run time (``set_group``; at most ``[limits] user_groups`` per
  user): only its owner's jobs may join it, only its owner changes its caps or deletes it
  (once no queued, held or running job is in it), and its owner or an admin pauses it.

A paused group's queued jobs wait; its running jobs go on.  Every pause is stored (the
``groups`` table), so that it outlives a restart.  Which group a job may name is checked by
:func:`check_job_groups`, which ``submit.validate_jobs`` calls on every path that makes or
changes a job.  A name the config gives a group is the admin's even where a user's group had
it before: the file is the truth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from msgspec import UNSET

from pollux_local.api.errors import (
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
)
from pollux_local.api.messages import (
    DeleteGroup,
    GroupReply,
    GroupRow,
    GroupsReply,
    ListGroups,
    PauseGroup,
    ResumeGroup,
    SetGroup,
)
from pollux_local.api.spec import JobSpec
from pollux_local.api.states import ACTIVE_STATES, PLACED_STATES
from pollux_local.daemon.config import DaemonConfig, GroupConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.loop import stopping_jobs
from pollux_local.daemon.scheduler import group_limits
from pollux_local.daemon.state import GroupRecord


def configured(config: DaemonConfig, name: str) -> GroupConfig | None:
    """The admin's group ``name`` (``None``: the config has none)."""
    return next((group for group in config.groups if group.name == name), None)


def users_groups(config: DaemonConfig, rows: Iterable[GroupRecord]) -> list[GroupRecord]:
    """The groups users made (a name the config gives a group is the admin's)."""
    admins = {group.name for group in config.groups}
    return [row for row in rows if row.owner_uid is not None and row.name not in admins]


def group_owner(ctx: Context, name: str) -> str | None:
    """The name of the user whose group ``name`` is (``None``: the admin's, or none): such a
    group holds its owner's jobs alone, whatever other jobs name it (``in_own_group``)."""
    if configured(ctx.config, name) is not None:
        return None
    row = ctx.store.group_row(name)
    return None if row is None or row.owner_uid is None else row.owner_name


def owned(row: GroupRecord, owner_uid: int, owner_name: str) -> bool:
    """Is the user's group ``row`` that user's: their uid and account name, as a job's owner
    is theirs (``auth.is_owner``: a uid ``userdel`` freed and a new account holds is not)?"""
    return row.owner_uid == owner_uid and row.owner_name == owner_name


def usable_groups(ctx: Context, owner_uid: int, owner_name: str) -> list[str]:
    """The groups a job of ``owner_uid`` (``owner_name``) may join: the admin's, then the
    owner's own."""
    rows = users_groups(ctx.config, ctx.store.group_rows())
    own = [row.name for row in rows if owned(row, owner_uid, owner_name)]
    return [group.name for group in ctx.config.groups] + own


def check_job_groups(
    ctx: Context,
    specs: Sequence[JobSpec],
    *,
    owner_uid: int,
    owner_name: str,
    kept: str | None = None,
) -> list[JobSpec]:
    """Each job names no group, an admin's group or one of its owner's own
    (:class:`InvalidRequest`, or :class:`PermissionDenied` for another user's group, one line
    naming the group and those it could use); the specs as they are to be stored.  ``kept``:
    the group a stored job already names (a release, an edit, a restart); when the job is no
    longer in it (no group of that name exists any more, or it is another user's: an admin's
    group the config dropped, under which a user's group of that name had been hidden) the
    job leaves it, where a group newly asked for that it may not use is refused."""
    if kept is not None and configured(ctx.config, kept) is None:
        row = ctx.store.group_row(kept)
        if row is None or not owned(row, owner_uid, owner_name):  # not its owner's, nor admin's
            specs = [
                msgspec.structs.replace(spec, group=None) if spec.group == kept else spec
                for spec in specs
            ]
    for name in dict.fromkeys(spec.group for spec in specs if spec.group is not None):
        if configured(ctx.config, name) is not None:
            continue
        row = ctx.store.group_row(name)
        if row is not None and owned(row, owner_uid, owner_name):
            continue
        usable = ", ".join(usable_groups(ctx, owner_uid, owner_name)) or "none"
        if row is not None and row.owner_uid is not None:
            raise PermissionDenied(
                f"permission denied: group {name} is {row.owner_name}'s, and only its owner's"
                f" jobs may join it; groups {owner_name} may use: {usable}"
            )
        raise InvalidRequest(f"no group {name!r}; groups {owner_name} may use: {usable}")
    return list(specs)


def list_groups(ctx: Context, request: ListGroups) -> GroupsReply:
    return GroupsReply(groups=group_rows(ctx))


def group_rows(ctx: Context, names: Iterable[str] | None = None) -> list[GroupRow]:
    """The groups (only ``names``, when given) with their jobs now: the admin's, then the
    users', each by name."""
    wanted = None if names is None else set(names)
    stored = ctx.store.group_rows()
    admins_paused = {row.name: row.admins_paused for row in stored}
    mine = users_groups(ctx.config, stored)
    limits = group_limits(ctx.config.groups, stored)

    def member(group: str, owner: str) -> bool:  # as the pass has it (``in_own_group``)
        limit = limits.get(group)
        return limit is None or limit.has_member(owner)

    running: dict[str, int] = {}
    devices: dict[str, int] = {}
    queued: dict[str, int] = {}
    # the waiting jobs counted by the database (a user may keep a thousand), the placed ones
    # read (no more than the devices)
    for name, owner, count in ctx.store.group_job_counts(ACTIVE_STATES - PLACED_STATES):
        if member(name, owner):
            queued[name] = queued.get(name, 0) + count
    for job in ctx.store.jobs(PLACED_STATES):
        group = job.spec.group
        if group is not None and member(group, job.owner_name):
            running[group] = running.get(group, 0) + 1
            devices[group] = devices.get(group, 0) + sum(map(len, job.placement.values()))
    for stop in stopping_jobs(ctx.store, ctx.executor):
        if stop.group is not None and member(stop.group, stop.owner):
            running[stop.group] = running.get(stop.group, 0) + 1
            devices[stop.group] = devices.get(stop.group, 0) + stop.count
    rows = [
        (
            group.name,
            None,
            group.max_devices,
            group.max_running,
            admins_paused.get(group.name, False),
        )
        for group in ctx.config.groups
    ] + [(row.name, row.owner_name, row.max_devices, row.max_running, row.paused) for row in mine]
    return [
        GroupRow(
            name=name,
            owner=owner,
            max_devices=max_devices,
            max_running=max_running,
            paused=paused,
            running=running.get(name, 0),
            devices=devices.get(name, 0),
            queued=queued.get(name, 0),
        )
        for name, owner, max_devices, max_running, paused in rows
        if wanted is None or name in wanted
    ]


def _reply(ctx: Context, name: str) -> GroupReply:
    (row,) = group_rows(ctx, [name])
    return GroupReply(group=row)


def _admins_group(ctx: Context, name: str, what: str) -> PermissionDenied:
    return PermissionDenied(
        f"permission denied: group {name} is the admin's ([groups.{name}] in"
        f" {ctx.config.source}); {what}"
    )


def _users_group(ctx: Context, name: str) -> GroupRecord:
    """A user's group (:class:`NotFound` when there is none)."""
    row = ctx.store.group_row(name)
    if row is None or row.owner_uid is None:
        raise NotFound(f"no group {name!r} (pollux-local group list shows them)")
    return row


def set_group(ctx: Context, request: SetGroup) -> GroupReply:
    """Make the caller's group ``name``, or change its caps."""
    name, uid = request.name, ctx.peer.uid
    if configured(ctx.config, name) is not None:
        raise _admins_group(ctx, name, "its caps change only in that file")
    row = ctx.store.group_row(name)
    if row is not None and row.owner_uid is not None and not owned(row, uid, ctx.peer.name):
        raise PermissionDenied(
            f"permission denied: group {name} is {row.owner_name}'s; only its owner may change it"
        )
    if row is None or row.owner_uid is None:  # a new group
        most = ctx.config.user_groups
        if most == 0:
            raise LimitExceeded(
                "limit exceeded: this daemon lets no user make groups ([limits] user_groups = 0)"
            )
        have = ctx.store.count_groups(uid)
        if have >= most:
            raise LimitExceeded(
                f"limit exceeded: {ctx.peer.name} has {have} groups, the most a user may make"
                f" ([limits] user_groups = {most}); delete one first (group delete NAME)"
            )
        others = ctx.store.count_group_jobs(name, other_than=uid)
        if others:
            raise Conflict(
                f"group {name} is still named by {others} queued, held or running job(s) of"
                " other users (a group the config no longer has); choose another name"
            )
        if row is not None:  # the pause of an admin's group the config no longer has
            ctx.store.delete_group(name)
        max_devices, max_running = None, None
    else:
        max_devices, max_running = row.max_devices, row.max_running
    ctx.store.put_group(
        name,
        owner_uid=uid,
        owner_name=ctx.peer.name,
        max_devices=max_devices if request.max_devices is UNSET else request.max_devices,
        max_running=max_running if request.max_running is UNSET else request.max_running,
        time=ctx.clock(),
    )
    ctx.wake()
    return _reply(ctx, name)


def delete_group(ctx: Context, request: DeleteGroup) -> GroupReply:
    """Delete a user's group no queued, held or running job is in (its owner, or an admin)."""
    name = request.name
    if configured(ctx.config, name) is not None:
        raise _admins_group(ctx, name, "it goes only when that file drops it")
    row = _users_group(ctx, name)
    if not owned(row, ctx.peer.uid, ctx.peer.name) and not ctx.is_admin():
        raise PermissionDenied(
            f"permission denied: group {name} is {row.owner_name}'s; only its owner or an admin"
            " may delete it"
        )
    reply = _reply(ctx, name)
    jobs = ctx.store.count_group_jobs(name, owner=row.owner_uid)  # its members: its owner's
    if jobs:
        raise Conflict(
            f"group {name} has {jobs} job(s) queued, held or running; it may be deleted once"
            " they end"
        )
    ctx.store.delete_group(name)
    return reply


def pause_group(ctx: Context, request: PauseGroup) -> GroupReply:
    return _set_paused(ctx, request.name, True)


def resume_group(ctx: Context, request: ResumeGroup) -> GroupReply:
    return _set_paused(ctx, request.name, False)


def _set_paused(ctx: Context, name: str, paused: bool) -> GroupReply:
    """Pause or resume a group: an admin's by an admin, a user's by its owner or an admin."""
    verb = "pause" if paused else "resume"
    admins = configured(ctx.config, name) is not None
    if admins:
        if not ctx.is_admin():
            raise _admins_group(ctx, name, f"only an admin may {verb} it")
    else:
        row = _users_group(ctx, name)
        if not owned(row, ctx.peer.uid, ctx.peer.name) and not ctx.is_admin():
            raise PermissionDenied(
                f"permission denied: group {name} is {row.owner_name}'s; only its owner or an"
                f" admin may {verb} it"
            )
    ctx.store.set_group_paused(name, paused, ctx.clock(), admins=admins)
    ctx.wake()
    return _reply(ctx, name)
