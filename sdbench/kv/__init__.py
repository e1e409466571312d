"""KV caches: a dense position-indexed cache, and (later) sparse views over it."""

from sdbench.kv.cache import DenseKVCache, KVCache

__all__ = ["DenseKVCache", "KVCache"]
