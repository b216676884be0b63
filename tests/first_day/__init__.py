"""A researcher's first day, end to end (ddp_snapshot.py is the script they bring)."""
