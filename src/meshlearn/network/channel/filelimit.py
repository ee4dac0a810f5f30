"""The open-file limit of a service that strangers can reach: each of their connections holds a
descriptor, so the soft limit (often 1,024) is raised to the hard one at start."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
WANTED = 65536  # enough for every cap of the bootstrap's services together, with room to spare


def raise_open_file_limit(wanted: int = WANTED) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (never above the hard
    limit, never lower than it is); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning("this process may hold only %d open files: connections beyond the services' caps are "
                    "turned away sooner (raise it with ulimit -n)", soft)
    return soft
