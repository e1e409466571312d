"""KV caches: the position-indexed dense cache (cache.py) and fixed-budget sparse views over it (sparse.py)."""
