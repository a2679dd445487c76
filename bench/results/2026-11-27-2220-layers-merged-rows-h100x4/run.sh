#!/bin/bash
# Call D (4 GPUs): GEMMs batched over a shared weight merged into one GEMM (plan space 13):
# the GPU epilogue tests (batched GEMMs with broadcast weights, bias and activations
# against f64 references), then the layer blocks at D = 4 and 2 with PyTorch in the same
# call (layer_bench with every plan candidate, the default call tuned, the forms; PyTorch;
# the report).
set -u
mkdir -p "$OUT"
source scripts/gpu-env.sh
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
BIN=.gpu/bin
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'; } > "$OUT/machine.txt" 2>&1
FUSION_BACKEND=cuda timeout 90 $BIN/test-epilogues --test-threads=1 > "$OUT/epilogues.log" 2>&1; echo "epilogues rc=$?"
FUSION_BACKEND=cuda timeout 60 $BIN/test-epilogues --ignored --test-threads=1 > "$OUT/epilogues-gpu.log" 2>&1; echo "epilogues gpu rc=$?"
for d in 4 2; do
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((d - 1)))
  t1=180; t3=60; [ $d = 2 ] && { t1=130; t3=50; }
  timeout $t1 $BIN/layer_bench --devices $d --plan-file "$OUT/plans-d$d.json" --json "$OUT/ours-layers-d$d.jsonl" > "$OUT/ours-d$d.log" 2>&1; echo "ours D=$d rc=$?"
  timeout $t3 python3 bench/torch_layers.py --out "$OUT/torch-layers-d$d.jsonl" > "$OUT/torch-d$d.log" 2>&1; echo "torch D=$d rc=$?"
  python3 bench/report_layers.py "$OUT/ours-layers-d$d.jsonl" "$OUT/torch-layers-d$d.jsonl" > "$OUT/table-d$d.md" 2>&1
done
grep -h "test result" "$OUT"/epilogues*.log
for d in 4 2; do echo "== D=$d"; grep -A8 "ours / bound" "$OUT/table-d$d.md" | cut -c1-300 | head -10; grep -A8 "default / best" "$OUT/table-d$d.md" | grep -v "ours / bound" | cut -c1-250 | head -10; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name logs.tgz ! -name "table-*" -delete
