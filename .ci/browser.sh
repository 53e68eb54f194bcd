#!/usr/bin/env bash
# The playground in a real browser: headless Chromium (Debian's chromium and chromium-driver,
# driven by selenium from PyPI) against gpt-server on the fixture checkpoint, with an API key.
# Screenshots land in target/ci/browser. Rerun alone with `.ci/browser.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromedriver >/dev/null; then
  sudo=$(command -v sudo || true)
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium chromium-driver fonts-dejavu-core
fi
venv=${BROWSER_VENV:-target/ci/venv-browser}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import selenium" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "selenium==4.*"
fi
[ "${SETUP_ONLY:-}" = 1 ] && exit 0  # (.ci/prefetch.sh: the environment made, nothing run)
cargo build --release --locked -p gpt-server -p gpt-train  # the set .ci/run builds: no rebuild

mkdir -p target/ci/browser
port=18185
./target/release/gpt-server --checkpoint tests/fixtures/tiny-gpt2 --port $port --device cpu --api-key ci-key \
  > target/ci/browser/server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.2; done
curl -sf http://127.0.0.1:$port/health >/dev/null || { echo "gpt-server did not start"; cat target/ci/browser/server.log; exit 1; }
"$venv/bin/python" tests/browser/playground_check.py "http://127.0.0.1:$port" ci-key target/ci/browser
