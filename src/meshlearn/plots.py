"""Figures for result files: matplotlib's pyplot, drawing off-screen (no display needed)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` with the file-only Agg backend; imported on first use (it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
