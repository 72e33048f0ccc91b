#!/usr/bin/env bash
# Install the coding-agent CLIs (Claude Code, Codex) into .cache/agent-clis; nothing to do when present.
# AGENT_CLIS_VERSIONS="@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0" pins other versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=.cache/agent-clis
PACKAGES=${AGENT_CLIS_VERSIONS:-"@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0"}
BIN=$PREFIX/node_modules/.bin
want() { for p in $PACKAGES; do echo "${p##*@}"; done; }
have() {
  "$BIN/claude" --version 2>/dev/null | awk '{print $1}'
  "$BIN/codex" --version 2>/dev/null | awk '{print $2}'
}
if [ -x "$BIN/claude" ] && [ -x "$BIN/codex" ] && [ "$(want)" = "$(have)" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "agent_clis.sh: npm not found (install Node.js 18+)" >&2; exit 1; }
mkdir -p "$PREFIX"
# shellcheck disable=SC2086
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error $PACKAGES
echo "agent CLIs: $(have | tr '\n' ' ')"
