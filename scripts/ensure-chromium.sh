#!/usr/bin/env bash
# Install Debian's Chromium and its WebDriver when missing: the explorer's browser test
# (tests/test_ui.py) drives `cacheblend ui` with them through Selenium.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "chromium/chromedriver are missing; install them (Debian: apt-get install chromium chromium-driver)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
