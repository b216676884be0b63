"""The TUI: pilot, snapshot, literal-text and terminal tests over recorded or live daemon replies."""
