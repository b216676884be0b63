"""The TUI's screens, one per module, each with its stylesheet (``NAME.tcss``) beside it:
``main`` (devices, cluster, jobs), ``job_detail``, ``logs``, ``submit``, ``confirm``,
``priority``, ``help``.

This package's ``__init__`` imports nothing (so that walking the package tree does not import
textual).
"""
