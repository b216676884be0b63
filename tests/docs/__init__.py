"""The documentation kept true: the README's commands, the comparison page."""
