source scripts/gpu-env.sh >/dev/null
export FUSION_BACKEND=cuda
B=.gpu/bin/layer_bench
run() { # label env... -- args
  local label=$1; shift
  local r=$(env "$@" 2>&1 | grep -E "pipelined |rror|panick" | head -2 | tr '\n' ' ')
  echo "$label | $r"
}
for shape in "1024,1024,1024" "2048,2048,8192" "4096,4096,14336" "8192,4096,14336"; do
  for e in "X=1" "FUSION_FREE_LIST=0" "FUSION_CUBLASLT=0" "FUSION_GRAPHS=0"; do
    run "$shape $e" $e timeout 60 $B --devices 2 --shapes $shape --blocks mlp --row-ranges "" --iters 2 --warmup 1
  done
done
run "8192,4096,14336 d1" X=1 timeout 60 $B --devices 1 --shapes 8192,4096,14336 --blocks mlp --row-ranges "" --iters 2 --warmup 1
run "8192,4096,14336 f32" X=1 timeout 60 $B --devices 2 --shapes 8192,4096,14336 --blocks mlp --row-ranges "" --iters 2 --warmup 1 --dtype f32
run "8192,4096,14336 gated" X=1 timeout 60 $B --devices 2 --shapes 8192,4096,14336 --blocks gated --row-ranges "" --iters 2 --warmup 1
for m in 1024 2048; do
  run "tp_mlp m=$m h=1024 f=4096" X=1 timeout 120 .gpu/bin/tp_mlp --devices 2 --dtype bf16 -m $m --hidden 1024 -f 4096
done
