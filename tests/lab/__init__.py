"""The lab install as root with real Unix users: deployment, per-user limits, users kept apart."""
