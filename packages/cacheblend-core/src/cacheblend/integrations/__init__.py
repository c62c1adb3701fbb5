"""Adapters that plug the CacheBlend core into other serving engines (vLLM, ...).

Each adapter module imports its engine itself, so ``import cacheblend`` never needs them."""
