"""The daemon's lifecycle: sockets, gRPC servers, model loading, health, drain and exit.

    start()   bind both sockets (health NOT_SERVING), start the scheduler, load the model in the
              background (STATUS= progress), then health SERVING and READY=1
    wait()    until SIGTERM/SIGINT or the Admin Shutdown verb
    shutdown() STOPPING=1, health NOT_SERVING, drain within drain_timeout, stop the servers,
              release the engine, remove the sockets
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ntransformerd.server import sockets, tcp
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.servicer import AdminServicer, DecodeErrorInterceptor, InferenceServicer, model_name
from ntransformerd.server.systemd import Notifier
from ntx_client._proto.ntransformer.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc

log = logging.getLogger("ntransformerd")
INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class Daemon:
    def __init__(self, *, config, notifier: Notifier | None = None):
        self.config = config
        self.notifier = notifier or Notifier()
        self.scheduler = Scheduler(config=config, notifier=self.notifier)
        self.health = health.HealthServicer()
        self._stop = threading.Event()
        self._stop_timeout: float | None = None
        self._load_lock = threading.Lock()
        self.exit_code = 0
        workers = config.max_batch + config.max_queue + 16  # each stream holds a thread while it waits
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rpc"),
                                  interceptors=[DecodeErrorInterceptor()])
        self.admin_server = grpc.server(concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="admin"),
                                        interceptors=[DecodeErrorInterceptor()])
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(scheduler=self.scheduler, daemon=self), self.server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(daemon=self), self.admin_server)
        for server, names in ((self.server, (INFERENCE,)), (self.admin_server, (ADMIN, INFERENCE))):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        # the admin socket also answers the inference verbs (status for ntx-admin)
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(scheduler=self.scheduler, daemon=self), self.admin_server)
        self.set_health(False)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        if c.tcp_listen:  # first: a bad TLS file then leaves no socket behind
            tcp.bind(self.server, c)
        sockets.bind(self.server, c.socket, mode=sockets.USER_MODE, group=c.socket_group)
        sockets.bind(self.admin_server, c.admin_socket, mode=sockets.ADMIN_MODE)
        self.server.start()
        self.admin_server.start()
        self.scheduler.start()
        log.info("listening on %s (admin %s), pid %d", c.socket, c.admin_socket, os.getpid())
        threading.Thread(target=self._initial_load, name="loader", daemon=True).start()

    def _initial_load(self) -> None:
        try:
            self.load_model(self.config.model or None, None)
        except Exception as e:  # noqa: BLE001 - reported, then the daemon exits 1
            log.error("cannot load the model: %s", e)
            self.exit_code = 1
            self.request_shutdown(0)
            return
        self.notifier.ready(self._serving_status())

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
        self.notifier.stopping("draining")
        self.set_health(False)
        log.info("stopping: draining in-flight requests for up to %.1f s", timeout)
        finished, cancelled = self.scheduler.drain(timeout)
        log.info("drained: %d finished, %d cancelled", finished, cancelled)
        self.server.stop(grace=1.0).wait(2.0)
        self.admin_server.stop(grace=0.5).wait(1.0)
        self.scheduler.stop()
        self.scheduler.detach()  # drops the engine: its buffers (and on a GPU host the device) go
        for path in (self.config.socket, self.config.admin_socket):
            sockets.remove(path)
        log.info("stopped")

    # ---- health and models ----------------------------------------------------------------

    def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(INFERENCE, status)

    def load_model(self, path: str | None, backend: str | None):
        """Load (or replace) the model; requests get FAILED_PRECONDITION while it loads."""
        from ntransformerd.engine.engine import Engine, EngineConfig
        from ntransformerd.engine.gguf_file import GGUFModel
        from ntransformerd.engine.engine import default_model_path

        with self._load_lock:
            c = self.config
            if self.scheduler.engine is not None:
                self.unload_model(c.drain_timeout)
            path = path or default_model_path()
            self.set_health(False)
            progress = self._progress
            progress(f"reading {os.path.basename(path)}", 0.0)
            t0 = time.monotonic()
            try:
                model = GGUFModel(path)
                n = model.config.n_layers
                seen: set[int] = set()  # per load: a reload reports its progress again

                def loaded(i):
                    if i not in seen:
                        seen.add(i)
                        progress(f"loading layer {len(seen)}/{n}", 0.05 + 0.9 * len(seen) / n)

                model.on_layer_loaded(loaded)
                try:
                    engine = Engine(model, config=EngineConfig(
                        backend=backend or c.backend, max_seqs=c.max_batch, max_ctx=c.max_ctx,
                        kv_dtype=c.kv_dtype, prefill_chunk=c.prefill_chunk,
                        vram_budget=c.vram_budget, ram_budget=c.pinned_budget))
                finally:
                    model.on_layer_loaded(None)
            except Exception as e:
                self.scheduler.fail(f"{e}")
                self.notifier.status(f"failed to load {path}: {e}")
                raise
            self.scheduler.attach(engine)
            self.set_health(True)
            log.info("loaded %s in %.1f s (%s backend, %d layers)", path, time.monotonic() - t0,
                     engine.backend_name, n)
            self.notifier.status(self._serving_status())
            return engine

    def _progress(self, text: str, fraction: float) -> None:
        self.scheduler.set_loading(text, fraction)
        self.notifier.status(text)

    def unload_model(self, timeout: float) -> None:
        self.set_health(False)
        self.scheduler.drain(timeout, reason="ntransformerd is replacing its model")
        self.scheduler.detach()
        log.info("model unloaded")
