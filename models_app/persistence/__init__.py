"""Durable persistence: write-behind, the Celery publisher and tasks."""
