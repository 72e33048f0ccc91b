#!/usr/bin/env bash
# Install one Debian package with apt-get when run as root: deb_package.sh PACKAGE PURPOSE [WITHOUT].
# The caller checks first that the package is missing (the Makefile's openblas, chromium and haproxy
# targets). PURPOSE says what it is for. WITHOUT says what happens when it stays missing (not root, no
# apt-get, or the install failed): given, it is printed as a warning and the script succeeds; left
# out, the script fails.
set -uo pipefail
package=$1 purpose=$2 without=${3:-}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "Installing $package ($purpose)..."
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null; then
    exit 0
  fi
  problem="could not install $package"
else
  problem="$package missing and apt-get unavailable (or not root)"
fi
if [ -n "$without" ]; then
  echo "WARNING: $problem; $without."
  exit 0
fi
echo "$problem: install it (Debian: apt-get install $package)" >&2
exit 1
