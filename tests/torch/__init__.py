"""The job library (pollux_local.torch): in-process units, real gloo processes, the example jobs."""
