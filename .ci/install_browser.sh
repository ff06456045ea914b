#!/usr/bin/env bash
# CI: what the real-browser viewer test (tests/viz/test_browser.py) needs — Debian's chromium and
# the playwright Python package that drives it. Playwright's own browser download is not used
# (the test launches /usr/bin/chromium through executable_path), so no `playwright install`.
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
fi
pip install -q playwright
