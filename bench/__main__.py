"""`python -m bench <command>`: trace, measure, ingest, export, and the database tools.

Each command lives in its own module exposing `register(subparsers)`; the module is imported only when
listed here, so `python -m bench measure` never imports DuckDB and `ingest` never imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module that registers it
COMMANDS = {
    "trace": "bench.commands.trace",
    "replay": "bench.commands.replay",
    "derive": "bench.commands.derive",
    "measure": "bench.commands.measure",
    "ingest": "bench.commands.db",
    "export": "bench.commands.db",
    "build-db": "bench.commands.build_db",
    "import-published": "bench.commands.published",
    "report": "bench.commands.accuracy",
    "accuracy": "bench.commands.accuracy",
    "calibrate": "bench.commands.calibrate",
    "push": "bench.commands.share",
    "pull": "bench.commands.share",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    # Register only the module that owns the chosen command (keeps imports light); all for --help.
    modules = {COMMANDS[wanted]} if wanted else set(COMMANDS.values())
    for mod in sorted(modules):
        try:
            importlib.import_module(mod).register(sub)
        except ModuleNotFoundError as e:
            if wanted:
                raise
            print(f"(command module {mod} unavailable: {e})", file=sys.stderr)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
