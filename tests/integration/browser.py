"""A real headless Chromium driven over the Chrome DevTools protocol (``websocket-client``):
load a page, collect console errors, uncaught exceptions and failed loads, save a screenshot.
Debian's ``chromium`` (``./scripts/test`` installs it); tests skip where it is missing."""

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium():
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """``with Browser() as b: page = b.load(url)``; ``page["errors"]``; ``b.screenshot(path)``."""

    def __init__(self, width=1280, height=900):
        self.binary = find_chromium()
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="cdp-")
        self.proc = None
        self.ws = None
        self.ids = itertools.count(1)
        self.events = []

    def __enter__(self):
        import websocket

        self.proc = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
             "--disable-background-networking", "--hide-scrollbars",
             "--user-data-dir=" + self.profile, "--remote-debugging-port=0",
             "--window-size={},{}".format(self.width, self.height), "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            assert self.proc.poll() is None, "chromium exited with {}".format(self.proc.returncode)
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        with urllib.request.urlopen("http://127.0.0.1:{}/json/list".format(port)) as r:
            pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30,
                                              suppress_origin=True)
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.call(method)
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc):
        if self.ws is not None:
            self.ws.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method, **params):
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError("{}: {}".format(method, msg["error"]))
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def _wait_event(self, name, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, ev in enumerate(self.events):
                if ev["method"] == name:
                    del self.events[i]
                    return ev
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
        raise AssertionError("no {} within {} s".format(name, timeout))

    def evaluate(self, expression):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res.get("result", {}).get("value")

    def load(self, url, ready=None, timeout=30):
        """Navigate and wait for the load event (and ``ready``, a JS expression, to be true).
        Returns {"errors": [...], "title": ..., "text": body text}."""
        self.events = []
        self.call("Page.navigate", url=url)
        self._wait_event("Page.loadEventFired", timeout)
        deadline = time.monotonic() + timeout
        while ready and not self.evaluate(ready):
            assert time.monotonic() < deadline, "{}: never became ready ({})".format(url, ready)
            time.sleep(0.1)
        time.sleep(0.3)  # late console messages
        self.call("Runtime.evaluate", expression="0")  # drains the events received so far
        return {"errors": self.errors(), "title": self.evaluate("document.title"),
                "text": self.evaluate("document.body.innerText")}

    def errors(self):
        out = []
        for ev in self.events:
            p = ev.get("params", {})
            if ev["method"] == "Runtime.exceptionThrown":
                out.append("exception: {}".format(p["exceptionDetails"].get("exception", {})
                                                  .get("description") or p["exceptionDetails"]))
            elif ev["method"] == "Runtime.consoleAPICalled" and p.get("type") in (
                    "error", "assert", "warning"):
                out.append("console.{}: {}".format(p["type"], [a.get("value") for a in
                                                                p.get("args", [])]))
            elif ev["method"] == "Log.entryAdded" and p["entry"]["level"] in ("error",
                                                                                "warning"):
                out.append("log {}: {} {}".format(p["entry"]["level"], p["entry"]["text"],
                                                  p["entry"].get("url", "")))
            elif ev["method"] == "Network.loadingFailed" and not p.get("canceled"):
                out.append("load failed: {}".format(p.get("errorText")))
            elif ev["method"] == "Network.responseReceived" and \
                    p["response"]["status"] >= 400:
                out.append("HTTP {}: {}".format(p["response"]["status"], p["response"]["url"]))
        return out

    def screenshot(self, path):
        height = self.evaluate("Math.min(4000, document.documentElement.scrollHeight)") or \
            self.height
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=int(height),
                  deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path
