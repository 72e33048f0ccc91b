"""Coding-agent CLIs (Claude Code, Codex) against a local capture server."""
