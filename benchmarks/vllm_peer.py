"""vLLM CPU as a TTFT peer: now part of the core package, ``cacheblend.bench.vllm_peer``.

This wrapper keeps the old command working; prefer

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m cacheblend.bench.vllm_peer bench-out/vllm_peer_in.json \
        --out bench-out/vllm_peer.json
"""

from cacheblend.bench.vllm_peer import main

if __name__ == "__main__":
    main()
