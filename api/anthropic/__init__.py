"""Anthropic-compatible surface: POST /v1/messages and /v1/messages/count_tokens (API-2)."""
