#!/usr/bin/env bash
# The paper's Llama (budgets 0.05, 0.13, 1.0) and BERT (0.01, 0.05, 1.0) traced by `memprof trace`,
# one process each, in parallel; then tools/bench_attribution.py over the six captures.
#     bash tools/attribution_sweep.sh [OUT_DIR]        (GPU machine; ~5 minutes on an H200)
set -u
out=${1:-attribution_sweep}
mkdir -p "$out"
pids=()
for b in 0.05 0.13 1.0; do
  python -m memprof trace examples/train_llama.py --paper --steps "${LLAMA_STEPS:-21}" --budget "$b" \
    -o "$out/llama_$b.memprof" --force > "$out/llama_$b.log" 2>&1 &
  pids+=($!)
done
for b in 0.01 0.05 1.0; do
  python -m memprof trace examples/train_bert.py --paper --steps "${BERT_STEPS:-5}" --budget "$b" \
    -o "$out/bert_$b.memprof" --force > "$out/bert_$b.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ "$status" = 0 ] || echo "attribution_sweep: a trace failed; see $out/*.log" >&2
python tools/bench_attribution.py "$out"/llama_*.memprof "$out"/bert_*.memprof
