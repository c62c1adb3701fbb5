#!/usr/bin/env bash
# The runs behind docs/benchmarks.md and README's speed table, one after another in one
# sitting (the machine otherwise idle), each writing its JSON and plots under OUT:
#
#     CACHEBLEND_DATA=../shared/data CACHEBLEND_VLLM_PYTHON=.venv-vllm/bin/python \
#         bash benchmarks/docs_runs.sh bench-out/docs
#
# Needs `make install`, `make vllm` (the vLLM peer and connector) and `make qwen` (the second model).
# 30–60 minutes on 2 cores, depending on the machine's speed. `benchmarks/report.py OUT/NAME.json` prints a run's table again.
set -euo pipefail
OUT=${1:?usage: docs_runs.sh OUT}
BIN=${BIN:-.venv/bin}
: "${CACHEBLEND_DATA:?set CACHEBLEND_DATA to the data folder}"
: "${CACHEBLEND_VLLM_PYTHON:?set CACHEBLEND_VLLM_PYTHON (make vllm: .venv-vllm/bin/python)}"
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
bench() { local name=$1; shift; echo "== $name: cacheblend bench $*"; "$BIN/cacheblend" bench "$@" \
    --json "$OUT/$name.json" --plots "$OUT/$name" 2>&1 | tee "$OUT/$name.txt"; }

# The whole answer on 6-passage musique prompts: TTFT, decode, a 64-token answer, vLLM beside.
bench e2e --dataset musique --split dev --limit 5 --chunks 6 --methods full,blend --ratios 0.15,0.05 \
    --answer-tokens 64 --peers vllm --compile-decode
# Five data sets, 4 test prompts of 4 passages each, every method, vLLM beside.
bench main --dataset musique,wikimqa,hotpotqa,multi_news,samsum --split test --limit 4 --chunks 4 \
    --ratios 0.05,0.15 --deviation 3 --peers vllm --answer-tokens 0
# TTFT and total answer time against the number of passages.
bench chunks --dataset musique --split test --limit 2 --methods full,reuse,blend --ratios 0.15 \
    --chunks 2,4,6,8 --peers vllm --answer-tokens 64 --compile-decode
# A ratio sweep on 10 musique test prompts of 6 passages.
bench musique10 --dataset musique --split test --limit 10 --chunks 6 --methods full,reuse,blend \
    --ratios 0.05,0.15,0.3 --answer-tokens 0
# The second model.
bench qwen --model qwen2.5-coder-0.5b-instruct --dataset musique,samsum --split test --limit 2 --chunks 4 \
    --ratios 0.15 --answer-tokens 0
# Chunk caches stored in bfloat16 against float32 (dev).
for kv in float32 bfloat16; do
    bench "kv-$kv" --dataset musique,hotpotqa --split dev --limit 8 --methods full,reuse,blend --ratios 0.15 \
        --kv-dtype "$kv" --answer-tokens 0
done
# The vLLM connector against plain vLLM and the in-process engine (docs/vllm.md, README).
echo "== vllm_fidelity"
"$(dirname "$CACHEBLEND_VLLM_PYTHON")/python" benchmarks/vllm_fidelity.py --split dev --limit 10 \
    --data "$CACHEBLEND_DATA" --variants blend@0.15 --out "$OUT/vllm-ttft-dev.json" 2>&1 | tee "$OUT/vllm.txt"
# The first call with passages the engine has not seen.
echo "== learn_first_call"
"$BIN/python" benchmarks/learn_first_call.py --data "$CACHEBLEND_DATA" --limit 5 2>&1 | tee "$OUT/learn.txt"
