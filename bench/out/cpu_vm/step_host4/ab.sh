# usage: ab.sh TAG ROUNDS ARGS...   (alternates base4 and new4, same bench script; each run under the bench lock)
tag=$1; rounds=$2; shift 2
out=/work/h-samp/bench/out/cpu_vm/step_host4
for r in $(seq $rounds); do
  for side in base4 new4; do
    cd /tmp/$side
    echo "== $tag $side round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    flock /tmp/ntx-bench.lock env PYTHONPATH=daemon:client:system:proto /work/main/.venv/bin/python bench/host_ceiling.py "$@" --json $out/$tag-$side-$r.json 2>&1 | grep -v "^wrote"
  done
done
