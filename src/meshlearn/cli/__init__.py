"""The `meshlearn` command line (``cli.main``), its flags and the network commands.

``COMMAND_STARTED``: when this command began, as ``time.time()``, read before any of meshlearn's own
imports (this package is the first the command loads): now, less the CPU time the interpreter spent
starting (the process's CPU clock). Not /proc's start time: that is when the process was forked, which
is the shell's own start under ``bash -c 'sleep 5 && meshlearn demo'`` (the shell ``exec``s the last
command), so the demo counted the sleep in its wall-clock.
"""

import time

COMMAND_STARTED = time.time() - min(time.process_time(), 1.0)
