"""Drives the playground page of a running gpt-server in headless Chromium (selenium with
Debian's chromium and chromium-driver) and checks it against the API itself:

- the page loads with no console errors and shows the model;
- with `--api-key`, the key field is shown, a request without it fails with the server's
  message, and with it a completion streams into the output: greedy text equal to the API's,
  every piece shaded by its probability with its alternatives in a tooltip;
- a chat turn streams the same text as `/v1/chat/completions`;
- the attention heatmap has one cell per (query, key <= query) pair of the prompt's tokens, for a
  head and for the mean over heads.

    python tests/browser/playground_check.py http://127.0.0.1:18185 API_KEY SCREENSHOT_DIR [TOKENS]

(TOKENS, default 12: how many tokens the completion and chat checks generate.)

Exits non-zero on any failure. `.ci/browser.sh` runs it.
"""
import json
import pathlib
import sys
import urllib.request

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

base, key, shots = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 12
shots.mkdir(parents=True, exist_ok=True)


def api(path, body):
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request) as resp:
        return json.load(resp)


options = webdriver.ChromeOptions()
for flag in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"]:
    options.add_argument(flag)
options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"), options=options)
wait = WebDriverWait(driver, 60)
by_id = lambda i: driver.find_element(By.ID, i)


def fill(element_id, text):
    element = by_id(element_id)
    element.clear()
    element.send_keys(text)


def status():
    return by_id("status").get_attribute("data-state") or ""


try:
    driver.get(base + "/")
    with urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers={"authorization": f"Bearer {key}"})) as r:
        model = json.load(r)["data"][0]
    wait.until(lambda d: model["id"] in by_id("model-meta").text)
    assert str(model["max_model_len"]) in by_id("model-meta").text, by_id("model-meta").text

    # Completion: without the key the server's own message shows; with it, the text streams.
    prompt = "First Citizen:\nBefore we proceed"
    assert by_id("apikey-box").is_displayed(), "the server has --api-key: the key field must show"
    fill("prompt", prompt)
    fill("max_tokens", str(tokens))
    fill("temperature", "0")
    by_id("generate").click()
    wait.until(lambda d: status() == "error")
    assert "API key" in by_id("status").text, by_id("status").text
    fill("apikey", key)
    by_id("generate").click()
    wait.until(lambda d: status().startswith("done"))
    pieces = driver.find_elements(By.CSS_SELECTOR, "#output .tok")
    generated = "".join(p.get_attribute("textContent") for p in pieces)
    expected = api("/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0})["choices"][0]["text"]
    assert pieces and generated == expected, (generated, expected)
    for p in pieces:
        assert p.get_attribute("data-p") and "%" in p.get_attribute("title"), p.get_attribute("outerHTML")
        assert "background" in (p.get_attribute("style") or ""), p.get_attribute("outerHTML")
    driver.save_screenshot(str(shots / "completion.png"))

    # Chat: one turn, the API's greedy answer.
    by_id("tab-chat").click()
    # The message box starts empty (typing must not append to an example); the example is a placeholder.
    assert by_id("chat-input").get_attribute("value") == "", by_id("chat-input").get_attribute("value")
    assert by_id("chat-input").get_attribute("placeholder"), "the chat box has no placeholder"
    fill("max_tokens", str(tokens))
    fill("chat-input", "Speak")
    by_id("send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done=true]"))
    answer = "".join(p.get_attribute("textContent") for p in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok"))
    expected = api("/v1/chat/completions", {"messages": [{"role": "user", "content": "Speak"}],
                                            "max_completion_tokens": tokens, "temperature": 0})
    assert answer == expected["choices"][0]["message"]["content"], (answer, expected)
    driver.save_screenshot(str(shots / "chat.png"))

    # Attention: a cell per query and each key up to it.
    by_id("tab-attention").click()
    text = "To be, or not to be"
    fill("attention-prompt", text)
    n = len(api("/tokenize", {"prompt": text})["tokens"])
    by_id("show-attention").click()
    cells = lambda d: len(d.find_elements(By.CSS_SELECTOR, "#heatmap #cells rect"))
    wait.until(lambda d: cells(d) == n * (n + 1) // 2)
    by_id("mean-heads").click()
    assert cells(driver) == n * (n + 1) // 2
    driver.save_screenshot(str(shots / "attention.png"))

    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
              and "401" not in e["message"]]  # the request made without the key, on purpose
    assert not errors, errors
    print(f"playground in {driver.capabilities.get('browserVersion')}: page, completion, chat and "
          f"attention ({n} tokens) OK; screenshots in {shots}")
finally:
    driver.quit()
