# usage: ab.sh TAG ROUNDS ARGS...   (alternates base and new, same bench script)
tag=$1; rounds=$2; shift 2
out=/work/wt-serve/bench/out/cpu_vm/serve_cpu
cp /work/wt-serve/bench/host_ceiling.py /work/wt-base/bench/host_ceiling.py
export PATH=/work/main/.venv/bin:$PATH
for r in $(seq $rounds); do
  for side in base new; do
    wt=/work/wt-base; [ $side = new ] && wt=/work/wt-serve
    cd $wt
    echo "== $tag $side round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=daemon:client:system:proto python bench/host_ceiling.py "$@" --json $out/$tag-$side-$r.json 2>&1 | grep -v "^wrote"
  done
done
