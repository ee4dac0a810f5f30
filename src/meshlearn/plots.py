"""Figures for result files: matplotlib's pyplot, drawing off-screen (no display needed), and the
rules every figure follows: titles that fit the figure, text readable on the colour behind it."""

from __future__ import annotations

import textwrap

TITLE_SHARE = 0.96  # the share of a figure's width a title may take: the rest is its margin
NARROWEST_LINE = 12  # characters: a title is never broken into lines narrower than this
DARK_TEXT, LIGHT_TEXT = "black", "white"


def pyplot():
    """``matplotlib.pyplot`` with the file-only Agg backend; imported on first use (it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit_title(fig, text: str, **style):
    """Title ``fig`` with ``text`` (its suptitle, centred over the whole figure), each line broken
    at spaces until the title is no wider than ``TITLE_SHARE`` of the figure: a long run name is
    wrapped, never cut at the figure's edge. Returns the title's Text."""
    title = fig.suptitle(text, **{"parse_math": False, **style})  # a "$" in a run's name is no formula
    renderer = fig.canvas.get_renderer()
    lines = text.splitlines() or [""]
    width = max(len(line) for line in lines)
    while title.get_window_extent(renderer).width > TITLE_SHARE * fig.bbox.width and width > NARROWEST_LINE:
        width = max(NARROWEST_LINE, int(width * 0.9))
        title.set_text("\n".join(textwrap.fill(line, width) for line in lines))
    return title


def relative_luminance(colour) -> float:
    """WCAG's relative luminance of a matplotlib colour (0 black .. 1 white)."""
    from matplotlib.colors import to_rgb

    def linear(channel: float) -> float:
        return channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4

    red, green, blue = (linear(c) for c in to_rgb(colour))
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


def contrast_ratio(first, second) -> float:
    """WCAG's contrast ratio of two colours (1: none .. 21: black on white)."""
    light, dark = sorted((relative_luminance(first), relative_luminance(second)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def text_colour_on(background) -> str:
    """Black or white, whichever reads better on ``background`` (dark text on light colours)."""
    return max((DARK_TEXT, LIGHT_TEXT), key=lambda text: contrast_ratio(text, background))
