"""A headless Chromium driven through Debian's chromedriver, over the W3C WebDriver protocol
(plain JSON over HTTP: a dozen calls, no client library)."""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import httpx

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
# A headless Chromium that talks to nothing but the page under test.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1280,900"]
T = TypeVar("T")


class WebDriverError(Exception):
    pass


class Browser:
    """One chromedriver process and one browser session; ``close()`` ends both."""

    def __init__(self, profile: Path) -> None:
        binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
        assert binary and driver, "Chromium and chromedriver are required (scripts/test installs them)"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self._driver = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=180)
        self._session = ""  # set once the browser runs
        self.wait(self._ready, "chromedriver to start", 30)
        options = {"binary": binary, "args": [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]}
        created = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options, "goog:loggingPrefs": {"browser": "ALL"}}}})
        self._session = f"/session/{created['sessionId']}"

    def _ready(self) -> bool:
        try:
            return bool(self._http.get("/status").json()["value"]["ready"])
        except httpx.TransportError:
            return False

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._http.request(method, path, json=body)
        value = response.json()["value"]
        if response.status_code != 200:
            raise WebDriverError(f"{method} {path}: {value.get('error')}: {value.get('message', '')[:500]}")
        return value

    def close(self) -> None:
        try:
            self._call("DELETE", self._session)
        finally:
            self._http.close()
            self._driver.terminate()
            self._driver.wait(timeout=20)

    def open(self, url: str) -> None:
        self._call("POST", f"{self._session}/url", {"url": url})

    def resize(self, width: int, height: int) -> None:
        """The window's size (headless: its viewport's)."""
        self._call("POST", f"{self._session}/window/rect", {"width": width, "height": height})

    def screenshot(self, path: Path) -> Path:
        """A PNG of the viewport, written to ``path``."""
        path.write_bytes(base64.b64decode(self._call("GET", f"{self._session}/screenshot")))
        return path

    def run(self, script: str, *args: Any) -> Any:
        """JavaScript in the page: ``script`` is a function body, ``arguments`` its args."""
        return self._call("POST", f"{self._session}/execute/sync", {"script": script, "args": list(args)})

    def find(self, css: str) -> str | None:
        """The first element matching ``css``, or None."""
        found = self._call("POST", f"{self._session}/elements", {"using": "css selector", "value": css})
        return found[0][ELEMENT] if found else None

    def text(self, css: str) -> str:
        element = self.find(css)
        return "" if element is None else str(self._call("GET", f"{self._session}/element/{element}/text"))

    def click(self, css: str) -> None:
        self._call("POST", f"{self._session}/element/{self.wait(lambda: self.find(css), css)}/click", {})

    def type(self, css: str, text: str) -> None:
        element = self.wait(lambda: self.find(css), css)
        self._call("POST", f"{self._session}/element/{element}/clear", {})
        self._call("POST", f"{self._session}/element/{element}/value", {"text": text})

    def wait_text(self, css: str, *parts: str) -> str:
        """The text of ``css`` once it holds every one of ``parts``."""
        def shown() -> str | None:
            text = self.text(css)
            return text if all(part in text for part in parts) else None

        return self.wait(shown, f"{css} to show {parts}")

    def console(self) -> list[dict[str, Any]]:
        """The browser's console messages since the last call (chromedriver's log endpoint)."""
        return list(self._call("POST", f"{self._session}/se/log", {"type": "browser"}))

    def wait(self, found: Callable[[], T | None], what: str, timeout_s: float = 180) -> T:
        """Poll until ``found`` returns something (the page works asynchronously; generating
        on a CPU takes seconds). Not a timing check: the bound only keeps a broken page from
        hanging the test."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = found()
            if value:
                return value
            if time.monotonic() > deadline:
                shown = self.text("body")[:3000] if self._session else "(no browser yet)"
                raise AssertionError(f"waited {timeout_s:.0f} s for {what}; the page shows:\n{shown}")
            time.sleep(0.2)
