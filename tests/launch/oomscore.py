"""Whether this machine lets a process lower its ``oom_score_adj`` (the OOM-protection tests
of the node agent and the supervisor need it)."""

from __future__ import annotations

import subprocess
import sys


def can_lower_oom_score() -> bool:
    """Whether a process here may lower its ``oom_score_adj`` (``CAP_SYS_RESOURCE``: a
    container's root may lack it, and the kernel then keeps the value)."""
    probe = "import sys; from pollux_local.launch import node_agent as a; a.protect_from_oom(); "
    probe += "sys.exit(0 if open(a.OOM_SCORE_ADJ).read().strip() == '-1000' else 1)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
