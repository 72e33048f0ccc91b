#!/usr/bin/env bash
# Install the Vercel AI SDK (`ai` and its OpenAI provider) into .cache/ai-sdk for the embeddings
# and agent end-to-end tests (tests/e2e/js/embed.mjs, agent.mjs).
# AI_SDK_VERSIONS="ai@7.0.173 @ai-sdk/openai@4.0.118" pins other versions.
exec bash "$(dirname "$0")/npm_prefix.sh" "Vercel AI SDK" .cache/ai-sdk "${AI_SDK_VERSIONS:-ai@7.0.173 @ai-sdk/openai@4.0.118}"
