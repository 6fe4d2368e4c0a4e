# usage: ab.sh TAG ROUNDS ARGS...   (alternates base and new, same bench script)
tag=$1; rounds=$2; shift 2
out=/work/h-step2/bench/out/cpu_vm/step_host2
export PATH=/work/main/.venv/bin:$PATH
for r in $(seq $rounds); do
  for side in base2 new2; do
    cd /tmp/$side
    echo "== $tag $side round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=daemon:client:system:proto python bench/host_ceiling.py "$@" --json $out/$tag-$side-$r.json 2>&1 | grep -v "^wrote"
  done
done
