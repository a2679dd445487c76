# Source this on a GPU machine before running fusion binaries:  source scripts/gpu-env.sh
#
# cudarc loads NCCL as `libnccl.so`, but NCCL's Python wheel (the only NCCL on the GPU
# machines) ships `libnccl.so.2`. This finds that file, makes a directory with a
# `libnccl.so` symlink to it, and puts the directory (and the CUDA toolkit's libraries) on
# LD_LIBRARY_PATH. It also keeps NVLink multicast off, as the machines require.

_fusion_nccl=""
for _d in $(python3 -c 'import sys; print(" ".join(p for p in sys.path if p))' 2>/dev/null) /usr/lib/x86_64-linux-gnu /usr/local/lib; do
    for _f in "$_d"/nvidia/nccl/lib/libnccl.so.2 "$_d"/libnccl.so.2; do
        if [ -f "$_f" ]; then _fusion_nccl="$_f"; break 2; fi
    done
done
if [ -n "$_fusion_nccl" ]; then
    _fusion_libdir="${TMPDIR:-/tmp}/fusion-nccl-lib"
    mkdir -p "$_fusion_libdir"
    ln -sf "$_fusion_nccl" "$_fusion_libdir/libnccl.so"
    export LD_LIBRARY_PATH="$_fusion_libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-env: NCCL from $_fusion_nccl" >&2
else
    echo "gpu-env: no libnccl.so.2 found (pip wheel nvidia-nccl-*); multi-GPU runs will fail" >&2
fi
for _c in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -d "$_c" ]; then export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$_c"; fi
done
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
unset _fusion_nccl _fusion_libdir _d _f _c

# Binaries staged by scripts/stage-gpu.sh travel packed: unpack them once.
if [ -f .gpu/bin.tar.xz ] && { [ ! -d .gpu/bin ] || [ .gpu/bin.tar.xz -nt .gpu/bin ]; }; then
    rm -rf .gpu/bin && tar xJf .gpu/bin.tar.xz -C .gpu && touch .gpu/bin
fi
