"""What server/ asks of the engine it serves, declared once.

    KVPool        the KV pool admission reads: blocks n positions need, blocks free, positions
                  a slot still holds
    KVSlots       the slots the prefix cache hands out and keeps: open, close, park, reopen,
                  copy_prefix, kept, free_slots
    ServedEngine  all of that, the model and its tokenizer, the steps the decode loop runs
                  (step, launch: engine/generation/decode.py calls them), chat prompts, and the report
                  Status shows (engine/runtime/report.py)

engine/runtime/engine.py's Engine answers all of it; a test double answers what its test uses. server/
never probes an engine for what it might have: what it calls is declared here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from ntransformerd.engine.runtime.report import EngineReport


class KVPool(Protocol):
    def blocks_for(self, n: int) -> int: ...

    def available(self) -> int: ...

    def kept(self, slot: int) -> int: ...


class KVSlots(Protocol):
    @property
    def free_slots(self) -> int: ...

    def open(self) -> int: ...

    def close(self, slot: int) -> None: ...

    def park(self, slot: int) -> None: ...

    def reopen(self, slot: int, *, keep: int) -> None: ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...

    def kept(self, slot: int) -> int: ...


class ServedEngine(KVSlots, Protocol):
    model: object  # gguf_file.GGUFModel: path, metadata, file_size
    cfg: object  # gguf_file.LlamaConfig: n_layers, vocab_size
    tokenizer: object  # tokenizer.Tokenizer
    max_ctx: int
    backend: object  # devices.Backend: is_host
    backend_name: str
    kv: KVPool

    def length(self, slot: int) -> int: ...

    def truncate(self, slot: int, length: int) -> None: ...

    def step(self, items: Sequence[tuple[int, Sequence[int]]], *, all_logits: bool = False, top: int | None = None,
             layers: Sequence[int] | None = None, sample=None): ...

    def launch(self, items: Sequence[tuple[int, Sequence[int]]], *, sample=None, all_logits: bool = False,
               top: int | None = None, after=None, rows=None): ...

    def encode_chat(self, messages, *, tools=None, add_generation_prompt: bool = True) -> list[int]: ...

    def report(self) -> EngineReport: ...

    def unload(self) -> None: ...


def model_name(engine: ServedEngine) -> str:
    """The model's name as clients see it: general.name, else the file name."""
    return str(engine.model.metadata.get("general.name") or os.path.basename(engine.model.path))


__all__ = ["KVPool", "KVSlots", "ServedEngine", "model_name"]
