"""One table of settings (ntransformerd/settings.py): every surface of a setting derives from its
row, so the daemon's file and flags, ntx-model's flags and --config, EngineConfig, DaemonConfig,
CudaSettings, ntx-admin's ServiceConfig, --help, the example config and the README's table all
say one default and one limit, and an error names the key or flag of the program that was run."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib

import pytest

from ntransformerd import config, dirs, settings
from ntransformerd.engine import backends
from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.backends.cuda.settings import ENV_SETTINGS, CudaSettings
from ntransformerd.engine.backends.host import native
from ntransformerd.engine.runtime.engine import EngineConfig
from ntransformerd.engine.generation.speculative_mode import Mode
from ntransformerd.settings import DAEMON, FILE, MODEL, SETTINGS, Choice, Integer, Number, SettingError, Size
from ntransformerd.tools import ntx_model
from ntx_system.service import ServiceConfig

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
EXAMPLE = os.path.join(ROOT, "packaging", "ntransformerd.toml")


def _ntx_model_settings(argv: list[str]) -> dict:
    """ntx-model run's settings for `argv`, typed by their rows (what cmd_run hands down)."""
    args = ntx_model.build_parser().parse_args(["run", *argv])
    given = ntx_model.run_settings(args)
    return {name: row.parse(given.get(name)) for name, row in settings.of(MODEL).items()}


def _toml(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return f'"{v}"' if isinstance(v, str) else repr(v)


@pytest.fixture
def every_setting(tmp_path, synth_model):
    """One config file that sets every key of the file to a value other than its default."""
    model = synth_model("small", "q8_0")
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("PEM")
    values = {
        "socket": str(tmp_path / "d.sock"), "admin_socket": str(tmp_path / "a.sock"), "socket_group": "",
        "tcp_listen": "127.0.0.1:0", "tls_cert": str(tmp_path / "cert.pem"), "tls_key": str(tmp_path / "key.pem"),
        "tls_client_ca": str(tmp_path / "ca.pem"), "model": model, "backend": "cpu-ref", "vram_budget": "1GiB",
        "pinned_budget": "512MiB", "max_batch": 3, "max_ctx": 256, "kv_dtype": "f16", "kv_blocks": 40,
        "kv_spill": "64MiB", "prefill_chunk": 32, "cpu_threads": 2, "cpu_kernels": "generic",
        "host_compute": "auto", "link_cap": "6.5GB/s",
        "storage": "mmap", "speculative": "prefix:2", "draft": model, "skip_layers": "1,2", "max_queue": 5,
        "prefix_cache": False, "prefix_cache_share": "group", "default_max_tokens": 9, "stream_interval": 0.05, "drain_timeout": 1.5,
        "log_level": "debug", "state_dir": str(tmp_path / "state"), "nvme_queues": 3, "nvme_queue_depth": 16,
        "nvme_io_timeout": 2.5, "nvme_retries": 2, "nvme_release": "keep", "noiommu": True,
        "deterministic": True,
    }
    assert set(values) == set(settings.of(FILE)), "a new key of the file: give it a value here"
    for name, v in values.items():
        assert SETTINGS[name].parse(v) != SETTINGS[name].default, name
    f = tmp_path / "every.toml"
    f.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in values.items()))
    return f


def test_every_setting_from_one_file_is_the_same_in_the_daemon_and_ntx_model(every_setting):
    daemon = config.load(["--config", str(every_setting)], environ={})
    tool = _ntx_model_settings(["--config", str(every_setting)])
    shared = set(settings.of(FILE)) & set(settings.of(MODEL))
    assert shared >= {"backend", "vram_budget", "max_batch", "max_ctx", "kv_dtype", "kv_blocks", "kv_spill",
                      "prefill_chunk", "cpu_threads", "cpu_kernels", "host_compute", "link_cap", "storage", "speculative",
                      "draft", "skip_layers", "model", "state_dir"}
    for name in sorted(shared):
        assert getattr(daemon, name) == tool[name], name
    assert daemon.vram_budget == 1 << 30 and daemon.link_cap == 6.5e9 and daemon.speculative == Mode("prefix", "2")
    # the same engine: the daemon's engine_config and ntx-model's, each typed once
    args = ntx_model.build_parser().parse_args(["run", "--config", str(every_setting)])
    args.model = tool["model"]
    assert daemon.engine_config() == ntx_model.engine_config(args, ntx_model.run_settings(args))
    assert daemon.engine_config().skip_layers == (1, 2)
    # flags over the file, in both programs
    over = config.load(["--config", str(every_setting), "--max-batch", "7"], environ={})
    assert over.max_batch == 7 == _ntx_model_settings(["--config", str(every_setting), "--max-batch", "7"])["max_batch"]


def test_ntx_model_runs_from_the_daemons_file(every_setting, tmp_path, capsys, monkeypatch):
    """`ntx-model run --config FILE --plan`: the plan of the file's model and settings."""
    monkeypatch.setenv(dirs.STATE_DIR_ENV, str(tmp_path / "before"))  # restored after the run's export
    assert ntx_model.main(["run", "--config", str(every_setting), "--plan", "--json"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert '"backend": "cpu"' in out and '"dtype": "f16", "token_bytes"' in out and '"max_batch": 3' in out, out
    assert os.environ[dirs.STATE_DIR_ENV] == str(tmp_path / "state")  # the file's state_dir, for the whole run


def test_every_setting_has_one_default_on_every_surface():
    for name, f in config.FIELDS.items():
        assert f.default == SETTINGS[name].default, name
    for f in dataclasses.fields(EngineConfig):
        assert f.default == SETTINGS[f.name].default and MODEL in SETTINGS[f.name].where, f.name
    assert EngineConfig() == config.DaemonConfig().engine_config()  # nothing given: the same engine
    # ntx-model: no flag given is no value (the row decides), and no file: the defaults
    assert all(v == SETTINGS[n].default for n, v in _ntx_model_settings([]).items())
    for name in ENV_SETTINGS:  # the CUDA knobs: the rows' defaults, or per quant type where they say
        row, value = SETTINGS[name], getattr(CudaSettings(), name)
        assert value == row.default if row.default is not None else isinstance(value, dict), name
    for name in ("storage", "model", "noiommu", "nvme_release"):  # ntx-admin's service step reads these
        assert getattr(ServiceConfig(), name) == SETTINGS[name].default, name
    assert SETTINGS["backend"].default == "auto" and SETTINGS["prefill_chunk"].default == 256


def test_the_help_of_both_programs_shows_each_rows_default_and_limits(capsys):
    daemon = " ".join(config.argument_parser().format_help().split("options:", 1)[1].split())
    with pytest.raises(SystemExit):
        ntx_model.main(["run", "--help"])
    tool = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for program, text in ((DAEMON, daemon), (MODEL, tool)):
        for name, row in settings.of(program).items():
            if name == "model" and program == MODEL:
                continue  # its MODEL argument
            after = re.split(rf"{row.flag}\b(?!-)", text, maxsplit=1)[1]
            entry = after.split("(default: ", 1)[1]  # this flag's own
            assert entry.startswith(" ".join(row.default_text.split())), (program, name)
            if isinstance(row.kind, (Integer, Size, Number)):
                assert entry.split(")", 1)[0].endswith(row.kind.limits), (program, name)


# each ntx-model command with the least it needs to parse
COMMANDS = {"info": [], "tokenize": ["text"], "run": [], "quantize": ["in", "out", "--type", "q8_0"],
            "slice": ["out", "--layers", "1"], "synth": ["out"], "perplexity": ["--file", "t"],
            "calibrate-skip": ["--file", "t"]}


def test_no_ntx_model_command_has_its_own_default_for_a_setting():
    """A flag named as a setting, in any ntx-model command, is the setting: no default of its own
    (run's come from the rows; perplexity and calibrate-skip took --backend cpu where the rows
    say auto)."""
    listed = re.findall(r"^    (\S+)", ntx_model.build_parser().format_help().split("options:")[0], re.M)
    assert set(listed) == set(COMMANDS), "a new ntx-model command: add it to COMMANDS"
    own = []
    for command, argv in COMMANDS.items():
        args = vars(ntx_model.build_parser().parse_args([command, *argv]))
        for name, value in args.items():
            if name in SETTINGS and value is not None and value != SETTINGS[name].default:
                own.append(f"ntx-model {command} {SETTINGS[name].flag}: {value!r}, the row says "
                           f"{SETTINGS[name].default!r}")
    assert not own, "give these flags default=None and read them through settings.SETTINGS:\n" + "\n".join(own)


def _limits(row):
    """(values the row takes, values it refuses) at its edges."""
    k = row.kind
    if isinstance(k, Integer):
        return [k.lo, k.hi], [k.lo - 1, k.hi + 1]
    if isinstance(k, Number):
        return [k.lo, k.hi], [k.lo - 1, k.hi + 1]
    if isinstance(k, Choice):
        return list(k.options), ["bogus"]
    if isinstance(k, Size):
        return [str(k.minimum), k.word], [str(k.minimum - 1)]
    return [], []


@pytest.mark.parametrize("name", list(settings.of(FILE)))
def test_a_key_has_one_limit_in_the_daemon_ntx_model_and_the_engine(name):
    """The edges of each key: taken by every surface that has it, and the value past them
    refused by each, the error naming the key (the daemon) or the flag (ntx-model)."""
    row = SETTINGS[name]
    ok, bad = _limits(row)
    base = {"backend": "cpu-ref", "storage": "mmap"}  # a backend that takes every kv_dtype and storage
    for v in ok:
        config.DaemonConfig(**{**base, name: v})
        if name in EngineConfig.__dataclass_fields__:
            EngineConfig(**{**base, name: v})
    for v in bad:
        with pytest.raises(config.ConfigError) as e:
            config.DaemonConfig(**{**base, name: v})
        assert str(e.value).startswith(f"{name} = {v!r}: "), e.value
        if name in EngineConfig.__dataclass_fields__:
            with pytest.raises(SettingError) as e:
                EngineConfig(**{**base, name: v})
            assert e.value.worded(ntx_model.FLAGS).startswith(f"{row.flag} {v}: "), e.value


def test_cpu_threads_has_one_limit(capsys):
    """A config the daemon accepts no longer stops ntx-model at load (4096 there, 1024 here once)."""
    assert config.DaemonConfig(cpu_threads=1024).cpu_threads == EngineConfig(cpu_threads=1024).cpu_threads == 1024
    with pytest.raises(config.ConfigError, match="cpu_threads = 2000: must be an integer in 0..1024"):
        config.DaemonConfig(cpu_threads=2000)
    assert ntx_model.main(["run", "--plan", "--cpu-threads", "2000"]) == 2
    assert "ntx-model: error: --cpu-threads 2000: must be an integer in 0..1024" in capsys.readouterr().err


def test_errors_name_the_key_or_flag_of_the_program_that_was_run(tmp_path, capsys):
    f = tmp_path / "d.toml"
    f.write_text('max_batch = 0\n')
    with pytest.raises(config.ConfigError, match=r"^max_batch = 0: must be an integer in 1\.\.4096$"):
        config.load(["--config", str(f)], environ={})
    assert ntx_model.main(["run", "--plan", "--config", str(f)]) == 2
    assert f"ntx-model: error: config {f}: max_batch = 0: must be" in capsys.readouterr().err  # the key: the file's
    assert ntx_model.main(["run", "--plan", "--max-batch", "0"]) == 2
    assert "ntx-model: error: --max-batch 0: must be an integer in 1..4096" in capsys.readouterr().err
    assert ntx_model.main(["run", "--plan", "--ctx", "0"]) == 2  # the older spelling of --max-ctx
    assert "ntx-model: error: --max-ctx 0: must be an integer in 1..16777216" in capsys.readouterr().err
    f.write_text('stream_depth = 3\n')  # ntx-model's own setting: no key of the daemon's file
    with pytest.raises(config.ConfigError, match="unknown key.*stream_depth"):
        config.load(["--config", str(f)], environ={})
    with pytest.raises(SettingError, match="^NTX_PDL = 'maybe': use true or false"):
        CudaSettings.from_env({"NTX_PDL": "maybe"})


def test_the_environment_is_a_surface_under_the_file_and_the_flags(tmp_path):
    env = {"NTX_SOCKET": str(tmp_path / "e.sock"), dirs.STATE_DIR_ENV: str(tmp_path / "env-state")}
    c = config.load([], environ=env)
    assert (c.socket, c.state_dir) == (str(tmp_path / "e.sock"), str(tmp_path / "env-state"))
    f = tmp_path / "d.toml"
    f.write_text(f'state_dir = "{tmp_path}/file-state"\n')
    assert config.load(["--config", str(f)], environ=env).state_dir == f"{tmp_path}/file-state"
    assert config.load(["--config", str(f), "--state-dir", "flag"], environ=env).state_dir == os.path.abspath("flag")
    assert CudaSettings.from_env({"NTX_ATTN_ONE_LAUNCH": "0"}).attn_one_launch_max_bucket == 0


def test_the_vocabularies_of_the_rows_are_the_engines():
    assert SETTINGS["backend"].kind.options == backends.BACKENDS
    assert set(backends.BACKENDS) == set(backends.TYPES) | {"auto"}
    assert SETTINGS["kv_dtype"].kind.options == ("auto",) + kv_cache.KV_DTYPES
    assert SETTINGS["cpu_kernels"].kind.options == ("auto",) + tuple(v.name for v in native.VARIANTS)


def test_the_example_config_shows_every_key_with_its_default():
    text = open(EXAMPLE).read()
    shown = dict(re.findall(r"^# (\w+) = (.*?)(?:[ \t]+#.*)?$", text, re.M))
    assert set(shown) == set(settings.of(FILE))
    for name, value in shown.items():
        parsed = tomllib.loads(f"v = {value}")["v"]
        assert SETTINGS[name].parse(parsed) == SETTINGS[name].default or \
            (name in ("vram_budget", "pinned_budget", "link_cap") and SETTINGS[name].parse(parsed) is None), name


def test_the_readme_table_is_the_rows():
    """README.md carries the table `python -m ntransformerd.settings readme` prints, between its
    markers: a row changed without the README fails here."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert settings.README_BEGIN in readme, ("README.md has no settings table: paste the output of "
                                             "`python -m ntransformerd.settings readme` into its Settings section")
    begin = readme.index(settings.README_BEGIN)
    end = readme.index(settings.README_END, begin) + len(settings.README_END)
    assert readme[begin:end] == settings.readme_table(), "README.md's settings table differs from the rows: " \
        "paste `python -m ntransformerd.settings readme` again"


def test_the_table_prints_from_the_command_line(capsys):
    assert settings.main(["readme"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(settings.README_BEGIN) and out.rstrip().endswith(settings.README_END)
    assert all(f"| `{name}` |" in out for name in SETTINGS)
