"""The scheduler thread's cProfile (NTX_CEILING_PROFILE) of each side: python3 profsum.py prof-base3.out prof-new3.out.
Per side: seconds (cumulative, under the profiler) in the loop's own pieces, and calls."""
import pstats
import sys

PIECES = [("loop.py", "_running_all"), ("loop.py", "_describe"), ("loop.py", "compose"), ("policy.py", "compose"),
          ("loop.py", "admit"), ("prefix_cache.py", "open"), ("prefix_cache.py", "catch_up"),
          ("kv_cache.py", "copy_blocks"), ("loop.py", "_live_kv"), ("policy.py", "common_prefix"),
          ("loop.py", "iterate"), ("steps.py", "run")]
for path in sys.argv[1:]:
    st = pstats.Stats(path).stats
    print(path)
    for fname, func in PIECES:
        hits = [(v, k) for k, v in st.items() if k[0].endswith(fname) and k[2] == func]
        for (cc, nc, tt, ct, _), k in hits:
            print(f"  {fname}:{k[1]} {func:14s} calls {nc:7d}  own {tt:7.3f} s  cumulative {ct:7.3f} s")
