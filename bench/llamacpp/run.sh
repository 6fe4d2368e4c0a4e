#!/usr/bin/env bash
# llama-bench on our synthetic files: pp512 and tg128, all layers on the GPU, JSON out.
#   [THREADS=T] bench/llamacpp/run.sh LLAMA_BENCH OUT.json FILE.gguf...   (THREADS: -t T)
set -euo pipefail
bin=$1; out=$2; shift 2
args=(); for f in "$@"; do args+=(-m "$f"); done
"$bin" "${args[@]}" -p 512 -n 128 -ngl 99 ${THREADS:+-t "$THREADS"} -r 3 -o json > "$out"
