"""The chunk-cache service: chunk keys and precompute policy, ingest, lookup with
verification, retry on damaged entries, release (:mod:`.chunks`).  Imports nothing here,
so that :mod:`.keys` stays usable without torch."""
