"""The chat page at /chat, driven in headless Chromium (Debian's package, through Playwright) against a real
`bentoml serve service:svc` (conftest's `server`, which needs an API key).

Without Chromium these tests are skipped with a reason, except under CI (`CI` set), where they fail: `.ci/run`
installs it, so a missing browser there is a broken setup, not a reason to skip.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from server_helpers import API_KEY, MAX_MODEL_LEN, MODEL, REPO

ARTIFACTS = os.path.join(REPO, "artifacts")
ANSWER_TIMEOUT_MS = 180_000  # CPU decoding on a shared 2-core machine
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "Chromium is not installed (Debian: apt-get install chromium; see README, Tests)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def browser(chromium_path):
    # NOTE: the system browser, not one that Playwright downloads (no such download here)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def base(server) -> str:
    return server.base


@pytest.fixture
def page(browser, base):
    """A fresh tab (no stored key). It must load nothing from anywhere but the server, and raise no script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(30_000)
    elsewhere, script_errors = [], []
    page.on("request", lambda r: r.url.startswith((base, "data:")) or elsewhere.append(r.url))
    page.on("pageerror", lambda error: script_errors.append(error))
    yield page
    context.close()
    assert elsewhere == [], "the page fetched from outside the server"
    assert script_errors == []


def open_chat(page, base: str) -> None:
    """Load the page, give it the key, wait for the model list."""
    page.goto(f"{base}/chat")
    page.locator("#api-key").fill(API_KEY)
    page.locator("#api-key-form button").click()
    expect(page.locator("#model option")).to_have_text([MODEL])


def set_value(page, selector: str, value: str) -> None:
    """Set an input as a user would (range inputs cannot be typed into)."""
    page.locator(selector).evaluate(
        "(input, value) => { input.value = value; input.dispatchEvent(new Event('input', { bubbles: true })); }", value
    )


def ask(page, text: str) -> None:
    page.locator("#prompt").fill(text)
    page.locator("#prompt").press("Enter")


def record_answer_text(page) -> None:
    """From now on, keep every text the newest answer shows (the page renders at most once a frame)."""
    page.evaluate("""() => {
        window.answerSnapshots = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .content');
            const text = answers.length ? answers[answers.length - 1].textContent : '';
            if (text && text !== window.answerSnapshots.at(-1)) window.answerSnapshots.push(text);
        }).observe(document.getElementById('messages'), { childList: true, subtree: true, characterData: true });
    }""")


def finished_answer(page, index: int):
    answer = page.locator(".message.assistant").nth(index)
    expect(answer).to_have_attribute("data-outcome", re.compile("."), timeout=ANSWER_TIMEOUT_MS)
    return answer


STATS = re.compile(r"~?\d+ tokens · [\d.]+ tokens/s · first token \d+ ms")


def test_page_loads_without_the_key_and_asks_for_it(page, base):
    response = httpx.get(f"{base}/chat/")
    assert response.status_code == 200 and "text/html" in response.headers["content-type"]
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert httpx.get(f"{base}/v1/models").status_code == 401  # the API does need the key
    # BentoML's own page stays where it was (behind the key, like every route but the page and the probes)
    assert httpx.get(f"{base}/").status_code == 401
    assert httpx.get(f"{base}/", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200

    page.goto(f"{base}/chat")
    assert page.url == f"{base}/chat/"
    expect(page.locator("#api-key-form")).to_be_visible()
    expect(page.locator("#connection")).to_have_text("API key needed")
    expect(page.locator("#send")).to_be_disabled()

    page.locator("#api-key").fill("not-the-key")
    page.locator("#api-key-form button").click()
    expect(page.locator("#error")).to_contain_text("Incorrect API key provided. (HTTP 401")

    page.locator("#api-key").fill(API_KEY)
    page.locator("#api-key-form button").click()
    expect(page.locator("#model option")).to_have_text([MODEL])
    expect(page.locator("#api-key-form")).to_be_hidden()
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#connection")).to_have_text("connected · 1 model")
    expect(page.locator("#send")).to_be_enabled()


def test_streams_answers_token_by_token_and_keeps_the_conversation(page, base):
    open_chat(page, base)
    page.locator("#system-prompt").fill("You are a concise assistant.")
    set_value(page, "#temperature", "0")
    page.locator("#max-tokens").fill("40")
    record_answer_text(page)
    with page.expect_request("**/v1/chat/completions") as first_request:
        ask(page, "What is the capital of France?")
    answer = finished_answer(page, 0)

    body = first_request.value.post_data_json
    assert body["messages"] == [{"role": "system", "content": "You are a concise assistant."},
                                {"role": "user", "content": "What is the capital of France?"}]
    assert body["stream"] is True and body["model"] == MODEL
    assert body["temperature"] == 0 and body["top_p"] == 0.95 and body["max_tokens"] == 40
    expect(answer).to_have_attribute("data-outcome", "complete")
    expect(answer.locator(".content")).to_contain_text("Paris")
    expect(answer.locator(".stats")).to_have_text(STATS)
    snapshots = page.evaluate("window.answerSnapshots")
    assert len(snapshots) >= 3, snapshots  # it grew on screen step by step, not all at once at the end
    assert snapshots[-1] == answer.locator(".content").text_content()

    # the whole answer, as the API gives it without streaming, goes back with the next question
    expected = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={k: body[k] for k in ("model", "messages", "temperature", "top_p", "max_tokens")},
                          timeout=300).json()["choices"][0]["message"]["content"]
    page.locator("#max-tokens").fill("12")
    with page.expect_request("**/v1/chat/completions") as second_request:
        ask(page, "And of Italy?")
    finished_answer(page, 1)
    assert second_request.value.post_data_json["messages"][1:] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": expected},
        {"role": "user", "content": "And of Italy?"},
    ]
    expect(page.locator(".message.user")).to_have_count(2)

    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "chat-page.png"))

    page.locator("#new-chat").click()
    expect(page.locator(".message")).to_have_count(0)


def test_stop_aborts_the_request_on_the_server(page, base, server):
    open_chat(page, base)
    set_value(page, "#temperature", "0")  # greedy: this prompt's answer is known to run long
    page.locator("#max-tokens").fill("1500")
    server.wait_idle()
    aborted = server.metric("pagedllm_requests_aborted_total")
    generated = server.metric("pagedllm_generation_tokens_total")
    ask(page, "Tell me a very long story.")
    page.wait_for_function(
        "() => (document.querySelector('.message.assistant .content')?.textContent ?? '').length >= 20",
        timeout=ANSWER_TIMEOUT_MS,
    )
    expect(page.locator("#stop")).to_be_visible()
    page.locator("#stop").click()

    answer = finished_answer(page, 0)
    expect(answer).to_have_attribute("data-outcome", "stopped")
    expect(answer.locator(".stats")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#error")).to_be_hidden()  # stopping is not an error

    deadline = time.time() + 30
    while server.metric("pagedllm_requests_aborted_total") <= aborted:
        assert time.time() < deadline, "the server never aborted the stopped request"
        time.sleep(0.2)
    server.wait_idle()  # and its KV blocks are free
    assert server.metric("pagedllm_generation_tokens_total") - generated < 1500

    # the stopped answer stays in the conversation as far as it got
    shown = answer.locator(".content").text_content()
    page.locator("#max-tokens").fill("4")
    with page.expect_request("**/v1/chat/completions") as next_request:
        ask(page, "Thanks.")
    finished_answer(page, 1)
    earlier = next_request.value.post_data_json["messages"][-2]
    assert earlier["role"] == "assistant" and len(earlier["content"]) >= 20
    assert earlier["content"].split()[:3] == shown.split()[:3]


def test_api_errors_show_as_readable_messages(page, base):
    open_chat(page, base)
    page.locator("#max-tokens").fill(str(MAX_MODEL_LEN + 1000))
    ask(page, "Hello there")
    expect(page.locator("#error")).to_contain_text(f"This model's maximum context length is {MAX_MODEL_LEN} tokens")
    expect(page.locator("#error")).to_contain_text("(HTTP 400")
    # nothing was answered: the turn is undone and the words are back in the box, ready to resend
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#prompt")).to_have_value("Hello there")
    expect(page.locator("#send")).to_be_enabled()


RENDER = """async (source) => {
    const { renderMarkdown } = await import('./markdown.js');
    const box = document.createElement('div');
    box.append(renderMarkdown(source));
    document.body.append(box);  // live in the page, where an injected handler would run
    await new Promise((resolve) => setTimeout(resolve, 100));
    return box.innerHTML;
}"""


def test_markdown_is_rendered_and_markup_never_injected(page, base):
    open_chat(page, base)
    html = page.evaluate(RENDER, "\n".join([
        "# Title",
        "Some **bold**, *italic*, `a < b` and a [link](https://example.com/x?a=1&b=2).",
        "",
        "- one",
        "- two",
        "",
        "```python",
        "print('<b>')",
        "```",
    ]))
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html and "<code>a &lt; b</code>" in html
    assert '<a href="https://example.com/x?a=1&amp;b=2" target="_blank" rel="noopener noreferrer nofollow">link</a>' \
        in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre><code data-language="python">print(\'&lt;b&gt;\')</code></pre>' in html

    # what a streamed answer looks like halfway, and what small models like to write
    html = page.evaluate(RENDER, "3. third\n4. fourth\n\n> quoted snake_case_name\n\n```js\nlet x = 1;")
    assert '<ol start="3"><li>third</li><li>fourth</li></ol>' in html
    assert "<blockquote><p>quoted snake_case_name</p></blockquote>" in html  # no emphasis inside words
    assert html.endswith('<pre><code data-language="js">let x = 1;</code></pre>')  # fence not closed yet

    hostile = "\n".join([
        '<img src="x" onerror="window.injected = 1"> <script>window.injected = 2</script>',
        "[click](javascript:window.injected=3) **<iframe src=x></iframe>**",
        "<a href=x>raw</a>",
    ])
    html = page.evaluate(RENDER, hostile)
    assert not re.search(r"<(img|script|iframe)\b|<a href=\"?(x|javascript)", html), html
    assert "&lt;img src=\"x\" onerror=\"window.injected = 1\"&gt;" in html  # shown as the characters they are
    assert "[click](javascript:window.injected=3)" in html
    assert page.evaluate("window.injected") is None

    # a user's message is shown as typed, and whatever the model answers goes through the same renderer
    page.locator("#max-tokens").fill("8")
    ask(page, hostile)
    finished_answer(page, 0)
    assert page.locator(".message.user .content").text_content() == hostile
    assert page.locator("#messages img, #messages script, #messages iframe").count() == 0
    assert page.evaluate("window.injected") is None
