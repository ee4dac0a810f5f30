"""A real headless Chromium (Debian's, driven by selenium through its chromedriver), or a clean
skip where there is none. Nothing here downloads a browser or a driver."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

INSTALL_WAIT = 600.0  # seconds a browser test waits for CI's background install of chromium
ARTIFACTS = Path(os.environ.get("MESHLEARN_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts")


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium WebDriver that keeps the page's console log; quit at the end. Where CI
    is still installing the browser (``MESHLEARN_BROWSER_READY`` names a file it makes when done),
    wait for that first."""
    ready = os.environ.get("MESHLEARN_BROWSER_READY")
    if ready:
        deadline = time.monotonic() + INSTALL_WAIT
        while not Path(ready).exists() and time.monotonic() < deadline:
            time.sleep(1)
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no system Chromium with chromedriver (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1600", "--no-first-run", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver) -> list[str]:
    """The page's console messages at level SEVERE (JavaScript errors, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def keep_screenshot(driver, name: str) -> Path:
    """Save the page as ``test-artifacts/NAME.png`` (or under $MESHLEARN_TEST_ARTIFACTS)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_until(check: Callable[[], object], timeout: float, what: str, every: float = 0.2):
    """``check()``'s first true value within ``timeout`` seconds; AssertionError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
