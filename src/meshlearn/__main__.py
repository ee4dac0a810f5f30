"""`python -m meshlearn` runs the command-line interface."""

from meshlearn.cli.main import entry

entry()
