"""``cacheblend bench``: the paper's evaluation (TTFT and quality per method, recompute
ratio and number of chunks; KV-deviation sparsity) on the paper's data sets
(a data directory given by ``--data DIR`` or ``$CACHEBLEND_DATA``)."""
