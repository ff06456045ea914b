#!/usr/bin/env bash
# What the real-browser viewer tests (tests/viz/test_viz_browser.py) need: Debian's chromium and the
# playwright Python package that drives it. Playwright's own browser download is not used (the tests
# launch /usr/bin/chromium through executable_path), so no `playwright install`. CI runs it; on your
# machine `bash .ci/install_browser.sh`, then the README's test command includes those tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi  # apt-get needs root
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
fi
python -m pip install -q -c constraints.txt playwright  # the version lock's playwright
echo "browser tests ready: python -m pytest -q tests/viz/test_viz_browser.py"
