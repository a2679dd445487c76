#!/usr/bin/env bash
# The candle layer's sequence-parallel prefill at TP 4 with a plan file: which plan each
# fusion got per shape (tuned time against the default's), 512 and 2048 tokens.
set -u
source scripts/gpu-env.sh >/dev/null 2>&1
for lib in libcublas.so.13 libcurand.so.10 libcudart.so.13 libnccl.so.2; do
    found=$(python3 -c "import sys,glob
for p in sys.path:
    for f in glob.glob(p + '/nvidia/**/$lib', recursive=True):
        print(f); raise SystemExit" 2>/dev/null)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
done
export FUSION_BACKEND=cuda FUSION_TIMEOUT=120
w=/tmp/w.safetensors
for t in 512 2048; do
  FUSION_PLAN_CACHE=$OUT/plans-$t.json timeout 200 torchrun --nproc-per-node 4 --no-python .gpu/bin/candle_llama \
     --llama3-8b --weights $w --dtype bf16 --prefill $t --decode-steps 0 --sections > $OUT/sp-$t.log 2>&1
  echo "== $t rc=$?"; grep -E "^\| fusions|sections" $OUT/sp-$t.log | head -3
  python3 -c "
import json,sys
d=json.load(open('$OUT/plans-$t.json'))
for v in d['entries'].values(): print(v['fusion'], v['shapes'], v['plan'], v['ms'], 'default', v['default_ms'])
"
done
