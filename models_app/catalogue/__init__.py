"""The catalogue: models, aliases and instances; their writes (services), reads (selectors), cross-process control messages and hot caches."""
