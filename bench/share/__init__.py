"""The shared measurement dataset: push contributions to a remote dataset, pull and browse them (docs/measuring.md)."""
