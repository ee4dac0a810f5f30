"""A prompt end of a meshlearn process (``exit_now``): the command line's, and that of the child a
run whose loss the kernel makes runs in (``sim.kernelnet``), which its Ctrl-C waits for."""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_now(code: int) -> None:
    """End the process with ``code`` once what ``atexit`` asks is done and the output is flushed, but
    without Python's unloading of every module (torch's and matplotlib's took most of a second after
    the demo had printed its last line). Where another non-daemon thread still runs, the ordinary exit,
    which waits for it."""
    if any(thread.is_alive() and not thread.daemon and thread is not threading.main_thread()
           for thread in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
