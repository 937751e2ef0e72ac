"""`python -m estimator --help`: the command-line front of the analytic estimator (estimator/cli.py)."""
import sys

from estimator.cli import main

if __name__ == "__main__":
    sys.exit(main())
