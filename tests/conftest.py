"""Every test (and every process it starts) keeps meshlearn's keys and known bootstraps in a folder
of its own session, never in the user's ~/.meshlearn."""

import os
import tempfile

os.environ["MESHLEARN_HOME"] = tempfile.mkdtemp(prefix="meshlearn-home-")
