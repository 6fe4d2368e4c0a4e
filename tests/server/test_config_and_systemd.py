"""The daemon's config (TOML + flags → one object), one meaning per setting (the same size in
the config file, the daemon's flags, ntx-model and EngineConfig; a setting the backend cannot
honour refused with its key), and its sd_notify datagrams."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from ntransformerd import config, dirs, settings
from ntransformerd.engine import backends, tiers
from ntransformerd.engine.runtime.engine import EngineConfig, resolved
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.generation.speculative import Mode
from ntransformerd.server.systemd import Notifier
from ntransformerd.tools import ntx_model
from ntx_system.service import Refused, ServiceConfig


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('max_batch = 4\nbackend = "cpu"\nvram_budget = "24GiB"\nsocket = "/x/d.sock"\n')
    cfg = config.load(["--config", str(f), "--max-batch", "12"])
    assert cfg.max_batch == 12 and cfg.backend == "cpu" and cfg.vram_budget == 24 << 30
    assert cfg.socket == "/x/d.sock" and cfg.admin_socket == "/x/admin.sock"
    assert cfg.max_queue == config.DaemonConfig().max_queue


@pytest.mark.parametrize("text,words", [
    ("max_bach = 4\n", "unknown key(s) max_bach"),
    ("max_batch = 0\n", "max_batch = 0"),
    ('backend = "tpu"\n', "backend = 'tpu'"),
    ('vram_budget = "lots"\n', "not a size"),
    ('vram_budget = "24G"\n', "vram_budget = '24G': G is ambiguous: write 24GiB"),
    ('backend = "cuda"\nkv_dtype = "f32"\n', "kv_dtype = 'f32': the cuda backend stores its KV cache as f16 or q8_0 only"),
    ('backend = "cpu"\nstorage = "nvme:S1"\n', "storage = 'nvme:S1': the cpu backend computes every layer"),
    ("max_batch = \n", "not valid TOML"),
    ('max_batch = "8"\n', "max_batch = '8'"),
])
def test_bad_config_names_the_key(tmp_path, text, words):
    f = tmp_path / "d.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(["--config", str(f)])
    assert words in str(e.value)


# ≥ 20 bad values: each one line naming its key, whatever the type or range that is wrong
BAD_VALUES = [
    ("socket", "5"), ("socket", '""'), ("socket", "true"), ("socket", '["/x.sock"]'),
    ("admin_socket", "1"), ("model", "5"), ("model", "{ path = \"x\" }"),
    ("socket_group", "7"), ("socket_group", '"no such group!"'),
    ("backend", "1"), ("backend", '"tpu"'),
    ("log_level", "5"), ("log_level", '"loud"'),
    ("kv_dtype", '"f8"'),
    ("max_batch", "-1"), ("max_batch", "true"), ("max_batch", "1.5"), ("max_batch", "100000"),
    ("max_queue", "-5"), ("max_ctx", "0"), ("prefill_chunk", "0"), ("default_max_tokens", '"many"'),
    ("cpu_threads", "-1"),
    ("drain_timeout", "-1"), ("drain_timeout", "nan"), ("drain_timeout", '"5s"'), ("drain_timeout", "false"),
    ("vram_budget", "-1"), ("vram_budget", "0"), ("vram_budget", '"-4GiB"'), ("vram_budget", "1.5"),
    ("vram_budget", "true"), ("pinned_budget", '"lots"'), ("pinned_budget", "-1"),
    ("vram_budget", '"24G"'), ("pinned_budget", '"64g"'), ("vram_budget", '"512M"'), ("link_cap", '"6.5G/s"'),
    ("link_cap", "5"), ("kv_dtype", '"f32"\nbackend = "cuda"'), ("storage", '"odirect"\nbackend = "cpu"'),
]


@pytest.mark.parametrize("key,value", BAD_VALUES, ids=[f"{k}={v}" for k, v in BAD_VALUES])
def test_every_bad_value_is_one_line_naming_the_key(tmp_path, capsys, key, value):
    from ntransformerd.main import main

    f = tmp_path / "d.toml"
    f.write_text(f"socket = \"{tmp_path}/d.sock\"\n{key} = {value}\n" if key != "socket" else f"{key} = {value}\n")
    assert main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ntransformerd: {key} ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == [f]  # nothing bound, nothing left behind


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        config.argument_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for flag, default in (("--max-batch N", "8"), ("--socket-group GROUP", "ntransformer"), ("--backend NAME", "auto"),
                          ("--drain-timeout S", "5.0"), ("--vram-budget SIZE", "auto"), ("--cpu-threads N", "0")):
        assert flag in out and f"(default: {default}" in out.split(flag, 1)[1].split("--", 1)[0], flag


def test_config_keys_and_table_agree():
    assert list(config.KEYS) == list(config.FIELDS)
    assert config.DaemonConfig(vram_budget="2GiB", socket="rel.sock").vram_budget == 2 << 30
    assert os.path.isabs(config.DaemonConfig(socket="rel.sock").socket)


def test_speculative_is_a_mode_value_parsed_once_at_the_config(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('speculative = " Skip:3,7 "\n')
    cfg = config.load(["--config", str(f)])
    assert cfg.speculative == Mode("skip", "3,7") and str(cfg.speculative) == "skip:3,7"
    assert config.load(["--speculative", "prefix:8"]).speculative == Mode("prefix", "8")
    assert config.DaemonConfig().speculative.off
    assert config.DaemonConfig(speculative=Mode("ngram")).speculative == Mode("ngram")
    with pytest.raises(config.ConfigError, match="speculative = 'fastest'"):
        config.DaemonConfig(speculative="fastest")


@pytest.mark.parametrize("spec,twice", [("skip:0,0,0", "layer 0 is"), ("skip:3,7,3", "layer 3 is"),
                                        ("skip:3,07,7,3,", "layers 3, 7 are")])
def test_a_skip_mode_naming_a_layer_twice_is_refused_everywhere(tmp_path, capsys, spec, twice):
    """skip:0 is refused (it skips nothing); skip:0,0,0 was merged into skip:0's one layer and
    served. Refused where a mode enters: the config, a request, ntx-model."""
    from ntransformerd.server import errors, servicer
    words = f"{twice} named more than once: name each layer once"
    with pytest.raises(ValueError, match=words):
        Mode.parse(spec)
    f = tmp_path / "d.toml"
    f.write_text(f'speculative = "{spec}"\n')
    with pytest.raises(config.ConfigError, match=f"^speculative = .*{words}"):
        config.load(["--config", str(f)])
    with pytest.raises(errors.InvalidRequest, match=words):
        servicer.speculative_mode(spec)
    assert ntx_model.main(["run", "--prompt", "x", "--speculative", spec]) == 2
    assert words in capsys.readouterr().err
    layers = spec.split(":", 1)[1]
    with pytest.raises(config.ConfigError, match=f"^skip_layers = .*{words}"):
        config.DaemonConfig(skip_layers=layers)
    assert Mode.parse("skip:3,7") == Mode("skip", "3,7") and config.DaemonConfig(skip_layers="3,7").skip_layers == "3,7"


def test_missing_config_file_is_an_error():
    with pytest.raises(config.ConfigError, match="cannot read config"):
        config.load(["--config", "/nonexistent/ntransformerd.toml"])


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        config.DaemonConfig("/x.sock")
    with pytest.raises(Exception):
        config.DaemonConfig().max_batch = 3


def test_sd_notify_datagrams(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(2)
        n = Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())})
        n.status("loading layer 3/30")
        n.ready("serving")
        n.watchdog()
        n.watchdog()  # within a quarter interval of the last: not sent again
        n.stopping()
        got = [s.recv(4096).decode() for _ in range(4)]
    assert got[0] == "STATUS=loading layer 3/30"
    assert got[1].startswith("READY=1\nSTATUS=serving")
    assert got[2] == "WATCHDOG=1"
    assert got[3].startswith("STOPPING=1")


def test_notify_without_systemd_is_a_no_op():
    n = Notifier(environ={})
    assert not n.enabled and n.notify("READY=1") is False and n.watchdog_interval is None


# ---- one setting, one meaning ------------------------------------------------------------------

SIZES = [("24GiB", 24 << 30), ("24GB", 24 * 10 ** 9), ("1.5GiB", 3 << 29), ("512MiB", 512 << 20),
         ("100MB", 10 ** 8), ("64gib", 64 << 30), ("25769803776", 24 << 30), ("2TB", 2 * 10 ** 12)]


@pytest.fixture(scope="module")
def small(synth_model):
    return synth_model("small", "q8_0")


def _ntx_model(capsys, *args) -> tuple[int, str, str]:
    rc = ntx_model.main(["run", "--plan", "--ctx", "64", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("text,n", SIZES, ids=[t for t, _ in SIZES])
def test_a_size_means_the_same_bytes_in_the_config_the_flags_and_ntx_model(tmp_path, capsys, small, text, n):
    f = tmp_path / "d.toml"
    f.write_text(f'vram_budget = "{text}"\npinned_budget = "{text}"\nsocket = "{tmp_path}/d.sock"\n')
    from_file = config.load(["--config", str(f)])
    from_flags = config.load(["--config", os.devnull, "--socket", str(tmp_path / "d.sock"),
                              "--vram-budget", text, "--pinned-budget", text])
    assert (from_file.vram_budget, from_file.pinned_budget) == (n, n)
    assert (from_flags.vram_budget, from_flags.pinned_budget) == (n, n)
    engine = EngineConfig(vram_budget=text, pinned_budget=text)  # what ntx-model and the daemon hand down
    assert (engine.vram_budget, engine.pinned_budget) == (n, n)
    # ntx-model's own parse, end to end: the plan's VRAM limit is the budget it read
    rc, out, err = _ntx_model(capsys, small, "--backend", "cpu-ref", "--vram-budget", text, "--json")
    assert rc == 0, err
    assert json.loads(out)["vram_limit"] == n


@pytest.mark.parametrize("text,binary,decimal", [("24G", "24GiB", "24GB"), ("512m", "512MiB", "512MB"),
                                                 ("1.5T", "1.5TiB", "1.5TB"), ("64K", "64KiB", "64kB")])
def test_a_bare_unit_is_refused_everywhere_with_both_spellings(tmp_path, capsys, small, text, binary, decimal):
    f = tmp_path / "d.toml"
    f.write_text(f'vram_budget = "{text}"\n')
    for argv in (["--config", str(f)], ["--config", os.devnull, "--vram-budget", text]):
        with pytest.raises(config.ConfigError) as e:
            config.load(argv)
        assert str(e.value).startswith(f"vram_budget = {text!r}: ") and binary in str(e.value) \
            and decimal in str(e.value), e.value
    rc, _, err = _ntx_model(capsys, small, "--vram-budget", text)
    assert rc == 2 and f"ntx-model: error: --vram-budget {text}: " in err and binary in err and decimal in err, err
    with pytest.raises(settings.SettingError, match="ambiguous"):
        EngineConfig(pinned_budget=text)


def test_sizes_and_rates_refuse_what_they_cannot_read():
    for bad in ("lots", "-1GiB", "1.5", "24XB", "GiB", "", True, -1, 1.5, float("inf"), [1]):
        with pytest.raises(settings.SettingError) as e:
            settings.parse_size(bad, setting="vram_budget")
        assert str(e.value).startswith("vram_budget = "), e.value
    assert settings.parse_rate("6.5GB/s") == 6.5e9 and settings.parse_rate("800MiB/s") == 800 * 2 ** 20
    assert settings.parse_rate("10mb") == 1e7 and settings.parse_rate(2e9) == 2e9
    for bad in ("fast", "0GB/s", "6.5G/s", -3.0, True):
        with pytest.raises(settings.SettingError):
            settings.parse_rate(bad, setting="link_cap")


def test_kv_dtype_the_backend_cannot_store_is_refused_with_the_key(tmp_path, capsys):
    from ntransformerd.main import main
    f = tmp_path / "d.toml"
    f.write_text(f'socket = "{tmp_path}/d.sock"\nbackend = "cuda"\nkv_dtype = "f32"\n')
    assert main(["--config", str(f)]) == 2  # refused at start: no GPU library needed to know it
    err = capsys.readouterr().err
    assert err.startswith("ntransformerd: kv_dtype = 'f32': the cuda backend stores its KV cache as f16 or q8_0 only") \
        and 'set kv_dtype to "auto" or "f16"' in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == [f]  # nothing bound
    # ntx-model's flags: the same check, the flag named
    with pytest.raises(settings.SettingError) as e:
        backends.settle(backends.TYPES["cuda"], kv_dtype="f32", storage="file")
    assert e.value.worded(ntx_model.FLAGS).startswith("--kv-dtype f32: the cuda backend stores its KV cache as f16")
    assert "set --kv-dtype to" in e.value.worded(ntx_model.FLAGS) and "kv_dtype" not in e.value.worded(ntx_model.FLAGS)
    # what each backend stores, and what "auto" means on it
    assert backends.settle(backends.TYPES["cuda"], kv_dtype="auto", storage="file") == "f16"
    assert backends.settle(backends.TYPES["cpu"], kv_dtype="auto", storage="file") == "f32"
    assert backends.settle(backends.TYPES["cpu-ref"], kv_dtype="f16", storage="nvme:S1") == "f16"


class _FakeGpu:
    """What backends.resolve("auto") finds on a GPU host (the kernels are never reached)."""

    @staticmethod
    def available() -> bool:
        return True


def test_backend_auto_is_resolved_once_and_refused_with_the_key(tmp_path, monkeypatch, small):
    """On a GPU host, kv_dtype = "f32" with backend = "auto" stops the load naming the key and why."""
    from ntransformerd.server.daemon import Daemon
    calls = []
    real = backends.resolve

    def counting(name):
        calls.append(name)
        return real(name)
    monkeypatch.setattr(backends, "resolve", counting)
    d = Daemon(config=config.DaemonConfig(socket=str(tmp_path / "d.sock"), model=small, backend="auto",
                                          kv_dtype="f32", storage="file"))
    optional = backends.backend_module
    monkeypatch.setattr(backends, "backend_module", lambda module: _FakeGpu() if module.endswith(".cuda") else None)
    with pytest.raises(config.ConfigError) as e:
        d.models.bring_up()
    assert str(e.value).startswith("kv_dtype = 'f32': the cuda backend (what backend auto chose on this "
                                   "machine) stores its KV cache as f16 or q8_0 only"), e.value
    monkeypatch.setattr(backends, "backend_module", optional)
    calls.clear()
    cpu = Daemon(config=config.DaemonConfig(socket=str(tmp_path / "c.sock"), model=small, backend="auto",
                                            max_batch=2, max_ctx=64))
    cpu.models.bring_up()
    try:
        assert calls.count("auto") == 1, calls  # decided once; the load below looks the decided name up
        assert cpu.scheduler.engine.config.backend in ("cpu", "cpu-ref")
        assert cpu.scheduler.engine.config.kv_dtype == "f32"  # auto on the host
    finally:
        cpu.models.close(cpu.scheduler.detach())


def test_storage_the_cpu_backend_does_not_read_is_refused_with_the_key(tmp_path, capsys, small):
    from ntransformerd.main import main
    f = tmp_path / "d.toml"
    f.write_text(f'socket = "{tmp_path}/d.sock"\nbackend = "cpu"\nstorage = "odirect"\n')
    assert main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ntransformerd: storage = 'odirect': the cpu backend computes every layer where it lies") \
        and 'set storage to "file" or "mmap"' in err, err
    rc, _, err = _ntx_model(capsys, small, "--backend", "cpu", "--storage", "odirect")
    assert rc == 2 and "ntx-model: error: --storage odirect: the cpu backend" in err and "set --storage to" in err, err
    assert config.DaemonConfig(backend="cpu-ref", storage="odirect").storage == "odirect"  # cpu-ref reads it


def _too_small_for_staging(model: str) -> int:
    """A VRAM budget that holds the fixed weights, the KV cache and the two slots, so layers stream
    (and, past a 1 MiB pinned budget, their two staging buffers do not fit)."""
    m = GGUFModel(model)
    layer = max(m.layer_bytes(i) for i in range(m.config.n_layers))
    fixed = sum(t.nbytes for n, t in m.tensors.items() if not n.startswith("blk."))
    kv, _ = tiers.kv_and_workspace(m, EngineConfig(max_batch=8, max_ctx=64, kv_dtype="f32"), "cpu")
    assert 2 * layer > 1 << 20
    return fixed + kv + 2 * layer + (1 << 16)


def test_a_plan_error_names_the_settings_of_the_program_that_was_run(tmp_path, capsys, small, new_daemon):
    vram = _too_small_for_staging(small)
    rc, _, err = _ntx_model(capsys, small, "--backend", "cpu-ref", "--max-batch", "8", "--vram-budget", str(vram),
                            "--pinned-budget", "1MiB")
    assert rc == 2 and "storage staging buffers" in err and "raise --pinned-budget, or lower --stream-depth" in err, err
    d = new_daemon("--model", small, "--backend", "cpu-ref", "--max-batch", "8", "--max-ctx", "64",
                   "--vram-budget", str(vram), "--pinned-budget", "1MiB")
    try:
        end = time.monotonic() + 60
        while d.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        log = d.log()
        assert d.proc.returncode == 2, log  # refused: the unit does not restart it
        line = next(ln for ln in log.splitlines() if "refused:" in ln)
        assert "storage staging buffers" in line and line.endswith("; raise pinned_budget"), line
        assert "stream" not in line.split(";")[-1] and "--" not in line  # the daemon has no stream_depth
    finally:
        d.cleanup()


def test_one_plan_per_load_is_handed_to_the_engine(tmp_path, monkeypatch, small):
    """The daemon plans once (engine.plan_for) and loads the engine by that plan
    (tests/system/test_daemon_storage.py: the same with the NVMe drive's fill)."""
    from ntransformerd.server.daemon import Daemon
    plans = []
    real = tiers.model_plan

    def counting(*a, **kw):  # the planner's entry: every plan of a load goes through it
        plans.append(real(*a, **kw))
        return plans[-1]
    vram = _too_small_for_staging(small)
    monkeypatch.setattr(tiers, "model_plan", counting)
    d = Daemon(config=config.DaemonConfig(socket=str(tmp_path / "d.sock"), model=small, backend="cpu-ref",
                                          max_batch=2, max_ctx=64, vram_budget=vram))
    engine = d.models.load(None, None)
    try:
        assert len(plans) == 1 and engine.plan is plans[0] and engine.plan.streamed, plans
    finally:
        d.models.close(d.scheduler.detach())


def test_ntx_admin_reads_the_daemons_file_the_daemons_way(tmp_path, monkeypatch):
    """One reader (ntx_system.config_file): the drive's keys read by ntx-admin's service step are
    the values the daemon reads from the same file, and both refuse the same bad file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    f = tmp_path / "d.toml"
    f.write_text(f'socket = "{tmp_path}/d.sock"\nstorage = "nvme: S1 "\nmodel = "m.gguf"\nnvme_release = "keep"\n'
                 'noiommu = true\nbackend = "cpu-ref"\nvram_budget = "24GiB"\n')
    daemon, admin = config.load(["--config", str(f)]), ServiceConfig.from_toml(str(f))
    for key in ("storage", "model", "nvme_release", "noiommu"):
        assert getattr(admin, key) == getattr(daemon, key), key
    assert admin.storage == "nvme:S1" and admin.model == str(tmp_path / "m.gguf")
    for text, words in (('nvme_release = "later"\n', "nvme_release = 'later': use nvme or keep"),
                        ('storage = "nvme:"\n', "storage = 'nvme:': use file, odirect, mmap or nvme:SERIAL"),
                        ("storage = \n", "is not valid TOML")):
        f.write_text(text)
        with pytest.raises(config.ConfigError, match=words):
            config.load(["--config", str(f)])
        with pytest.raises(Refused, match=words):
            ServiceConfig.from_toml(str(f))
    assert ServiceConfig.from_toml(str(tmp_path / "none.toml")) == ServiceConfig()  # no file: the defaults


def test_ntx_model_spells_every_setting_it_names_as_a_flag_it_has(capsys):
    with pytest.raises(SystemExit):
        ntx_model.main(["run", "--help"])
    out = capsys.readouterr().out
    for setting, flag in ntx_model.FLAGS.names.items():
        assert f"{flag} " in out, (setting, flag)
        assert settings.MODEL in settings.SETTINGS[setting].where
    for setting in EngineConfig.__dataclass_fields__:  # every engine setting is a flag of ntx-model run
        assert ntx_model.FLAGS.name(setting) == settings.SETTINGS[setting].flag
    for setting in ("vram_budget", "pinned_budget", "max_batch", "max_ctx", "kv_dtype", "storage", "backend"):
        assert setting in config.KEYS  # the daemon's key of the same name and meaning


def test_the_daemon_serves_a_quantized_paged_kv_cache_as_configured(new_daemon):
    """kv_dtype q8_0 and a kv_blocks pool from the daemon's flags reach the engine: its greedy
    ids equal an in-process engine of the same settings, and a pool too small for a request is
    an error naming kv_blocks, the daemon serving on."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig, generate
    from ntransformerd.engine.generation.sampler import SamplingParams
    from ntx_client import Client, NtxError
    d = new_daemon("--kv-dtype", "q8_0", "--kv-blocks", "8", "--max-batch", "2", "--max-ctx", "512").wait_ready()
    try:
        e = Engine.load(None, config=EngineConfig(backend="cpu", kv_dtype="q8_0", kv_blocks=8, max_batch=2, max_ctx=512))
        with Client(d.socket) as c:
            prompt = c.tokenize("The capital of France is")
            got = c.complete(prompt_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True).ids
            want = [ev.token for ev in generate(e, prompt, SamplingParams.greedy(max_tokens=12, ignore_eos=True))]
            assert got == want
            with pytest.raises(NtxError, match="kv_blocks"):  # 8 blocks hold 128 positions
                c.complete(prompt_ids=prompt * 40, max_tokens=4, temperature=0)
            assert c.complete(prompt_ids=prompt, max_tokens=2, temperature=0).ids  # still serving
    finally:
        d.cleanup()


def _files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs} if os.path.isdir(root) else set()


def test_the_step_cost_table_lands_in_the_state_dir_and_nowhere_else(tmp_path, new_daemon):
    """A daemon run with `--config /dev/null --state-dir D` keeps the step-cost table its first
    speculative request measures in D: not in $NTX_STATE_DIR (the test daemon's own directory),
    nor the user's cache, nor /var/lib/ntransformer (where a root run keeps it without the setting)."""
    from ntx_client import Client
    given, xdg = tmp_path / "given", tmp_path / "xdg"
    service_before = _files(dirs.SERVICE_STATE_DIR)
    d = new_daemon("--state-dir", str(given), "--speculative", "off", env={"XDG_CACHE_HOME": str(xdg)})
    try:
        d.wait_ready()
        with Client(d.socket) as c:
            assert c.complete("1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=4, temperature=0, speculative="ngram").ids
        kept = [os.path.basename(p) for p in _files(given)]
        assert len(kept) == 1 and kept[0].startswith("step-costs-"), (kept, d.log())
        assert not [p for p in _files(d.dir) if "step-costs" in p] and not _files(xdg)
        assert _files(dirs.SERVICE_STATE_DIR) == service_before
    finally:
        d.cleanup()
