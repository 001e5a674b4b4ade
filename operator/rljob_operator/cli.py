"""Command line: ``rljob`` (run jobs locally, generate the CRD) and ``rljob-operator``."""

from __future__ import annotations

import argparse
import sys

from rljob_operator import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rljob`` command."""
    parser = argparse.ArgumentParser(prog="rljob")
    parser.add_argument("--version", action="version", version=f"rljob {__version__}")
    parser.parse_args(argv)
    return 0


def operator_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rljob-operator`` command."""
    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
