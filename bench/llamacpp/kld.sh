#!/usr/bin/env bash
# llama.cpp's own KL divergence (issue 35's table, llama.cpp's GPU and CPU rows): llama-perplexity's run of
# a GGUF against its run of the same model in F32 (`ntx-model quantize --type f32`), ctx 512, the first
# $CHUNKS chunks of each text, every layer on the GPU (-ngl 99) and then on the host with no GPU visible
# (-ngl 0 alone is not a CPU run: a CUDA build sends prompt batches' matrix products to the GPU anyway,
# and gave the -ngl 99 figures to every digit on the H100, 2026-12-05).
#   bench/llamacpp/kld.sh BIN_DIR MODEL.gguf F32.gguf TEXT...     (BIN_DIR: build.sh's build/bin)
set -uo pipefail
bin=$1; model=$2; f32=$3; shift 3
for t in "$@"; do
  name=$(basename "$t"); base=/tmp/kld-base-$name.bin
  "$bin"/llama-perplexity -m "$f32" -f "$t" -c 512 -b 512 --chunks "${CHUNKS:-6}" -ngl 99 \
    --kl-divergence-base "$base" > /tmp/kld-base-$name.log 2>&1 || { tail -5 /tmp/kld-base-$name.log; continue; }
  for ngl in 99 0; do
    echo "== $name: llama.cpp -ngl $ngl ($(basename "$model")) against its F32 run (-ngl 99)"
    gpus=(); [ "$ngl" = 0 ] && gpus=(env CUDA_VISIBLE_DEVICES=)
    "${gpus[@]}" "$bin"/llama-perplexity -m "$model" -f "$t" -c 512 -b 512 --chunks "${CHUNKS:-6}" -ngl $ngl \
      -t "${THREADS:-16}" --kl-divergence-base "$base" --kl-divergence 2>&1 \
      | grep -E "Mean +KLD|99\.0% +KLD|Same top p *:|Mean PPL|chunks|CUDA devices|no usable GPU" | head -12
  done
done
