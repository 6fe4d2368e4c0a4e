"""The model the daemon serves, and the storage it is read from.

    bring_up()       the NVMe drive brought up first where storage names one (bounded retries
                     with a growing pause; a refusal is never retried), then the first load
    load(path)       load a model, or replace the loaded one: the new one (and, on the drive,
                     its staged copy) is opened and checked first; the old one serves until the
                     new one is ready, and stays when it fails
    unload()         drain and close the loaded engine
    release()        at shutdown: the engine closed, the drive handed back

A read error of the drive while serving turns health NOT_SERVING, drains (the requests it was
reading for fail with UNAVAILABLE) and brings the drive up again the same bounded way.

Thread rule: loads, unloads, the recovery and release hold `lock`; storage_stats and
serving_status from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ntransformerd.config import SPELLING, ConfigError
from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.generation import speculative
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path, plan_for, resolved
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers import STORAGE
from ntransformerd.server import errors
from ntransformerd.server.lifecycle import Lifecycle
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.served import model_name
from ntransformerd.server.storage import Drive, StorageHandle, drive_errors
from ntransformerd.server.systemd import Notifier
from ntransformerd.settings import SettingError
from ntx_system.service import Refused, check_staged_model, file_sha256

log = logging.getLogger("ntransformerd")
LOAD_STOP_WAIT_S = 3.0  # how long shutdown waits for a load under way to notice it should stop


class Models:
    def __init__(self, *, config, notifier: Notifier, lifecycle: Lifecycle, scheduler: Scheduler,
                 stopping: threading.Event, health: Callable[[bool], None],
                 drain: Callable[..., tuple[int, int]], exit: Callable[[int, str], None],
                 transport_factory=None, run_dir: str | None = None, state_dir: str | None = None):
        """health(serving), drain(timeout, reason=), exit(code, why): the daemon's (Daemon.set_health,
        drain, its exit); stopping: set once the daemon stops (a load under way gives up)."""
        self.config, self.notifier, self.lifecycle, self.scheduler = config, notifier, lifecycle, scheduler
        self._stopping, self._health, self._drain, self._exit = stopping, health, drain, exit
        self.lock = threading.RLock()  # the recovery holds it around a reload
        self.drive = None  # storage.Drive when storage = "nvme:…"
        self._resources: dict[int, tuple] = {}  # id(engine) → (storage handle, closers)
        self._transport_factory = transport_factory  # tests: a fake controller instead of VFIO
        self._run_dir, self._state_dir = run_dir, state_dir
        self._backend: str | None = None  # the configured backend, decided once (backend())

    def bring_up(self):
        """Open the drive (when configured) and load the model, retrying drive failures up to
        nvme_retries times with a growing pause; a refusal is never retried."""
        c = self.config
        self.backend()  # a setting the backend cannot honour is refused before the drive comes up
        if not c.storage.startswith("nvme:"):
            return self.load(c.model or None, None)
        if self.drive is None:
            self.drive = Drive(c, status=self.notifier.status, transport_factory=self._transport_factory,
                               run_dir=self._run_dir, state_dir=self._state_dir)
            self.drive.on_failure = self._drive_failed
        for attempt in range(1, c.nvme_retries + 1):
            try:
                self.drive.open()
                return self.load(c.model or None, None)
            except drive_errors() as e:
                self.drive.close()
                if attempt == c.nvme_retries:
                    raise RuntimeError(f"{self.drive.describe} did not come up after {attempt} attempts: {e}; "
                                       "see the kernel log (journalctl -k) and `ntx-admin check`") from e
                pause = min(2.0 ** (attempt - 1), 10.0)
                log.warning("nvme: bring-up attempt %d/%d failed: %s; again in %.0f s", attempt,
                            c.nvme_retries, e, pause)
                self.notifier.status(f"nvme: attempt {attempt}/{c.nvme_retries} failed ({e}); retrying")
                time.sleep(pause)

    def backend(self) -> str:
        """The configured backend, decided once ("auto": cuda where a GPU is visible, else cpu)
        and checked to honour kv_dtype and storage; a ConfigError naming the key otherwise."""
        if self._backend is None:
            c = self.config
            try:
                settled, _ = resolved(EngineConfig(backend=c.backend, kv_dtype=c.kv_dtype, storage=c.storage))
            except SettingError as e:
                raise ConfigError(e.worded(SPELLING)) from None
            self._backend = settled.backend
        return self._backend

    def load(self, path: str | None, backend: str | None):
        """Load a model, or replace the loaded one: the new model (and, with the NVMe storage,
        its staged copy) is opened and checked first; the old one keeps serving until the new
        one is ready, and stays when it fails."""
        with self.lock:
            old = self.scheduler.engine
            try:
                self._check_stop()
                engine, resources = self._open_engine(path, backend, show=old is None)
                try:
                    draft_engine, costs = self._speculation(engine, show=old is None)
                    self._check_stop()
                except BaseException:
                    self._resources[id(engine)] = resources
                    self.close(engine)
                    raise
            except errors.ShuttingDown:
                raise
            except Exception as e:
                where = path or self.config.model or "the default model"
                if old is None:
                    self.lifecycle.failed(f"the model failed to load: {e}")
                    self.notifier.status(f"failed to load {where}: {e}")
                else:
                    log.error("keeping %s: loading %s failed: %s", model_name(old), where, e)
                    self.notifier.status(f"{self.serving_status()} (loading {where} failed: {e})")
                raise
            if old is not None:
                self.unload(self.config.drain_timeout, replacing=f"switching to {model_name(engine)}")
            self.scheduler.attach(engine, draft_engine=draft_engine, costs=costs)
            self.lifecycle.serving()
            self._resources[id(engine)] = resources
            self._health(True)
            self.notifier.status(self.serving_status())
            return engine

    def unload(self, timeout: float, *, replacing: str = "") -> None:
        """Drain and close the loaded engine; `replacing`: another is ready to take its place."""
        self._drain(timeout, reason="ntransformerd is replacing its model" if replacing else
                   "ntransformerd is unloading its model")
        self.close(self.scheduler.detach())
        if replacing:
            self.lifecycle.loading(replacing, 0.99)
        else:
            self.lifecycle.no_model()
        log.info("model unloaded")

    def release(self) -> None:
        """At shutdown: the engine closed (its buffers, on a GPU host the device) and the drive
        handed back. A load under way stops at its next layer (ShuttingDown); one stuck in a
        long step (a kernel compile) is left behind after LOAD_STOP_WAIT_S: the process exits
        around it."""
        locked = self.lock.acquire(timeout=LOAD_STOP_WAIT_S)
        if not locked:
            log.warning("a model load did not stop within %.0f s; exiting without waiting for it", LOAD_STOP_WAIT_S)
        try:
            self.close(self.scheduler.detach())
            self.lifecycle.no_model()
            if self.drive is not None:
                self.drive.close()
                self.drive.release()
        finally:
            if locked:
                self.lock.release()

    def storage_stats(self) -> dict | None:
        """The loaded engine's storage counters (bytes, seconds, commands, errors)."""
        engine = self.scheduler.engine
        res = self._resources.get(id(engine)) if engine is not None else None
        return res[0].stats() if res else None

    def serving_status(self) -> str:
        """The unit's STATUS= while it serves: the model, the socket, the backend."""
        e = self.scheduler.engine
        return f"serving {model_name(e)} on {self.config.socket} ({e.backend_name})" if e else "no model"

    def close(self, engine) -> None:
        """Unload `engine` (None: nothing) and release its storage."""
        if engine is None:
            return
        try:
            engine.unload()  # every device's streams and storage sources
        except Exception as e:  # noqa: BLE001 - its storage is released below either way
            log.warning("closing the old engine's weights: %s", e)
        _, closers = self._resources.pop(id(engine), (None, []))
        for fn in closers:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.warning("releasing the old engine's storage: %s", e)

    def _open_engine(self, path: str | None, backend: str | None, *, show: bool):
        """(engine, its storage handle) for `path` (None: the configured model, the drive's
        staged one, or the default model). `show` reports progress through the scheduler's
        loading state (only when nothing is serving)."""
        c = self.config

        def progress(text: str, fraction: float) -> None:
            self._check_stop()
            if show:
                self._progress(text, fraction)
            else:
                self.notifier.status(text)

        t0 = time.monotonic()
        path = path or c.model or None
        fill = None
        if self.drive is not None:
            if self.drive.staged is None:
                raise errors.NotReady(f"{self.drive.describe} is not up: retry in a few seconds")
            if path is None:
                progress(f"reading the model staged on {self.drive.describe}", 0.0)
                model, fill = self.drive.staged_model()
            else:
                try:
                    check_staged_model(self.drive.staged.layout, self.drive.describe, path,
                                       file_sha256(path, self.drive.state_dir))
                except Refused as e:
                    raise errors.InvalidRequest(str(e)) from None
                progress(f"reading {os.path.basename(path)}", 0.0)
                model = GGUFModel(path)
            source = self.drive.handle()
        else:
            path = path or default_model_path()
            progress(f"reading {os.path.basename(path)}", 0.0)
            model = GGUFModel(path)
            source = StorageHandle.for_file(c.storage, path)
        n = model.config.n_layers
        skip = layer_skip.skip_layers_for(model.path, c.skip_layers, n)  # auto / N read the cached calibration
        seen: set[int] = set()  # per load: a reload reports its progress again

        def loaded(i):
            if i not in seen:
                seen.add(i)
                progress(f"loading layer {len(seen)}/{n}", 0.05 + 0.9 * len(seen) / n)

        try:
            # One configuration, resolved once (the backend decided at start, or the one a
            # LoadModel names; kv_dtype and storage checked against it), and one plan: the drive
            # fills what the plan keeps in memory, the engine loads by the same plan.
            ecfg, _ = resolved(EngineConfig(
                backend=backend or self.backend(), max_batch=c.max_batch, max_ctx=c.max_ctx, kv_dtype=c.kv_dtype,
                kv_blocks=c.kv_blocks or None, kv_spill=c.kv_spill or None, prefill_chunk=c.prefill_chunk, vram_budget=c.vram_budget, pinned_budget=c.pinned_budget,
                storage=source, skip_layers=skip or None, cpu_threads=c.cpu_threads, cpu_kernels=c.cpu_kernels,
                host_compute=c.host_compute,
                link_cap=c.link_cap, deterministic=c.deterministic))
            plan = plan_for(model, ecfg)
            if fill is not None:  # every layer the plan keeps in memory comes off the drive now
                fill(set(range(n)) - set(plan.layers(STORAGE) if plan is not None else ()))
            progress("checking the model's scales", 0.02)
            model.check_finite()  # a NaN scale would only show as NaN logits, request by request
            model.on_layer_loaded(loaded)
            try:
                engine = Engine(model, config=ecfg, plan=plan)
            finally:
                model.on_layer_loaded(None)
        except BaseException as e:
            source.close()
            if fill is not None:
                os.close(model.staged_fd)
            if isinstance(e, SettingError):  # worded with the daemon's keys; INVALID_ARGUMENT to a LoadModel
                raise ConfigError(e.worded(SPELLING)) from None
            raise
        log.info("loaded %s in %.1f s (%s backend, %d layers, storage %s)",
                 path or f"the model staged on {self.drive.describe}", time.monotonic() - t0,
                 engine.backend_name, n, source.name)
        closers = [source.close] + ([lambda fd=model.staged_fd: os.close(fd)] if fill is not None else [])
        return engine, (source, closers)

    def _speculation(self, engine, *, show: bool):
        """The draft engine (its vocabulary checked against the model) and the step cost table
        kept from an earlier start on this machine; without one, the scheduler measures it when
        speculation first needs it (Scheduler.ensure_costs), not here: loads stay fast."""
        c = self.config
        if c.draft and show:
            self._progress(f"loading the draft model {os.path.basename(c.draft)}", 0.97)
        draft_engine = speculative.load_draft_engine(c.draft, engine) if c.draft else None
        if draft_engine is not None:
            draft_engine.model.check_finite()
        return draft_engine, speculative.cached_costs(engine, draft_engine)

    def _drive_failed(self, exc: BaseException) -> None:
        """A read from the drive failed (a reader thread): stop serving, recover elsewhere."""
        self._health(False)
        self.notifier.status(f"nvme: drive error ({exc}); bringing it up again")
        threading.Thread(target=self._recover, args=(exc,), name="nvme-recover", daemon=True).start()

    def _recover(self, exc: BaseException) -> None:
        self.lifecycle.loading(f"recovering the NVMe drive after: {exc}", 0.0)
        # the step that met the error finishes first (its requests get UNAVAILABLE); only then
        # do its weights and the drive go, so nothing is torn down under a running step
        self.scheduler.drain(self.config.drain_timeout, reason=f"the NVMe drive failed ({exc})")
        with self.lock:
            engine = self.scheduler.detach()
            self.lifecycle.loading("bringing the NVMe drive up again", 0.99)
            self.close(engine)
            self.drive.close()
        if self._stopping.is_set():
            return
        try:
            self.bring_up()
        except Exception as e:  # noqa: BLE001 - the unit's restart policy takes over
            log.error("nvme: giving up: %s", e)
            self._exit(1, f"failed: {e}")
            return
        log.info("nvme: recovered; serving again")
        self.notifier.status(self.serving_status())

    def _check_stop(self) -> None:
        """Raise ShuttingDown once a stop is requested: a load ends at its next step."""
        if self._stopping.is_set():
            raise errors.ShuttingDown("ntransformerd is stopping: the model load was abandoned")

    def _progress(self, text: str, fraction: float) -> None:
        self.lifecycle.loading(text, fraction)
        self.notifier.status(text)


__all__ = ["LOAD_STOP_WAIT_S", "Models"]
