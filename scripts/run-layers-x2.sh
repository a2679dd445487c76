#!/usr/bin/env bash
# bench/run-layers.sh on two GPUs (for scripts/gpu-session.sh).
exec bash "$(dirname "$0")/../bench/run-layers.sh"
