# usage: ab.sh TAG ROUND ARGS...   (one round: base3 then new3, the same bench script; run under the shared bench lock)
tag=$1; r=$2; shift 2
out=/work/h-run/bench/out/cpu_vm/step_host3
export PATH=/work/main/.venv/bin:$PATH
for side in base3 new3; do
  cd /tmp/$side
  echo "== $tag $side round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=daemon:client:system:proto python bench/host_ceiling.py "$@" --json $out/$tag-$side-$r.json 2>&1 | grep -v "^wrote"
done
