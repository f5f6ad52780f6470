"""The playground at ``/`` in a real browser: Playwright driving the system's headless Chromium (Debian's
``chromium``; Playwright's own browser download cannot work here) against the real server on the shipped demo pair,
speculating. Load the page with an API key, stream a completion and see tokens coloured by how they came, stop a
generation midway (the server aborts it and frees its KV), and see a server error in the page. A missing browser
fails this test: it is not skipped.

``INFER_SCREENSHOT=path`` also saves a screenshot of the finished page (the README's docs/playground.png)."""

import json
import os
import shutil
import time

import pytest

from infer.demo import demo_model_paths, demo_prompts
from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.server import build_app
from infer.server.thread import ServerThread

KEY = "playground-key"


@pytest.fixture(scope="module")
def server():
    target, drafter = demo_model_paths()
    # K pinned: auto K may turn speculation off on a busy machine, and the page must show drafts
    engine = AsyncEngine(EngineConfig(model=target, draft_model=drafter, spec_length=4, max_batch_size=4))
    with ServerThread(build_app(engine, "demo", api_key=KEY)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the browser test needs Debian's chromium: apt-get install chromium (.ci/run installs it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1000, "height": 800})
        page.goto(server.url + "/")
        yield page
        browser.close()


def _kv_free(engine) -> bool:
    return engine.engine.free_kv_tokens() == engine.engine.initial_free_kv_tokens


def test_page_streams_coloured_tokens_with_the_api_key(page, server):
    page.wait_for_selector("#error:not([hidden])")  # no key yet: the server's 401 is shown
    assert "API key" in page.inner_text("#error")
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.getElementById('model').textContent === 'demo'")
    assert page.evaluate("sessionStorage.getItem('infer-api-key')") == KEY
    page.select_option("#mode", "completion")
    page.fill("#prompt", demo_prompts()[0]["prompt"])  # held-out standard-library code: the pair's own domain
    page.fill("#max_tokens", "96")
    page.click("#send")
    page.wait_for_function("!document.getElementById('send').disabled && document.getElementById('ntok')"
                           ".textContent !== '0'", timeout=60_000)
    kinds = page.eval_on_selector_all("#output span", "spans => spans.map(s => s.className)")
    assert kinds and {"tok accepted"} & set(kinds), kinds  # drafts accepted and shown as such
    assert {"tok recovered", "tok bonus"} & set(kinds)  # every round ends with a recovered or bonus token
    assert float(page.inner_text("#tps")) > 0 and page.inner_text("#acc").endswith("%")
    assert page.inner_text("#ks") != "-" and page.is_hidden("#error")
    if os.environ.get("INFER_SCREENSHOT"):
        page.screenshot(path=os.environ["INFER_SCREENSHOT"], full_page=True)


def test_json_schema_box_gets_json_that_follows_it(page, server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"enum": [1, 2, 3]}},
              "required": ["name", "n"], "additionalProperties": False}
    page.select_option("#mode", "completion")
    page.fill("#prompt", demo_prompts()[0]["prompt"])
    page.fill("#max_tokens", "64")
    page.click("#structured summary")
    page.fill("#schema", "{not json")  # named in the page, nothing sent
    page.click("#send")
    page.wait_for_function("document.getElementById('error').textContent.includes('not valid JSON')")
    page.fill("#schema", json.dumps(schema))
    page.click("#send")
    page.wait_for_function("!document.getElementById('send').disabled && document.getElementById('ntok')"
                           ".textContent !== '0'", timeout=60_000)
    answer = json.loads(page.inner_text("#output"))
    assert set(answer) == {"name", "n"} and answer["n"] in (1, 2, 3), answer
    page.fill("#schema", "")  # the next tests get free text


def test_stop_strings_and_penalties_reach_the_server(page, server):
    """The "Penalties and stop strings" box: the answer ends before a stop string (one a line, \\n a newline), and a
    penalty set is sent (a default one is not)."""
    page.select_option("#mode", "completion")
    page.fill("#prompt", demo_prompts()[0]["prompt"])
    page.fill("#max_tokens", "48")

    def send() -> dict:
        with page.expect_request(lambda r: r.url.endswith("/v1/completions") and r.method == "POST") as req:
            page.click("#send")
        page.wait_for_function("!document.getElementById('send').disabled && document.getElementById('ntok')"
                               ".textContent !== '0'", timeout=60_000)
        return json.loads(req.value.post_data)

    body = send()  # greedy: the same text each time
    full = page.inner_text("#output")
    assert "stop" not in body and "presence_penalty" not in body and "repetition_penalty" not in body
    cut = next(i for i in range(len(full) // 3, len(full)) if full[i] not in " \n")  # a character a third in
    page.click("#more summary")
    page.fill("#stop_strings", "never appears\n" + full[cut:cut + 3].replace("\n", "\\n"))
    body = send()
    assert body["stop"] == ["never appears", full[cut:cut + 3]] and "presence_penalty" not in body
    assert full.startswith(page.inner_text("#output")) and len(page.inner_text("#output")) <= cut
    page.fill("#stop_strings", "")  # the next tests get the defaults
    page.fill("#presence_penalty", "0.5")
    body = send()
    assert body["presence_penalty"] == 0.5 and "stop" not in body and "frequency_penalty" not in body
    page.fill("#presence_penalty", "0")


def test_stop_midway_aborts_the_request_and_frees_its_kv(page, server):
    eng = server.engine
    eng.engine.eos_token_ids = []  # nothing ends this generation but the Stop button
    page.fill("#prompt", "import os\n")
    page.fill("#max_tokens", "900")  # the demo pair holds 1,024 positions
    page.click("#send")
    page.wait_for_function("Number(document.getElementById('ntok').textContent) >= 20", timeout=60_000)
    assert eng.engine.has_unfinished
    page.click("#stop")
    page.wait_for_function("!document.getElementById('send').disabled")
    deadline = time.monotonic() + 5
    while not _kv_free(eng) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_free(eng) and not eng.engine.has_unfinished
    assert int(page.inner_text("#ntok")) < 900 and page.is_hidden("#error")


def test_a_server_error_is_shown_in_the_page(page):
    page.select_option("#mode", "chat")  # the demo pair has no chat template: the server says so (400)
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "chat template" in page.inner_text("#error")
    page.select_option("#mode", "completion")
    page.fill("#max_tokens", "100000")  # beyond the context: the server names the problem
    page.click("#send")
    page.wait_for_function("document.getElementById('error').textContent.includes('max_tokens')")
