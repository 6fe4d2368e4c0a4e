"""The benchmark of record: decode rates on the path users take, against llama-bench in the same run.

For each plan (the 8B-shaped Q4_K_M at 32 / 24 / 16 / 8 / 0 resident layers, the 70B-shaped at a
24 GiB budget) one daemon is started (`ntransformerd --backend cuda`, the plan's `--vram-budget`,
host compute `auto`) and driven through the client library over its socket, one client, one
request at a time, greedy, without the prefix cache: a prompt of about 0, 1k and 4k tokens, then
`--tokens` tokens. The decode rate is the client's: tokens after the first over the time from
the first to the last, as they arrive. Between two rounds of ours, `llama-bench` runs once over
the same file with the same resident layer count (-ngl), threads (-t) and depths (-d), so the
two alternate `--rounds` times; medians and spreads of both are reported, and their ratio.

    python bench/user_path.py --dir /tmp/ntx --llama-bench /tmp/llama/.../llama-bench --plans 8b:32 8b:24 ...

Rows:
  - `8b:N`: the 8B-shaped file with N layers resident (the daemon's --vram-budget made for N;
    llama-bench -ngl N, 99 for all).
  - `70b:24GiB`: the 70B-shaped file at a 24 GiB budget (llama-bench at --ngl70, the largest
    -ngl that fits 24 GiB).
  - `--noisy 8b:N ...`: those rows again with a memory-copying load on 4 of the host's cores, for
    both engines (llama-bench then with --noisy-threads, default the cores left free: a thread
    on a busy core stalls its team at every barrier).
  - `--off 8b:N ...`: those rows again with `--host-compute off` (pure streaming), quiet and, where
    also in --noisy, beside the load.
  - `--cli 8b:N`: `ntx-model run` on that plan at depth 0, beside the daemon's figure.

Prints a table (the one that opens bench/RESULTS.md), writes JSON and, where matplotlib is there,
a PNG plot next to it. Work is cut at `--deadline` seconds (what ran is written).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEPTHS = (0, 1024, 4096)
NOISE_CORES = 4


def client_rate(sock: str, prompt_ids: list[int], tokens: int) -> dict:
    """One greedy request through the client library: the decode rate as the client sees it."""
    from ntx_client import Client
    times = []
    t0 = time.perf_counter()
    with Client(sock) as c:
        for chunk in c.generate(prompt_ids=prompt_ids, max_tokens=tokens, temperature=0, ignore_eos=True,
                                prefix_cache=False):
            now = time.perf_counter()
            times += [now] * len(chunk.ids)
    if len(times) < 2:
        raise SystemExit(f"the daemon gave {len(times)} tokens, asked for {tokens}")
    return {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def one_row_placement(sock: str) -> tuple[int, int, float] | None:
    """(host layers, steps measured, their summed seconds) of the placement for one-row steps, or
    None where the plan has none (all resident, or host compute off)."""
    from ntx_client import Client
    with Client(sock) as c:
        for p in c.status().placements:
            if p.rows == 1:
                return len(p.host_layers), p.steps, p.measured_step_seconds * p.steps
    return None


def prompt_of(depth: int, vocab: int, seed: int) -> list[int]:
    import numpy as np
    n = max(depth, 4)
    return [int(x) for x in np.random.default_rng(seed).integers(100, min(vocab, 30000), n)]


def budget_for(path: str, resident: int, max_ctx: int) -> tuple[int, int]:
    """(--vram-budget, --kv-blocks) whose plan keeps the first `resident` layers and streams the
    rest: the plan's fixed, KV and workspace bytes, those layers and two streaming slots."""
    from ntransformerd.engine import tiers
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.runtime.engine import EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(path)
    n = model.config.n_layers
    sizes = [cuda.layer_nbytes(model, i) for i in range(n)]
    cfg = EngineConfig(backend="cuda", max_ctx=max_ctx, max_vram_layers=resident)
    plan = tiers.model_plan(model, cfg, backend="cuda", vram_free=cuda.vram_free(), layer_bytes=sizes)
    lb = plan.layer_bytes
    slots = 2 * max(lb[resident:], default=0)
    slack = min(1 << 20, min(lb) // 2)
    budget = plan.fixed_bytes + plan.kv_bytes + plan.workspace_bytes + sum(lb[:resident]) + slots + slack
    return budget, tiers.kv_blocks_of(plan) or 0


def llama_rates(bin_: str, path: str, ngl: int, tokens: int, threads: int, depths) -> dict[int, float]:
    """One llama-bench run: tg at each depth (tokens/s)."""
    cmd = [bin_, "-m", path, "-ngl", str(ngl), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
           "-d", ",".join(str(d) for d in depths), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"llama-bench failed ({out.returncode}): {out.stderr[-1500:]}")
    return {int(r.get("n_depth", 0)): float(r["avg_ts"]) for r in json.loads(out.stdout)}


class Noise:
    """Processes copying memory (256 MiB arrays) on `cores` host cores: a noisy neighbour."""

    CODE = ("import numpy as np, os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
            "a = np.ones(1 << 28, np.uint8); b = np.empty_like(a)\nwhile True: np.copyto(b, a); np.copyto(a, b)")

    def __init__(self, cores: int):
        n = os.cpu_count() or 1
        self.procs = [subprocess.Popen([sys.executable, "-c", self.CODE, str(n - 1 - k)]) for k in range(cores)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@dataclasses.dataclass
class Row:
    name: str
    path: str
    flags: list[str]  # the daemon's
    ngl: int
    noisy: bool = False
    cli: bool = False
    off: bool = False


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def run_row(row: Row, a, deadline: float) -> dict:
    from ntransformerd.engine.gguf_file import GGUFModel
    vocab = GGUFModel(row.path).config.vocab_size
    depths = list(a.depths)
    out = {"row": row.name, "flags": row.flags, "ngl": row.ngl, "noisy": row.noisy, "host_compute":
           "off" if row.off else "auto", "depths": {}}
    threads = a.noisy_threads if row.noisy else a.threads
    noise = Noise(NOISE_CORES) if row.noisy else None
    work = tempfile.mkdtemp(prefix="ntx-userpath-")
    try:
        t0 = time.perf_counter()
        proc, sock = common.start_daemon(work, ["--model", row.path, "--backend", "cuda", "--max-batch", "1", "--max-ctx",
                                                str(max(depths) + a.tokens + 64), *row.flags])
        out["load_s"] = time.perf_counter() - t0
        try:
            from ntx_client import Client
            first = client_rate(sock, prompt_of(0, vocab, 99), 8)  # the first request's one-time work
            out["first_token_s"] = out["load_s"] + first["ttft_s"]  # from the daemon's start
            out["first_decode_tok_s"] = first["decode_tok_s"]
            ours = {d: [] for d in depths}
            moves = {d: [] for d in depths}  # the one-row placement after each request: host layers, its mean step
            theirs = {d: [] for d in depths}
            for r in range(a.rounds):
                if time.monotonic() > deadline:
                    out["cut"] = f"after {r} rounds: --deadline"
                    break
                for d in depths:
                    before = one_row_placement(sock)
                    ours[d].append(client_rate(sock, prompt_of(d, vocab, r), a.tokens)["decode_tok_s"])
                    after = one_row_placement(sock)
                    if before and after and after[1] > before[1]:  # where the host's share goes as context grows
                        moves[d].append({"host_layers": after[0], "step_ms": 1e3 * (after[2] - before[2])
                                         / (after[1] - before[1])})
                if a.llama_bench and not row.off:
                    for d, v in llama_rates(a.llama_bench, row.path, row.ngl, a.tokens, threads, depths).items():
                        theirs.setdefault(d, []).append(v)
            with Client(sock) as c:
                status = c.status()
                out["placements"] = [{"rows": p.rows, "host_layers": len(p.host_layers), "link_layers": p.link_layers,
                                      "predicted_ms": p.predicted_step_seconds * 1e3,
                                      "measured_ms": p.measured_step_seconds * 1e3, "steps": p.steps}
                                     for p in status.placements]
        finally:
            common.stop_daemon(proc)
        for d in depths:
            if ours[d]:
                cell = {"ours": spread(ours[d])}
                if theirs.get(d):
                    cell["llama"] = spread(theirs[d])
                    cell["ratio"] = cell["ours"]["median"] / cell["llama"]["median"]
                if moves[d]:
                    cell["placement"] = moves[d]
                out["depths"][str(d)] = cell
        if row.cli and time.monotonic() < deadline:
            out["cli"] = cli_rate(row, a)
    finally:
        if noise is not None:
            noise.stop()
    return out


def cli_rate(row: Row, a) -> dict:
    """`ntx-model run` on the same plan at depth 0 (its own JSON stats), median of 3."""
    flags = list(row.flags)
    cmd = [sys.executable, "-m", "ntransformerd.tools.ntx_model", "run", row.path, "--backend", "cuda",
           "--prompt", "The", "--temperature", "0", "--ignore-eos", "--max-tokens", str(a.tokens), "--json",
           "--ctx", str(max(a.depths) + a.tokens + 64), "--max-batch", "1", *flags]  # the daemon's context: its KV pool and plan
    rates = []
    for _ in range(3):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode:
            return {"error": out.stderr[-800:]}
        rates.append(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])
    return spread(rates)


def rows_of(a) -> list[Row]:
    """The rows `a` asks for: each plan (host compute auto, then off where --off names it), then
    the noisy ones (a plan again, beside the load)."""
    wanted = [(p, False, False) for p in a.plans] + [(p, False, True) for p in a.off]
    wanted += [(p, True, False) for p in a.noisy] + [(p, True, True) for p in a.noisy if p in a.off]
    rows = []
    for spec, noisy, off in wanted:
        shape, _, arg = spec.partition(":")
        name = spec + (" off" if off else "") + (" noisy" if noisy else "")
        cli = spec == a.cli and not noisy and not off
        mode = ["--host-compute", "off" if off else "auto"]
        if shape == "8b":
            path = common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", "q4_k_m")
            n = int(arg)
            flags = list(mode)
            if n < 32:
                budget, blocks = budget_for(path, n, max(a.depths) + a.tokens + 64)
                flags += ["--vram-budget", str(budget)] + (["--kv-blocks", str(blocks)] if blocks else [])
            rows.append(Row(name, path, flags, 99 if n >= 32 else n, noisy, cli, off))
        elif shape == "70b":
            path = common.synthetic(a.dir, "llama3-70b", "q4_k_m")
            rows.append(Row(name, path, [*mode, "--vram-budget", arg], a.ngl70, noisy, cli, off))
        else:
            raise SystemExit(f"--plans {spec!r}: 8b:N (N resident layers, 32 for all) or 70b:SIZE")
    return rows


def table(results: list[dict]) -> str:
    lines = ["| plan | depth | ours tok/s (min-max) | llama-bench tok/s (min-max) | ours / llama |",
             "|---|---|---|---|---|"]
    for r in results:
        for d, cell in r["depths"].items():
            o = cell["ours"]
            ll = cell.get("llama")
            lt = f"{ll['median']:.2f} ({ll['min']:.2f}-{ll['max']:.2f})" if ll else "-"
            ratio = f"{cell['ratio']:.2f}x" if "ratio" in cell else "-"
            where = cell.get("placement")
            if where:  # the host's layers after each round's request at this depth
                ratio += " (host layers " + "/".join(str(m["host_layers"]) for m in where) + ")"
            lines.append(f"| {r['row']} | {d} | {o['median']:.2f} ({o['min']:.2f}-{o['max']:.2f}) | {lt} | {ratio} |")
        if "cli" in r and "median" in r["cli"]:
            lines.append(f"| {r['row']} (ntx-model run) | 0 | {r['cli']['median']:.2f} | - | "
                         f"{r['cli']['median'] / r['depths']['0']['ours']['median']:.2f}x of the daemon |")
    starts = [f"{r['row']}: {r['first_token_s']:.1f} s (load {r['load_s']:.1f} s, then {r['first_decode_tok_s']:.0f} tok/s)"
              for r in results if "first_token_s" in r]
    if starts:
        lines += ["", "From the daemon's start to the first request's first token: " + "; ".join(starts) + "."]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels, ours, theirs = [], [], []
    for r in results:
        for d, cell in r["depths"].items():
            labels.append(f"{r['row']}\n@{d}")
            ours.append(cell["ours"]["median"])
            theirs.append(cell.get("llama", {}).get("median", 0.0))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="ntransformer (daemon, client library)")
    ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="llama-bench (same file, -ngl, -t, -d)")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("decode tok/s")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--dir", default="/tmp/ntx", help="where the synthetic files are (made if missing)")
    p.add_argument("--plans", nargs="+", default=["8b:32", "8b:24", "8b:16", "8b:8", "8b:0"])
    p.add_argument("--noisy", nargs="*", default=["8b:24"], help="plans repeated beside a memory-copying load")
    p.add_argument("--off", nargs="*", default=["8b:24"], help="plans repeated with --host-compute off")
    p.add_argument("--cli", default="8b:24", help="the plan ntx-model run is checked on ('' for none)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--noisy-threads", type=int, default=max(1, (os.cpu_count() or 1) - NOISE_CORES),
                   help="llama-bench -t beside the load (default: the cores it leaves)")
    p.add_argument("--ngl70", type=int, default=44, help="llama-bench -ngl for the 70B (the most that fits 24 GiB)")
    p.add_argument("--llama-bench", help="the llama-bench binary built in this call (none: ours alone)")
    p.add_argument("--deadline", type=float, default=560.0, help="seconds: no new round or row after this")
    p.add_argument("--png", help="the plot (default: beside --json)")
    p.add_argument("--render", nargs="+", metavar="JSON", help="no run: the table and the plot of these results")
    a = p.parse_args(argv)
    if a.render:
        results = [r for path in a.render for r in json.load(open(path))["rows"]]
        print(table(results), flush=True)
        plot(results, a.png or os.path.splitext(a.json)[0] + ".png")
        return 0
    common.require_gpu(__file__)
    if a.smoke:  # the tiny model, all of it resident and one layer resident: the whole path, in seconds
        a.plans, a.noisy, a.off, a.cli, a.depths, a.tokens, a.rounds, a.llama_bench = ["8b:32", "8b:1"], ["8b:1"], \
            ["8b:1"], "8b:1", [0, 64], 4, 1, None
    deadline = time.monotonic() + a.deadline
    results = []
    for row in rows_of(a):
        if time.monotonic() > deadline:
            print(f"{row.name}: not run (--deadline)", flush=True)
            continue
        r = run_row(row, a, deadline)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "placements"}), flush=True)
        common.write_json(a.json, {"tokens": a.tokens, "rounds": a.rounds, "threads": a.threads, "rows": results})
    print(table(results), flush=True)
    plot(results, a.png or os.path.splitext(a.json)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
