#!/usr/bin/env bash
# Make the ignored folders bench/session_round.sh's device calls carry, in a fresh checkout:
#   .whl        cp312 wheels the GPU machine lacks or has too old (gguf, grpcio and its health and
#               reflection parts, protobuf, threadpoolctl, pytest-timeout)
#   .whl-extra  the llguidance wheel the daemon imports
#   .llama      the slim llama.cpp source (bench/llamacpp/make_tarball.sh)
#   .gpu-data   the default model's first 4 layers (ntx-model slice) and a license text
#   .gpu-full-a, .gpu-full-b  the default model in two halves (a call carries 64 MiB at most),
#               the second with the KL texts (GPL-3, MPL-1.1)
#   .ab         `git archive` of the checkouts ab_decode's A/A compares (AB_OLD, AB_MID)
# and list them in .git/info/exclude. Needs .venv (packaging/dev/bootstrap) and the network.
#   bench/make_carries.sh            # everything;  ONLY="whl llama" bench/make_carries.sh: some
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
       --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
       --platform manylinux2014_x86_64 -d "$@"; }
for d in .whl .whl-extra .llama .gpu-data .gpu-full-a .gpu-full-b .ab; do
  grep -qx "$d/" .git/info/exclude 2>/dev/null || echo "$d/" >> .git/info/exclude
done
if want whl; then
  mkdir -p .whl .whl-extra
  dl .whl gguf "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" "protobuf>=7.35.1" \
    threadpoolctl pytest-timeout
  dl .whl-extra "llguidance>=1.9.1,<2"
fi
want llama && [ ! -f .llama/llama.cpp-slim.tar.gz ] && bash bench/llamacpp/make_tarball.sh
model=$(.venv/bin/python -c "from ntransformerd.engine.runtime.engine import default_model_path as p; print(p())")
if want model; then
  mkdir -p .gpu-data .gpu-full-a .gpu-full-b
  [ -f .gpu-data/smollm2-4l.gguf ] || .venv/bin/ntx-model slice --layers 4 --quiet "$model" .gpu-data/smollm2-4l.gguf
  half=$((50 * 1024 * 1024))
  head -c $half "$model" > .gpu-full-a/part
  tail -c +$((half + 1)) "$model" > .gpu-full-b/part
  cat .gpu-full-a/part .gpu-full-b/part | cmp -s - "$model"
  for t in GPL-3 MPL-1.1; do cp "/usr/share/common-licenses/$t" .gpu-full-b/; done
  cp /usr/share/common-licenses/GPL-3 .gpu-data/
fi
if want ab; then
  mkdir -p .ab
  git archive "${AB_OLD:-12d0660}" daemon client system kernels pyproject.toml | gzip > .ab/old.tgz
  git archive "${AB_MID:-3d8e7d8}" daemon client system proto kernels pyproject.toml | gzip > .ab/mid.tgz
fi
du -sh .whl .whl-extra .llama .gpu-data .gpu-full-a .gpu-full-b .ab 2>/dev/null
