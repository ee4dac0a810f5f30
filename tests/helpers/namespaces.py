"""Whether this machine can run a simulation whose loss the kernel makes (``loss_mode: kernel``), for
the tests that need it: ``@KERNEL`` skips them elsewhere."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshlearn.sim import kernelnet


def namespaces_work() -> bool:
    """Root, nftables, and a network namespace this process may create."""
    if kernelnet.kernel_loss_unavailable():
        return False
    probe = subprocess.run([sys.executable, "-c", "import ctypes; assert ctypes.CDLL(None).unshare(0x40000000) == 0"],
                           capture_output=True, check=False)
    return probe.returncode == 0


KERNEL = pytest.mark.skipif(not namespaces_work(), reason="needs root, nftables and network namespaces")
