"""Every benchmark still runs: each script of bench/ in its smoke mode (`--smoke`: tiny synthetic
models and a few steps, bench/common.py), its JSON checked for the rows and figures it exists to
make. A figure is checked to be there and to be a number, never for its size: a smoke run shares
the machine with everything else, and how fast it went is the benchmark's to report, not a test's.

The CPU scripts run here. The GPU ones (marker gpu) run where CuPy sees a device; elsewhere each
proves that it parses its arguments and exits with common.SKIP, saying why, before it touches
anything. nvme_read.py boots a QEMU guest (markers vm, slow).

Cost: each CPU smoke starts a daemon, loads a few small engines or builds the CPU kernels, 2-15 s
of CPU (speculative.py's: ~15 s, seven prompts through four drafts and two cost tables);
nvme_read.py's guest ~55 s of CPU; a GPU smoke compiles the kernels it has not met yet (tens of
seconds on the first one)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from ntransformerd.engine.quants import SUPPORTED_TYPES

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


common = _common()
GPU_MISSING = common.gpu_missing()


def smoke(script: str, tmp_path: pathlib.Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run bench/<script> --smoke with its JSON in tmp_path; (the process, the JSON or None)."""
    out = tmp_path / f"{script}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "daemon"), str(ROOT / "client"), str(ROOT / "system"), str(ROOT / "proto"),
                                         *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    data = json.loads(out.read_text()) if out.exists() else None
    return r, data


def figure(x) -> bool:
    """A measured figure (a time, a rate, a ratio of them): a finite number, not negative."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _ran(r: subprocess.CompletedProcess, data: dict | None) -> dict:
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert data is not None and data.get("smoke", True) is True, r.stdout[-2000:]  # scripts on common.py say so
    return data


# ---- what each script's JSON must hold ------------------------------------------------------------

def check_serving(d: dict) -> None:
    levels = {x["clients"]: x for x in d["levels"]}
    assert sorted(levels) == [1, 2]
    for n, x in levels.items():
        assert x["tokens"] == 4 * n, x  # one request per client, 4 tokens each (ignore_eos)
        assert figure(x["tokens_per_second"]), x


def check_prefix_cache(d: dict) -> None:
    runs = {r["prefix_cache"]: r for r in d["runs"]}
    off, on = runs[False]["turn2"], runs[True]["turn2"]
    assert off["hit_tokens"] == 0 and off["prefilled_tokens"] >= off["prompt_tokens"], off
    # the second turn repeats the first: with the cache it prefills only what is new
    assert on["hit_tokens"] > 0 and on["prefilled_tokens"] < on["prompt_tokens"], on


def check_quality(d: dict) -> None:
    rows = {r["type"]: r for r in d["types"]}
    assert sorted(rows) == sorted(["f32", "q8_0", "q4_0", "q4_k_m", "q6_k"]), rows
    for t in rows:
        assert math.isfinite(rows[t]["perplexity"]) and rows[t]["perplexity"] > 1, rows[t]
        assert rows[t]["tokens_scored"] > 0
    # f32 holds the Q4_1 source's values exactly: the same perplexity
    assert abs(rows["f32"]["vs_q4_1"]) < 1e-3, rows["f32"]
    cal = d["calibration"]
    assert len(cal["similarity"]) == 2 and os.path.exists(cal["saved"]), cal


def check_kv_quality(d: dict) -> None:
    rows = {r["kv_dtype"]: r for r in d["types"]}
    assert sorted(rows) == ["f16", "q4_0", "q8_0"] and d["types"][0]["vs_first"] == 0, rows
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1 and r["tokens_scored"] == 2 * (64 - 1 - 32), r
    assert rows["f16"]["bytes_per_token"] > rows["q8_0"]["bytes_per_token"] > rows["q4_0"]["bytes_per_token"]


def check_speculative(d: dict) -> None:
    # the script itself asserts that every speculative output is the plain greedy one
    keys = set(d["sources"])
    for source in ("ngram", "draft", "skip:1,2", "prefix:1"):
        for table in ("cpu", "streamed"):
            assert f"{source} [{table}]" in keys, keys
    for res in d["sources"].values():
        assert len(res["rows"]) == 7 and res["reference_tokens_per_pass"] >= 1.0, res
        assert all(r["tokens"] == 8 for r in res["rows"] if r["prompt"] != "code_edit"), res["rows"]


def check_cpu(d: dict) -> None:
    assert set(d["engines"]) == {"cpu", "cpu-ref"}, d["engines"]  # llama.cpp is left out of a smoke run
    for e, r in d["engines"].items():
        assert set(r) == {"prefill", "decode_b1", "decode_b2"} and all(figure(x["median"]) for x in r.values()), (e, r)


def check_cpu_kernels(d: dict) -> None:
    assert {r["type"] for r in d["results"]} == {q.name for q in SUPPORTED_TYPES}, d["results"]
    assert all(figure(r["gb_s"]) for r in d["results"]), d["results"]


def check_host_attention(d: dict) -> None:
    assert [r["context"] for r in d["results"]] == [64, 1500], d["results"]
    assert all(r["same_bits"] is True and all(figure(r[f"{k}_seconds"]) for k in ("ref", "whole", "step"))
               for r in d["results"]), d["results"]
    assert [r["step_same_bits"] for r in d["results"]] == [True, False], d["results"]  # one split, two


def check_resident(d: dict) -> None:
    assert [f["type"] for f in d["files"]] == ["q8_0", "q4_k_m"]
    for f in d["files"]:
        names = [m["matrix"] for m in f["matvec"]]
        assert names[0] == "attn_qkv0" and "ffn_gate_up0" in names and names[-1] == "output", names
        assert [x["batch"] for x in f["decode"]] == [1, 4, 16] and all(figure(x["tok_s"]) for x in f["decode"])
        assert figure(f["prefill"]["tok_s"]) and set(f["decode_b1_sampled"]) == {"device_top", "host_rows"}


def check_attention_gpu(d: dict) -> None:
    assert {(x["kv"], x["context"], x["batch"]) for x in d["attention"]} == {
        (kv, c, b) for kv in ("f16", "q8_0") for c in (16, 200) for b in (1, 3)}
    assert all(figure(x["fused_us"]) and figure(x["unfused_us"]) for x in d["attention"])
    assert [x["depth"] for x in d["e2e"]["steps"]] == [0, 100] and all(figure(x["tok_s"]) for x in d["e2e"]["steps"])


def check_ab_decode(d: dict) -> None:
    assert len(d["variants"]) == 2 and d["rows"], d
    for row in d["rows"]:
        assert figure(row["median_ms"]), row
        # one checkout twice: the same engine gives the same greedy ids
        assert row["greedy_same_as_first"], row


def check_ncu_step(d: dict) -> None:
    assert d["batch"] == 1 and figure(d["eager_step_wall_s"]), d


def check_profile_decode(d: dict) -> None:
    for f in d["files"]:
        assert [p["batch"] for p in f["profiles"]] == [1, 16]
        for p in f["profiles"]:
            assert p["kernels"] > 0 and figure(p["graph_step_ms"]) and any(g["bytes"] for g in p["groups"]), p
        assert f["prefill"]["groups"], f["prefill"]


def check_host_link(d: dict) -> None:
    for k in ("link_alone_Bps", "host_alone_Bps", "link_together_Bps", "host_together_Bps", "together_Bps"):
        assert figure(d["median"][k]) and d["median"][k] > 0, (k, d["median"])
    assert [b["resident"] for b in d["bounds"]] == [1, 0], d["bounds"]
    assert all(figure(b["bound_together_tok_s"]) for b in d["bounds"] if b["streamed_bytes"]), d["bounds"]


def check_attention_split(d: dict) -> None:
    assert [r["context"] for r in d["rows"]] == [16, 300], d["rows"]
    for r in d["rows"]:
        assert all(figure(r[k]) and r[k] > 0 for k in ("host_us", "trip_us", "trip_busy_us", "link_busy_GBps")), r
        assert r["gpu_wins"] == (r["trip_busy_us"] < r["host_us"]) and r["gpu_kv_bytes"] > 0, r


def check_sample_top(d: dict) -> None:
    assert len(d["kernels"]) == 4 and all(figure(k["top40_us"]) for k in d["kernels"])
    assert set(d["steps"]) == {"greedy", "device_top", "host_rows"}


def check_speculative_gpu(d: dict) -> None:
    assert set(d["verify"]) == {"tiny streamed B=1", "tiny streamed B=16", "tiny B=1", "tiny B=16"}, d["verify"]
    runs = [r for r in d["speculative"] if "k" in r]
    assert len(runs) == 6 and all(r["identical_to_record"] for r in runs), runs
    assert len(d["skip"]) == 3


def check_streaming(d: dict) -> None:
    paths = {(r["resident_layers"], r["batch"]): r["path"] for r in d["runs"] if "batch" in r and "depth" not in r
             and r["model"] == "tiny-q4_k_m" and "rows" not in r}
    assert set(paths) >= {(k, b) for k in (2, 1, 0) for b in (1, 4)}, paths
    assert figure(d["odirect"]["tier_Bps"]) and figure(d["odirect"]["plain_Bps"]), d["odirect"]
    hybrid = {(r["rows"], r["resident_layers"], r["batch"], r["host_compute"]): r for r in d["runs"]
              if r.get("rows") in ("hybrid", "capped") and "host_compute" in r}
    assert set(hybrid) >= {("hybrid", k, b, hc) for k in (1, 0) for b in (1, 4) for hc in ("off", "auto")} | {
        ("capped", k, 1, hc) for k in (1, 0) for hc in ("off", "auto")}, sorted(hybrid)
    assert all(figure(r["tok_s"]) and (r["predicted_step_s"] or 0) > 0 and figure(r["vs_off"])
               for r in hybrid.values() if r["host_compute"] == "auto"), hybrid
    ab = [r for r in d["runs"] if r.get("rows") == "ab"]
    assert ab and all(len(r["tok_s"]["off"]) == len(r["tok_s"]["auto"]) >= 2 and figure(r["auto_vs_off"]) for r in ab), ab


def check_hybrid_quality(d: dict) -> None:
    assert set(d["perplexity"]) == {"gpu", "hybrid"} and all(v > 1 for v in d["perplexity"].values()), d
    assert any(d["host_layers_by_rows"].values()), d["host_layers_by_rows"]  # the host computed some layers
    assert d["greedy"] and all(0 <= g["common_prefix"] <= g["tokens"] for g in d["greedy"]), d["greedy"]
    assert d["handoffs"] > 0
    assert d["daemon"]["common_prefix"] and d["daemon"]["placements"], d["daemon"]  # the hybrid daemon placed layers


def check_serving_gpu(d: dict) -> None:
    levels = {(r["clients"], r["sampled"]) for r in d["levels"]}
    assert levels == {(n, s) for n in (1, 2) for s in (False, True)}, levels
    assert all(figure(r["daemon_tok_s"]) and figure(r["engine_tok_s"]) and figure(r["host_share"]) for r in d["levels"]), \
        d["levels"]
    assert set(d["default_model"]["ours"]) == {"1", "2"} or set(d["default_model"]["ours"]) == {1, 2}, d


def check_host_share(d: dict) -> None:
    levels = {(r["clients"], r["sampled"]): r for r in d["levels"]}
    assert set(levels) == {(n, s) for n in (1, 4) for s in (False, True)}, levels
    # every level reached its full batch for several steps, and the host's time per step was measured
    assert all(r["steps"] >= 3 and figure(r["host_ms_per_step"]) for r in levels.values()), levels


def check_host_ceiling(d: dict) -> None:
    levels = {(r["clients"], r["sampled"]): r for r in d["levels"]}
    assert set(levels) == {(n, s) for n in (1, 2) for s in (False, True)}, levels
    assert d["device_ms"] == {"base": 0.5, "per_row": 0.05}, d  # the smoke runs beside the stand-in device
    for r in levels.values():  # each level's figures were measured
        assert all(figure(r[k]) for k in ("tok_s", "daemon_cpu_us_per_token", "vs_device")), r


def check_long_context(d: dict) -> None:
    plans = d["plans"]
    assert [p["plan"] for p in plans] == ["the file", "default pool, q8_0 KV", "default pool, f16 KV"], plans
    assert all(0 <= p["resident_layers"] for p in plans[1:]), plans
    dp = d["daemon_plan"]
    assert dp["kv_dtype"] == "q8_0" and dp["pool_tokens"] == 4 * d["context"] and d["plan"], dp
    assert len(d["short"]) == 2 and len(d["long"]) == 1 and all(figure(x) for x in d["short"] + d["long"]), d
    assert d["long_levels"][0]["cached_prompt_tokens"] == [d["context"] - 32 - d["tokens"] - 16] * 4, d["long_levels"]
    assert figure(d["long_vs_short"]), d


def check_wide_decode(d: dict) -> None:
    want = {f"{t} captured {r} rows" for t in ("f16", "q8_0") for r in (16, 32, 64)} | {
        f"{t} eager cuBLAS 64 rows" for t in ("f16", "q8_0")}
    assert set(d["tok_s"]) == want and all(figure(v) for v in d["tok_s"].values()), d


def check_nvme_read(d: dict) -> None:
    assert len(d["dd_runs"]) == 1 and len(d["ntx_runs"]) == 1 and figure(d["ntx_gbps"]), d
    assert d["dmar_faults"] == 0


def check_constraint_libraries(d: dict) -> None:
    libs = {x["library"]: x for x in d["libraries"]}
    assert set(libs) == {"llguidance", "outlines-core", "xgrammar"}, libs
    ll = libs["llguidance"]  # a dependency: always measured
    assert ll["mask"]["tokens"] == d["document_tokens"] > 0 and figure(ll["mask"]["median_us"]), ll
    assert [r["batch"] for r in d["step_overhead"]] == [1, 2] and all(figure(r["step_ms"]) for r in d["step_overhead"])


def check_relay(d: dict) -> None:
    for load in ("idle", "busy"):
        for path in ("relayed", "direct"):
            m = d["micro"][load][path]
            assert figure(m["rtt_median_us"]) and figure(m["stream_us_per_message"]), m
    for path in ("relayed", "direct"):
        assert set(d["daemon"][path]) == {"streams_1", "streams_2"}, d["daemon"]
        assert all(figure(x["ttft_median_ms"]) and figure(x["token_interval_mean_ms"]) for x in d["daemon"][path].values()), \
            d["daemon"]


def check_grpc_stream(d: dict) -> None:
    levels = {(x["variant"], x["streams"]): x for x in d["levels"]}
    assert set(levels) == {(v, n) for v in ("sync", "aio", "aio_step") for n in (1, 2)}, levels
    for x in levels.values():  # every stream read to its end: all its tokens, in one message each or joined
        assert all(r["tokens"] == r["streams"] * max(2, d["messages"] // r["streams"]) for r in x["runs"]), x
        assert all(figure(x[k]["median"]) for k in ("cpu_us_per_message", "messages_per_second")), x
        assert x["us_per_message_by_thread"] and all(figure(v) for v in x["us_per_message_by_thread"].values()), x


def check_kv_capacity(d: dict) -> None:
    c = d["capacity"]
    paged, slots = c["paged"], c["slots"]
    assert paged["peak"] == c["requests"] and paged["queued"] == 0, paged  # the pool holds every request at once
    assert slots["peak"] == slots["max_batch"] < c["requests"] and slots["queued"] > 0, slots
    for run in (paged, slots):
        assert run["solo_compared"] == c["requests"] and run["solo_equal"] == run["solo_compared"], run
        assert figure(run["tokens_per_second"]), run
    s = d["spill"]
    assert s["spilled_blocks"] > 0 and s["restored_blocks"] > 0, s
    assert s["chat_tokens"] <= s["reused_positions"] < s["turn2_tokens"] and s["ids_equal_kept"] is True, s
    assert figure(s["ratio"]) and figure(s["ttft_prefill_seconds"]), s


def check_kv_spill(d: dict) -> None:
    rows = d["rows"]
    assert [r["chat_tokens"] for r in rows] == [64, 128, 256] and d["passed"] is True, d
    for r in rows:  # restored = never spilled, bit for bit, and turn 2's ids alike
        assert r["blocks_equal"] is True and r["ids_equal"] is True and r["turn2_ids"] == d["generate"], r
        assert all(figure(r[k]) for k in ("spill_seconds", "restore_seconds", "reprefill_seconds")), r


def check_user_path(d: dict) -> None:
    rows = {r["row"]: r for r in d["rows"]}
    assert set(rows) == {"8b:32", "8b:1", "8b:1 off", "8b:1 noisy", "8b:1 off noisy"}, list(rows)
    assert rows["8b:1 off noisy"]["noisy"] and rows["8b:1 off"]["host_compute"] == "off", rows["8b:1 off"]
    for r in rows.values():
        assert set(r["depths"]) == {"0", "64"} and all(figure(c["ours"]["median"]) for c in r["depths"].values()), r
    assert figure(rows["8b:1"]["cli"]["median"]), rows["8b:1"]["cli"]


def check_cli_gap(d: dict) -> None:
    assert d["sides"] == ["daemon", "cli"] and d["mode"] == "turns" and len(d["rows"]) == 2, d
    for side in ("daemon", "cli"):
        assert figure(d["summary"][side]["tok_s"]["median"]), d["summary"][side]
        assert "scheduler" in d["summary"][side]["threads"], d["summary"][side]  # its threads, named
    assert figure(d["summary"]["cli"]["over_first"]["median"]), d["summary"]["cli"]


def check_structured_rate(d: dict) -> None:
    assert (d["schemas"]["total"], d["tools_required"]["total"]) == (2, 1), d
    assert all(-1e9 < x < 0 for v in d["call_opening"].values() for x in v["logprobs"]), d["call_opening"]


def check_kl_divergence(d: dict) -> None:
    rows = {(r["text"], r["run"], r["base"]): r for r in d["rows"]}
    assert set(rows) == {(t, "cpu", "exact") for t in ("GPL-3", "MPL-1.1")}, rows
    assert all(r["tokens"] == 2 * 15 and 0 < r["mean"] <= r["max"] and 0 <= r["same_top"] <= 1 for r in rows.values())


CPU = {"serving.py": check_serving, "prefix_cache.py": check_prefix_cache, "quality.py": check_quality,
       "kv_quality.py": check_kv_quality, "kv_capacity.py": check_kv_capacity, "kv_spill.py": check_kv_spill,
       "relay.py": check_relay, "cli_gap.py": check_cli_gap,
       "grpc_stream.py": check_grpc_stream,
       "speculative.py": check_speculative, "cpu.py": check_cpu, "cpu_kernels.py": check_cpu_kernels,
       "constraint_libraries.py": check_constraint_libraries,
       "serving_gpu.py": check_serving_gpu,  # the cpu backend where there is no GPU
       "host_share.py": check_host_share, "host_ceiling.py": check_host_ceiling,
        "host_attention.py": check_host_attention,
        "structured_rate.py": check_structured_rate, "kl_divergence.py": check_kl_divergence,
        "long_context.py": check_long_context}  # the cpu backend where there is no GPU
GPU = {"resident.py": check_resident, "ab_decode.py": check_ab_decode, "ncu_step.py": check_ncu_step,
       "attention_gpu.py": check_attention_gpu, "host_link.py": check_host_link,
       "attention_split.py": check_attention_split,
       "profile_decode.py": check_profile_decode, "sample_top.py": check_sample_top,
       "speculative_gpu.py": check_speculative_gpu, "streaming.py": check_streaming,
       "hybrid_quality.py": check_hybrid_quality,
       "wide_decode.py": check_wide_decode, "user_path.py": check_user_path}
VM = {"nvme_read.py": check_nvme_read}


def test_every_script_has_a_smoke_test():
    scripts = {p.name for p in BENCH.glob("*.py")} - {"common.py"}
    assert scripts == set(CPU) | set(GPU) | set(VM)


@pytest.mark.parametrize("script", sorted(CPU))
def test_cpu_script_smoke(script, tmp_path):
    own_models = ("quality.py", "speculative.py", "kv_quality.py", "kv_capacity.py", "kv_spill.py", "serving_gpu.py",
                  "long_context.py", "kl_divergence.py")
    args = ["--dir", str(tmp_path)] if script in own_models else []  # their models' place
    CPU[script](_ran(*smoke(script, tmp_path, *args)))


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is here: test_gpu_script_smoke runs the scripts")
@pytest.mark.parametrize("script", sorted(GPU))
def test_gpu_script_without_a_gpu_skips_cleanly(script, tmp_path):
    r, data = smoke(script, tmp_path, "--dir", str(tmp_path), timeout=120)
    assert r.returncode == common.SKIP, (r.returncode, r.stderr[-3000:])
    assert f"bench/{script}: skipped: it needs a CUDA GPU" in r.stderr, r.stderr
    assert data is None and not any(tmp_path.glob("*.gguf")), "a skipped script wrote files"
    h = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(ROOT / d) for d in ("daemon", "client", "system", "proto")])})
    assert h.returncode == 0 and "--smoke" in h.stdout and "--json" in h.stdout, h.stderr


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("script", sorted(GPU))
def test_gpu_script_smoke(script, tmp_path):
    GPU[script](_ran(*smoke(script, tmp_path, "--dir", str(tmp_path))))


@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nvme_read_smoke(tmp_path):
    r, data = smoke("nvme_read.py", tmp_path)
    if r.returncode == common.SKIP:  # no qemu, guest kernel or busybox, or not root: it says which
        pytest.skip(r.stderr.strip().splitlines()[-1])
    check_nvme_read(_ran(r, data))
