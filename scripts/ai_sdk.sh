#!/usr/bin/env bash
# Install the Vercel AI SDK (`ai` and its OpenAI provider) into .cache/ai-sdk for the embeddings
# end-to-end test (tests/e2e/js/embed.mjs); nothing to do when the pinned versions are there.
# AI_SDK_VERSIONS="ai@7.0.173 @ai-sdk/openai@4.0.118" pins other versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=.cache/ai-sdk
PACKAGES=${AI_SDK_VERSIONS:-"ai@7.0.173 @ai-sdk/openai@4.0.118"}
STAMP=$PREFIX/.installed
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PACKAGES" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "ai_sdk.sh: npm not found (install Node.js 18+)" >&2; exit 1; }
mkdir -p "$PREFIX"
# shellcheck disable=SC2086
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error $PACKAGES
echo "$PACKAGES" > "$STAMP"
echo "Vercel AI SDK: $PACKAGES"
