#!/bin/bash
# Call B (4 GPUs): where the GEMM+RS's time goes at D = 4: the storer kernel as it is, with
# no rank waiting for another (RS_PROBE_NO_WAITS), with plain stores instead of reductions
# over the links (RS_PROBE_STORES), and both. Timing only for the probes.
set -u
mkdir -p "$OUT"
H=.gpu/quick/hg
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/machine.txt"
for v in rs_now rs_nowait rs_stores rs_stores_nowait rs_now; do
  for d in 4 2; do
    timeout 60 $H/$v $d 20 > "$OUT/$v-d$d.log" 2>&1; echo "$v d$d rc=$?"
    [ -f "$OUT/$v-d$d.log" ] && mv "$OUT/$v-d$d.log" "$OUT/$v-d$d-$(date +%s%N).log"
  done
done
cat "$OUT/machine.txt"
for f in "$OUT"/*.log; do echo "== $(basename $f)"; sed -n '/^    M     K     N/,$p' "$f" | tail -5 | cut -c1-200; done
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . && find "$OUT" -name "*.log" -delete
