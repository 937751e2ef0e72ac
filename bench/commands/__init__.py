"""`python -m bench <command>`: one thin module per command, each with `register(subparsers)`; bench/__main__.py
imports only the chosen command's module."""
