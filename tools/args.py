"""The argument parser of every ``eplb`` command: a bad flag is one line, not the usage first."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, status 2:
    ``PROG: error: MESSAGE (see PROG --help)``. argparse prints the whole usage first (18 lines
    for ``eplb place``), which buries the one line that says what was wrong. Subcommands'
    parsers are of this class too (``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
