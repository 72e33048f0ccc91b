"""Accounting: API keys, who a key belongs to, usage, limits and the ready-to-paste snippets."""
