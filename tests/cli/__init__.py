"""The command line: what each command sends and prints, against a real daemon where it needs one."""
