#!/usr/bin/env bash
# Builds the release examples and test binaries here and copies them into .gpu/ (ignored
# by git, carried to the GPU machine by the device tool). Usage: scripts/stage-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/bin
cargo build --release --examples
for ex in target/release/examples/*; do
    case "$ex" in *.d|*-*) continue ;; esac
    [ -x "$ex" ] && cp "$ex" .gpu/bin/
done
cargo test --release --no-run --message-format=json --test conformance --test passes_and_errors --test cuda_kernels --test launched --test cuda_buffers --test cuda_graphs --test layers --test epilogues 2>/dev/null \
  | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' \
  | while read -r name exe; do cp "$exe" ".gpu/bin/test-$name"; done
strip --strip-debug .gpu/bin/*
ls -la .gpu/bin
du -sh .gpu
