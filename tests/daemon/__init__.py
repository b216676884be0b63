"""The daemon: server, protocol, state, executor, scheduler and admission, limits, notifications, reports, devices; real daemons on CPU devices."""
