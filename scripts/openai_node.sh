#!/usr/bin/env bash
# Install the OpenAI Node SDK into .cache/openai-node for its end-to-end test
# (tests/e2e/js/logprobs.mjs); nothing to do when the pinned version is there.
# OPENAI_NODE_VERSION="openai@7.60.0" pins another version.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=.cache/openai-node
PACKAGES=${OPENAI_NODE_VERSION:-"openai@7.60.0"}
STAMP=$PREFIX/.installed
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PACKAGES" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "openai_node.sh: npm not found (install Node.js 18+)" >&2; exit 1; }
mkdir -p "$PREFIX"
# shellcheck disable=SC2086
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error $PACKAGES
echo "$PACKAGES" > "$STAMP"
echo "OpenAI Node SDK: $PACKAGES"
