"""Headless Chromium for the site's tests, driven through WebDriver: Debian's `chromium` and `chromium-driver`
(`make browser`, part of `make test`, installs them where missing and make runs as root). Selenium is pointed at
both, so it never looks for a browser or driver to download."""

from __future__ import annotations

import shutil
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def binaries() -> tuple[str, str] | None:
    """(browser, driver) found on PATH, or None."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start(browser: str, driver: str, width: int = 1500, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--allow-file-access-from-files"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def open_page(session, path: Path) -> list[dict]:
    """Loads a page of the site; returns the console's errors (severe entries) logged while it loaded."""
    session.get(path.resolve().as_uri())
    assert session.execute_script("return document.readyState") == "complete"
    return [entry for entry in session.get_log("browser") if entry["level"] == "SEVERE"]
