#!/bin/bash
# Call C (4 GPUs): the layer blocks at D = 4 and 2 with PyTorch in the same call
# (run-layers.sh's benchmark steps without its checks: layer_bench with every plan
# candidate, the default call tuned, the forms; a second process on the plan file;
# PyTorch; the report), plan space 11.
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
BIN=.gpu/bin
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'; } > "$OUT/machine.txt" 2>&1
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  t1=180; t2=70; t3=60; [ $d = 2 ] && { t1=130; t2=50; t3=50; }
  timeout $t1 $BIN/layer_bench --devices $d --plan-file "$OUT/plans-d$d.json" --json "$OUT/ours-layers-d$d.jsonl" > "$OUT/ours-d$d.log" 2>&1; echo "ours D=$d rc=$?"
  timeout $t2 $BIN/layer_bench --devices $d --plan-file "$OUT/plans-d$d.json" --only-default --json "$OUT/ours-layers-d$d-second.jsonl" > "$OUT/ours-second-d$d.log" 2>&1; echo "second D=$d rc=$?"
  timeout $t3 python3 bench/torch_layers.py --out "$OUT/torch-layers-d$d.jsonl" > "$OUT/torch-d$d.log" 2>&1; echo "torch D=$d rc=$?"
  python3 bench/report_layers.py "$OUT/ours-layers-d$d.jsonl" "$OUT/torch-layers-d$d.jsonl" "$OUT/ours-layers-d$d-second.jsonl" > "$OUT/table-d$d.md" 2>&1
  grep -h "plan decisions" "$OUT"/ours*-d$d.log
done
for d in 4 2; do echo "== D=$d"; grep -A8 "ours / bound\|default / GEMMs" "$OUT/table-d$d.md" | cut -c1-300 | head -12; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz -delete
