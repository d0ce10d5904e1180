#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: Debian's Chromium for the
# dashboard's real-browser test (Playwright drives it through executable_path; we never
# run `playwright install`, which downloads a browser build). Idempotent: nothing to do
# when /usr/bin/chromium is already there. Needs root (or sudo) on Debian/Ubuntu.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: no apt-get here; install Chromium at /usr/bin/chromium" \
         "(the browser test is skipped without it)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium
