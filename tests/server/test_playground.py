"""The playground page in headless Chromium: it streams a reply and highlights draft tokens.

Chromium (Debian's `chromium` package) is driven over the DevTools protocol on a pipe
(`--remote-debugging-pipe`: JSON messages ending in a NUL byte on fds 3 and 4), so no
driver, websocket library or browser download is needed. The page is loaded with the
prompt in its query string, a screenshot of the idle page is taken, Send is clicked, and
once the page reports `data-state="done"` the DOM and a second screenshot are checked:
the reply equals the API's own greedy reply, and the output panel holds pixels of the
draft-highlight colour, which it did not before.
"""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from urllib.parse import urlencode

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
torch = pytest.importorskip("torch")

from conftest import make_tiny_model  # noqa: E402

from quasar.api import LLM  # noqa: E402
from quasar.server.app import BackgroundServer, create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
DRAFT_RGB = (0xFF, 0xCF, 0x33)  # --draft in playground.html
PROMPT = "Hello there, write a poem"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    threads = torch.get_num_threads()
    model_dir = make_tiny_model(tmp_path_factory.mktemp("playground") / "tiny", "llama", default_model_dir, 0)
    llm = LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=512, threads=1)
    with BackgroundServer(create_app(llm, model_name="tiny")) as srv:
        yield srv
    torch.set_num_threads(threads)


def test_page_is_served_self_contained(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/")
    resp = conn.getresponse()
    html = resp.read().decode()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/html")
    for needle in ('id="prompt"', 'id="output"', "tok-draft", "/v1/chat/completions", "getReader", "autorun"):
        assert needle in html, needle
    # offline: no external scripts, styles or fonts
    assert "http://" not in html and "https://" not in html and "<link" not in html
    # the API key is never written to storage (it stays in the page's field)
    assert "localStorage" not in html and "sessionStorage" not in html and "document.cookie" not in html


class DevTools:
    """A headless Chromium driven over --remote-debugging-pipe."""

    def __init__(self, profile_dir: str, width: int = 1100, height: int = 800):
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--no-first-run", "--no-default-browser-check", "--mute-audio",
                "--force-color-profile=srgb", "--force-device-scale-factor=1", "--hide-scrollbars",
                f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "--remote-debugging-pipe",
                "about:blank"]
        # the protocol lives on fds 3 (commands in) and 4 (replies out) of the browser
        shell = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self.log = open(os.path.join(profile_dir, "chromium.log"), "wb")
        self.proc = subprocess.Popen(["/bin/bash", "-c", shell, "bash", *args], pass_fds=(to_browser_r, from_browser_w),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._out = os.fdopen(to_browser_w, "wb")
        self._in = os.fdopen(from_browser_r, "rb")
        self._replies: queue.Queue = queue.Queue()
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            data = self._in.read1(65536)
            if not data:
                self._replies.put(None)
                return
            buf += data
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                obj = json.loads(msg)
                if "id" in obj:  # events (no id) are not needed
                    self._replies.put(obj)

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        self._out.flush()
        deadline = time.monotonic() + timeout
        while True:
            reply = self._replies.get(timeout=max(0.01, deadline - time.monotonic()))
            if reply is None:
                raise RuntimeError("chromium closed the DevTools pipe")
            if reply["id"] == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open_page(self, url: str) -> str:
        pages = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.navigate", {"url": url}, session)
        return session

    def evaluate(self, session: str, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, session: str, expression: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(session, expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {expression}")
            time.sleep(0.05)

    def screenshot(self, session: str):
        from PIL import Image

        data = self.call("Page.captureScreenshot", {"format": "png"}, session)["data"]
        return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _highlight_pixels(image, rect: dict | None = None, tol: int = 6) -> int:
    import numpy as np

    a = np.asarray(image).astype(int)
    if rect is not None:
        x0, y0 = int(rect["left"]), int(rect["top"])
        a = a[y0:y0 + int(rect["height"]), x0:x0 + int(rect["width"])]
    return int((np.abs(a - np.array(DRAFT_RGB)).max(axis=-1) <= tol).sum())


STATE = """JSON.stringify({
  out: document.getElementById('output').textContent,
  drafts: document.querySelectorAll('#output .tok-draft').length,
  plain: document.querySelectorAll('#output .tok-verifier').length,
  tokens: document.getElementById('tokens').textContent, tps: document.getElementById('tps').textContent,
  mal: document.getElementById('mal').textContent, steps: document.getElementById('steps').textContent,
  error: document.getElementById('error').textContent,
  stored: localStorage.length + sessionStorage.length + document.cookie.length,
  verifiers: [...document.querySelectorAll('#verifiers option')].map((o) => o.value),
  rect: document.getElementById('output').getBoundingClientRect().toJSON()})"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless browser test needs Debian's chromium (apt-get install -y chromium)")
def test_playground_streams_and_highlights_draft_tokens(server, tmp_path):
    pytest.importorskip("PIL")
    pytest.importorskip("numpy")
    import http.client

    # what the API itself answers for the same request (and: this prompt does accept drafts)
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                       "temperature": 0, "drafter": "ngram"})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    expected = json.loads(conn.getresponse().read())
    assert expected["quasar"]["accepted"] > 0, "precondition: the tiny model accepts some drafts on this prompt"

    query = urlencode({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "drafter": "ngram",
                       "verifier": "fp", "num_draft": 5})
    browser = DevTools(str(tmp_path))
    try:
        page = browser.open_page(f"{server.url}/?{query}")
        browser.wait_until(page, "document.getElementById('model') && "
                                 "document.getElementById('model').dataset.name === 'tiny'", 30)
        before = browser.screenshot(page)
        idle = json.loads(browser.evaluate(page, STATE))
        assert idle["out"] == "" and idle["drafts"] == 0
        assert idle["verifiers"] == ["fp"]  # what the server offers (/health), nothing else
        browser.evaluate(page, "document.getElementById('api_key').value = 'sk-typed-in'")

        browser.evaluate(page, "document.getElementById('send').click()")
        browser.wait_until(page, "['done', 'error'].includes(document.body.dataset.state)", 60)
        state = json.loads(browser.evaluate(page, STATE))
        after = browser.screenshot(page)
        after.save(tmp_path / "playground.png")
    finally:
        browser.close()

    assert state["error"] == ""
    assert state["stored"] == 0  # the typed key went out with the request, into no storage
    assert state["out"] == expected["choices"][0]["message"]["content"]
    assert state["drafts"] > 0 and state["plain"] > 0
    assert int(state["tokens"]) == MAX_TOKENS and int(state["steps"]) == expected["quasar"]["steps"]
    assert float(state["mal"]) == pytest.approx(expected["quasar"]["mean_accepted"], abs=0.01)
    assert float(state["tps"]) > 0

    # the screenshot: highlight colour inside the output panel after streaming, none before
    rect = state["rect"]
    assert before.size == after.size and rect["width"] > 100 and rect["height"] > 50
    assert _highlight_pixels(before, rect) == 0
    lit = _highlight_pixels(after, rect)
    assert lit >= 60 * state["drafts"], (lit, state["drafts"])  # each highlighted token is a filled box
    assert _highlight_pixels(after) - _highlight_pixels(before) == lit  # nowhere else changed colour
