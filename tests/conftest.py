"""Every test (and every process it starts) keeps meshlearn's keys and known bootstraps in a folder
of its own session, never in the user's ~/.meshlearn."""

import os
import tempfile

import pytest

from helpers.netproc import Processes

os.environ["MESHLEARN_HOME"] = tempfile.mkdtemp(prefix="meshlearn-home-")


@pytest.fixture
def procs(tmp_path):
    """Spawned `meshlearn` processes of one test, all killed when it ends (passed or not)."""
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()
