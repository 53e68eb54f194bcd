"""The README's playground screenshot: a sampled completion from the default model, in headless
Chromium. Run against `gpt-server` on weights/:

    python tests/browser/readme_screenshot.py http://127.0.0.1:8080 docs/playground.png
"""
import sys

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import WebDriverWait

base, out = sys.argv[1], sys.argv[2]
options = webdriver.ChromeOptions()
for flag in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,640"]:
    options.add_argument(flag)
driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"), options=options)
try:
    driver.get(base + "/")
    for element_id, value in [("prompt", "ROMEO:\n"), ("max_tokens", "240"), ("temperature", "0.8"), ("seed", "7")]:
        element = driver.find_element(By.ID, element_id)
        element.clear()
        element.send_keys(value)
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, 60).until(lambda d: (d.find_element(By.ID, "status").get_attribute("data-state") or "").startswith("done"))
    driver.save_screenshot(out)
    print(f"saved {out}")
finally:
    driver.quit()
