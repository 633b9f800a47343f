#!/usr/bin/env bash
# Make sure a Chromium the browser tests can drive is present, and say what was done.
#
# The browser tests (tests/browser/) drive Debian's Chromium through the Python `playwright`
# package with `executable_path`; they never run `playwright install` (which downloads
# browsers from a CDN). This script installs Debian's `chromium` package with apt-get when
# /usr/bin/chromium is missing and we are root on a system with apt-get. Anywhere else it
# installs nothing and says so; the browser tests then skip with that reason.
# It never fails the build: a missing browser is reported, not fatal.
set -u

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"

if [ -x "$CHROMIUM" ]; then
    echo "ensure_chromium: found $CHROMIUM ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: $CHROMIUM missing and no apt-get here; installed nothing (browser tests will skip)"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "ensure_chromium: $CHROMIUM missing and not root; installed nothing (browser tests will skip)."
    echo "ensure_chromium: to install it: sudo apt-get install -y chromium"
    exit 0
fi

echo "ensure_chromium: $CHROMIUM missing; installing Debian's chromium with apt-get (~500 MB)"
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if apt-get update -qq >"$log" 2>&1 &&
   apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >>"$log" 2>&1 &&
   [ -x "$CHROMIUM" ]; then
    echo "ensure_chromium: installed $("$CHROMIUM" --version 2>/dev/null)"
else
    echo "ensure_chromium: apt-get could not install chromium; installed nothing (browser tests will skip):"
    tail -n 5 "$log"
fi
rm -f "$log"
exit 0
