"""Quiet exits when the reader of stdout goes away (``eplb place ... | head -1``) or on Ctrl-C."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps

# What a shell reports for a process that SIGPIPE ended (128 + 13), as `yes | head -1` gives.
BROKEN_PIPE_STATUS = 141
# And for one that SIGINT (Ctrl-C) ended: 128 + 2.
INTERRUPTED_STATUS = 130


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main``: when the reader of stdout closes the pipe, stop without a
    traceback and return :data:`BROKEN_PIPE_STATUS`.

    Python ignores SIGPIPE, so writing to a closed pipe raises ``BrokenPipeError``, in a
    ``print`` or in the flush at exit. The handling the Python docs give ("Note on SIGPIPE"):
    flush inside the guard, and on the error point stdout at devnull so the flush at exit
    stays quiet too. (Restoring SIGPIPE's default action instead would also end a process
    that calls ``main`` from Python, such as a test runner.)
    """

    @wraps(main)
    def run(*args: object, **kwargs: object) -> int:
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # a stdout without a file descriptor (captured)
                pass
            return BROKEN_PIPE_STATUS

    return run
