"""The daemon's lifecycle: sockets, gRPC servers, model loading, health, drain and exit.

    start()   bind both sockets (health NOT_SERVING), start the scheduler, in the background
              bring the NVMe drive up when storage = "nvme:…" (bounded retries) and load the
              model (STATUS= progress), then health SERVING and READY=1
    wait()    until SIGTERM/SIGINT or the Admin Shutdown verb
    shutdown() STOPPING=1, health NOT_SERVING, drain within drain_timeout, stop the servers,
              release the engine, close the drive (queues deleted, controller disabled),
              remove the sockets. A load under way stops at its next layer (ShuttingDown);
              shutdown waits for it at most LOAD_STOP_WAIT_S, then exits without it

A refusal (the drive absent, refused by policy, another model staged, a corrupt header, no
IOMMU, not root) exits 2, which the unit does not restart; a drive that will not come up after
nvme_retries attempts exits 1. A drive error while serving fails the requests it was reading for
with UNAVAILABLE, turns health NOT_SERVING and brings the drive up again the same bounded way.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ntransformerd.config import SPELLING, ConfigError
from ntransformerd.engine import layer_skip, speculative
from ntransformerd.engine.engine import Engine, EngineConfig, default_model_path, plan_for, resolved
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers import STORAGE
from ntransformerd.server import errors, sockets, tcp
from ntransformerd.server.callers import Identify, unix_caller
from ntransformerd.server.relay import Relay
from ntransformerd.server.lifecycle import Lifecycle
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.servicer import AdminServicer, DecodeErrorInterceptor, InferenceServicer, model_name
from ntransformerd.server.storage import Drive, StorageHandle, drive_errors
from ntransformerd.server.systemd import Notifier
from ntransformerd.settings import SettingError
from ntx_proto.ntransformer.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from ntx_proto.states import ServingState
from ntx_system.service import Refused, check_staged_model, file_sha256

log = logging.getLogger("ntransformerd")
LOAD_STOP_WAIT_S = 3.0  # how long shutdown waits for a load under way to notice it should stop
INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class Daemon:
    def __init__(self, *, config, notifier: Notifier | None = None, transport_factory=None,
                 run_dir: str | None = None, state_dir: str | None = None):
        self.config = config
        self.notifier = notifier or Notifier()
        self.lifecycle = Lifecycle()  # the serving state: Status, health and what new requests are told
        self.scheduler = Scheduler(config=config, notifier=self.notifier, lifecycle=self.lifecycle,
                                   on_fault=self._model_fault)
        self.health = health.HealthServicer()
        self._stop = threading.Event()
        self._stop_timeout: float | None = None
        self._load_lock = threading.RLock()  # the recovery holds it around a reload
        self.exit_code = 0
        self._exit_reason = ""  # why a refusal or failure stopped it (kept as STATUS=)
        self.drive = None  # storage.Drive when storage = "nvme:…"
        self._resources: dict[int, tuple] = {}  # id(engine) → (storage handle, closers)
        self._transport_factory = transport_factory
        self._run_dir, self._state_dir = run_dir, state_dir
        self._backend: str | None = None  # the configured backend, decided once (_settled_backend)
        workers = config.max_batch + config.max_queue + 16  # each stream holds a thread while it waits
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rpc"),
                                  interceptors=[DecodeErrorInterceptor()])
        self.admin_server = grpc.server(concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="admin"),
                                        interceptors=[DecodeErrorInterceptor()])
        # the user socket's clients come through the relay, which knows their uid; TCP clients
        # through TLS with a certificate; the admin socket's are root (or the daemon's user)
        self.relay = Relay()
        self._user_socket = ""  # the gRPC server's own listener, behind the relay
        group = config.prefix_cache_share == "group"
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(scheduler=self.scheduler, daemon=self, identify=Identify(relay=self.relay, group=group)),
            self.server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(daemon=self), self.admin_server)
        for server, names in ((self.server, (INFERENCE,)), (self.admin_server, (ADMIN, INFERENCE))):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        # the admin socket also answers the inference verbs (status for ntx-admin)
        admin_caller = Identify(fixed=unix_caller(os.geteuid(), group=group))
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(scheduler=self.scheduler, daemon=self, identify=admin_caller), self.admin_server)
        self.set_health(False)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        if c.tcp_listen:  # first: a bad TLS file then leaves no socket behind
            tcp.bind(self.server, c)
        self._user_socket = sockets.bind_private(self.server, c.socket)
        listener, admin_bound = None, False
        try:
            listener = sockets.listen(c.socket, mode=sockets.USER_MODE, group=c.socket_group)
            if c.admin_socket:
                sockets.bind(self.admin_server, c.admin_socket, mode=sockets.ADMIN_MODE)
                admin_bound = True
            self.server.start()
            if admin_bound:
                self.admin_server.start()
            try:
                self.relay.start(listener, self._user_socket)
            except OSError as e:  # its interpreter cannot be run, no file descriptors left, ...
                raise sockets.SocketError(f"cannot start the user socket's relay process ({sys.executable}): "
                                          f"{e.strerror or e}") from None
        except BaseException:  # only what this start made goes: a socket another daemon serves stays
            self.server.stop(0)
            self.admin_server.stop(0)
            if listener is not None:
                listener.close()
                sockets.remove(c.socket)
            if admin_bound:
                sockets.remove(c.admin_socket)
            sockets.remove_private(self._user_socket)
            raise
        self.scheduler.start()
        admin = c.admin_socket or "none: without $XDG_RUNTIME_DIR, --admin-socket PATH gives one"
        log.info("listening on %s (admin socket %s), pid %d", c.socket, admin, os.getpid())
        threading.Thread(target=self._initial_load, name="loader", daemon=True).start()

    def _initial_load(self) -> None:
        try:
            self._bring_up()
        except errors.ShuttingDown:
            log.info("the load stopped: ntransformerd is stopping")
            return
        except (Refused, ConfigError) as e:  # the drive, or a setting the backend cannot honour
            log.error("refused: %s", e)
            self._exit(2, f"refused: {e}")
            return
        except Exception as e:  # noqa: BLE001 - reported, then the daemon exits 1
            log.error("cannot load the model: %s", e)
            self._exit(1, f"failed: {e}")
            return
        self.notifier.ready(self._serving_status())

    def _exit(self, code: int, why: str) -> None:
        """Stop with exit status `code`; `why` stays the unit's STATUS= after the exit."""
        self.exit_code, self._exit_reason = code, why
        self.notifier.status(why)
        if self.lifecycle.state != ServingState.FAILED:  # a failed load already said why
            self.lifecycle.failed(f"ntransformerd is stopping: {why}")
        self.request_shutdown(0)

    def _bring_up(self):
        """Open the drive (when configured) and load the model, retrying drive failures up to
        nvme_retries times with a growing pause; a refusal is never retried."""
        c = self.config
        self._settled_backend()  # a setting the backend cannot honour is refused before the drive comes up
        if not c.storage.startswith("nvme:"):
            return self.load_model(c.model or None, None)
        if self.drive is None:
            self.drive = Drive(c, status=self.notifier.status, transport_factory=self._transport_factory,
                               run_dir=self._run_dir, state_dir=self._state_dir)
            self.drive.on_failure = self._drive_failed
        for attempt in range(1, c.nvme_retries + 1):
            try:
                self.drive.open()
                return self.load_model(c.model or None, None)
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

    def _settled_backend(self) -> str:
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

    def _drive_failed(self, exc: BaseException) -> None:
        """A read from the drive failed (a reader thread): stop serving, recover elsewhere."""
        self.set_health(False)
        self.notifier.status(f"nvme: drive error ({exc}); bringing it up again")
        threading.Thread(target=self._recover, args=(exc,), name="nvme-recover", daemon=True).start()

    def _recover(self, exc: BaseException) -> None:
        self.lifecycle.loading(f"recovering the NVMe drive after: {exc}", 0.0)
        # the step that met the error finishes first (its requests get UNAVAILABLE); only then
        # do its weights and the drive go, so nothing is torn down under a running step
        self.scheduler.drain(self.config.drain_timeout, reason=f"the NVMe drive failed ({exc})")
        with self._load_lock:
            engine = self.scheduler.detach()
            self.lifecycle.loading("bringing the NVMe drive up again", 0.99)
            self._close_engine(engine)
            self.drive.close()
        if self._stop.is_set():
            return
        try:
            self._bring_up()
        except Exception as e:  # noqa: BLE001 - the unit's restart policy takes over
            log.error("nvme: giving up: %s", e)
            self._exit(1, f"failed: {e}")
            return
        log.info("nvme: recovered; serving again")
        self.notifier.status(self._serving_status())

    def _model_fault(self, reason: str) -> None:
        """The scheduler found the model broken (its logits): not serving until a good load."""
        self.set_health(False)
        self.notifier.status(f"not serving: {reason}")

    def _serving_status(self) -> str:
        e = self.scheduler.engine
        return f"serving {model_name(e)} on {self.config.socket} ({e.backend_name})" if e else "no model"

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def request_shutdown(self, timeout: float | None = None) -> None:
        self._stop_timeout = timeout
        self._stop.set()

    def shutdown(self) -> None:
        timeout = self.config.drain_timeout if self._stop_timeout is None else self._stop_timeout
        self.notifier.stopping(self._exit_reason or "draining")
        self.set_health(False)
        log.info("stopping: draining in-flight requests for up to %.1f s", timeout)
        finished, cancelled = self.drain(timeout, reason="ntransformerd is shutting down")
        log.info("drained: %d finished, %d cancelled", finished, cancelled)
        self.server.stop(grace=1.0).wait(2.0)
        self.relay.stop()  # after the server: its last words to the clients have passed through
        self.admin_server.stop(grace=0.5).wait(1.0)
        self.scheduler.stop()
        # a load under way stops at its next layer (_check_stop); one stuck in a long step (a
        # kernel compile) is left behind: the process exits around it
        locked = self._load_lock.acquire(timeout=LOAD_STOP_WAIT_S)
        if not locked:
            log.warning("a model load did not stop within %.0f s; exiting without waiting for it", LOAD_STOP_WAIT_S)
        try:
            self._close_engine(self.scheduler.detach())  # its buffers (on a GPU host the device) go
            self.lifecycle.no_model()
            if self.drive is not None:
                self.drive.close()
                self.drive.release()
        finally:
            if locked:
                self._load_lock.release()
        for path in filter(None, (self.config.socket, self.config.admin_socket)):
            sockets.remove(path)
        if self._user_socket:
            sockets.remove_private(self._user_socket)
        log.info("stopped")

    # ---- health and models ----------------------------------------------------------------

    def drain(self, timeout: float, *, reason: str) -> tuple[int, int]:
        """Admit nothing new, let in-flight requests finish for `timeout` s, cancel the rest:
        (finished, cancelled)."""
        self.lifecycle.draining(reason)
        self.set_health(False)
        return self.scheduler.drain(timeout, reason=reason)

    def resume(self) -> None:
        """Admit requests again after a drain."""
        self.lifecycle.resume(has_model=self.scheduler.engine is not None)
        self.set_health(self.lifecycle.state == ServingState.SERVING)

    def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(INFERENCE, status)

    def load_model(self, path: str | None, backend: str | None):
        """Load a model, or replace the loaded one: the new model (and, with the NVMe storage,
        its staged copy) is opened and checked first; the old one keeps serving until the new
        one is ready, and stays when it fails."""
        with self._load_lock:
            old = self.scheduler.engine
            try:
                self._check_stop()
                engine, resources = self._open_engine(path, backend, show=old is None)
                try:
                    draft_engine, costs = self._speculation(engine, show=old is None)
                    self._check_stop()
                except BaseException:
                    self._resources[id(engine)] = resources
                    self._close_engine(engine)
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
                    self.notifier.status(f"{self._serving_status()} (loading {where} failed: {e})")
                raise
            if old is not None:
                self.unload_model(self.config.drain_timeout, replacing=f"switching to {model_name(engine)}")
            self.scheduler.attach(engine, draft_engine=draft_engine, costs=costs)
            self.lifecycle.serving()
            self._resources[id(engine)] = resources
            self.set_health(True)
            self.notifier.status(self._serving_status())
            return engine

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
                backend=backend or self._settled_backend(), max_batch=c.max_batch, max_ctx=c.max_ctx, kv_dtype=c.kv_dtype,
                kv_blocks=c.kv_blocks or None, kv_spill=c.kv_spill or None, prefill_chunk=c.prefill_chunk, vram_budget=c.vram_budget, pinned_budget=c.pinned_budget,
                storage=source, skip_layers=skip or None, cpu_threads=c.cpu_threads, host_compute=c.host_compute,
                link_cap=c.link_cap))
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

    def storage_stats(self) -> dict | None:
        """The loaded engine's storage counters (bytes, seconds, commands, errors)."""
        engine = self.scheduler.engine
        res = self._resources.get(id(engine)) if engine is not None else None
        return res[0].stats() if res else None

    def _close_engine(self, engine) -> None:
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

    def _check_stop(self) -> None:
        """Raise ShuttingDown once a stop is requested: a load ends at its next step."""
        if self._stop.is_set():
            raise errors.ShuttingDown("ntransformerd is stopping: the model load was abandoned")

    def _progress(self, text: str, fraction: float) -> None:
        self.lifecycle.loading(text, fraction)
        self.notifier.status(text)

    def unload_model(self, timeout: float, *, replacing: str = "") -> None:
        """Drain and close the loaded engine; `replacing`: another is ready to take its place."""
        self.drain(timeout, reason="ntransformerd is replacing its model" if replacing else
                   "ntransformerd is unloading its model")
        self._close_engine(self.scheduler.detach())
        if replacing:
            self.lifecycle.loading(replacing, 0.99)
        else:
            self.lifecycle.no_model()
        log.info("model unloaded")

