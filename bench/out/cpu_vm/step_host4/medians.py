"""Medians over the A/B rounds: python3 medians.py TAG[,TAG...] ... (reads TAG-{base4,new4}-{round}.json here; TAGs
joined by a comma are one set)."""
import glob
import json
import statistics
import sys

for arg in sys.argv[1:]:
    tags = arg.split(",")
    files = {side: sorted(f for t in tags for f in glob.glob(f"{t}-{side}-*.json")) for side in ("base4", "new4")}
    sides, tag = [s for s in files if files[s]], arg
    print(f"{tag}: median over rounds (round: best tok/s of 3 runs, the daemon's CPU µs a token of that run, "
          "the scheduler thread's CPU µs a token over the round's runs)")
    for clients, sampled in [(16, False), (64, False), (16, True), (64, True)]:
        for side in sides:
            tok, cpu, sched = [], [], []
            for f in files[side]:
                for lv in json.load(open(f))["levels"]:
                    if lv["clients"] == clients and lv["sampled"] == sampled:
                        tok.append(lv["tok_s"])
                        cpu.append(lv["daemon_cpu_us_per_token"])
                        sched.append(lv["cpu_us_per_token_by_thread"].get("scheduler", float("nan")))
            if tok:
                print(f"  {clients:3d} {'sampled' if sampled else 'greedy ':7s} {side:6s} {statistics.median(tok):8.0f} tok/s "
                      f"{statistics.median(cpu):5.0f} µs/tok  sched {statistics.median(sched):4.0f}   "
                      f"(n={len(tok)} tok/s {[round(t) for t in tok]} µs {[round(c) for c in cpu]} "
                      f"sched {[round(s) for s in sched]})")
