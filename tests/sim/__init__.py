"""The simulator: traces, profiles, the loop, typed clusters, simulate, and its agreement with the daemon."""
