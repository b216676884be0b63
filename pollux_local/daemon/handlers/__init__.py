"""Request handlers, one module per command family.

Each handler is a function ``(ctx: Context, request) -> reply`` (``async`` when it stops or
starts jobs) taking the typed request of :mod:`pollux_local.api.messages` and returning its
typed reply.  A refusal is a typed error of :mod:`pollux_local.api.errors`: ``NotFound``,
``PermissionDenied``, ``Conflict`` or ``InvalidRequest``.  ``server.dispatch`` routes requests
to them.

* :mod:`.ping`: ``ping``;
* :mod:`.submit`: ``submit`` (and its cross-field checks);
* :mod:`.estimate`: ``estimate`` (a submit's expected start and finish, nothing stored);
* :mod:`.query`: ``status``, ``show``, ``logs``;
* :mod:`.control`: ``cancel``, ``hold``, ``release``, ``set_priority``;
* :mod:`.nodes`: ``nodes``;
* :mod:`.report`: ``report``.
"""
