"""The tests, one folder per room of pollux_local (docs/architecture.md); shared helpers at this level."""
