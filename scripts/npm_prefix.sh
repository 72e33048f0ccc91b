#!/usr/bin/env bash
# Install npm PACKAGES into the folder PREFIX (relative to the checkout) for an end-to-end test;
# nothing to do when exactly those packages are there already. Usage: npm_prefix.sh LABEL PREFIX PACKAGES
set -euo pipefail
cd "$(dirname "$0")/.."
LABEL=$1 PREFIX=$2 PACKAGES=$3
STAMP=$PREFIX/.installed
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PACKAGES" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "$LABEL: npm not found (install Node.js 18+)" >&2; exit 1; }
mkdir -p "$PREFIX"
# shellcheck disable=SC2086
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error $PACKAGES
echo "$PACKAGES" > "$STAMP"
echo "$LABEL: $PACKAGES"
