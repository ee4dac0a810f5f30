"""`python -m meshlearn` runs the command-line interface."""

from meshlearn.cli.main import main

raise SystemExit(main())
