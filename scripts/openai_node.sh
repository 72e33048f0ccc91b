#!/usr/bin/env bash
# Install the OpenAI Node SDK into .cache/openai-node for its end-to-end test
# (tests/e2e/js/logprobs.mjs). OPENAI_NODE_VERSION="openai@7.60.0" pins another version.
exec bash "$(dirname "$0")/npm_prefix.sh" "OpenAI Node SDK" .cache/openai-node "${OPENAI_NODE_VERSION:-openai@7.60.0}"
