"""pollux-local: a goodput-optimising scheduler for shared multi-GPU workstations.

The public API of the package (the job-side library lives in ``pollux_local.torch``, which is
the only module that imports torch)::

    from pollux_local import core          # throughput/efficiency/goodput models, policies
"""

__version__ = "0.1.0"
