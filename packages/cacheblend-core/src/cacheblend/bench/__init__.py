"""``cacheblend bench``: the paper's evaluation (TTFT and quality per method, recompute
ratio and number of chunks; KV-deviation sparsity) on the data sets in ../shared/data."""
