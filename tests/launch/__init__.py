"""Launching: the local launcher and its supervisor, the SSH node agent, log capture."""
