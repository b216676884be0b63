"""The TUI's widgets, one per module: ``device_grid``, ``job_table``, ``plot_view``,
``status_line``.  Their styles are in ``widgets.tcss`` beside them, which the app loads.

This package's ``__init__`` imports nothing (so that walking the package tree does not import
textual).
"""
