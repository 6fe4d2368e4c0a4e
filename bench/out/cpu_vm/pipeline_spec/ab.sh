#!/bin/bash
# alternate old (a345c63) and new (h-pipe) twice; stand-in device 2.24,0.16
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then d=/tmp/wt-main; else d=/work/wt-pipe; fi
    cd $d; export PYTHONPATH=$d/daemon:$d/client:$d/system:$d/proto
    for cyc in 16 0; do
      echo "== round $round $side ngram cycle $cyc"
      timeout 600 /work/main/.venv/bin/python bench/host_ceiling.py --device-ms 2.24,0.16 --speculative ngram --cycle $cyc --clients 16 64 --repeats 2 --json /tmp/ab-$side-$round-c$cyc.json 2>&1 | grep clients
    done
    echo "== round $round $side off"
    timeout 600 /work/main/.venv/bin/python bench/host_ceiling.py --device-ms 2.24,0.16 --clients 16 64 --repeats 2 --json /tmp/ab-$side-$round-off.json 2>&1 | grep clients
  done
done
