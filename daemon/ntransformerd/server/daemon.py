"""The daemon's lifecycle: sockets, gRPC servers, health, drain and exit; the model it serves
and its storage are server/models.py's (Daemon.models).

    start()   bind both sockets (health NOT_SERVING), start the scheduler, in the background
              bring the NVMe drive up when storage = "nvme:…" (bounded retries) and load the
              model (STATUS= progress: Models.bring_up), then health SERVING and READY=1
    wait()    until SIGTERM/SIGINT or the Admin Shutdown verb
    shutdown() STOPPING=1, health NOT_SERVING, drain within drain_timeout, stop the servers,
              release the engine, close the drive (queues deleted, controller disabled),
              remove the sockets. A load under way stops at its next layer (ShuttingDown);
              shutdown waits for it at most models.LOAD_STOP_WAIT_S, then exits without it

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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ntransformerd.config import ConfigError
from ntransformerd.server import errors, sockets, tcp
from ntransformerd.server.callers import Identify, unix_caller
from ntransformerd.server.lifecycle import Lifecycle
from ntransformerd.server.models import Models
from ntransformerd.server.relay import Relay
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.servicer import AdminServicer, DecodeErrorInterceptor, InferenceServicer
from ntransformerd.server.systemd import Notifier
from ntx_proto.ntransformer.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from ntx_proto.states import ServingState
from ntx_system.service import Refused

log = logging.getLogger("ntransformerd")
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
        self.stopping = threading.Event()  # set once a stop is asked for (a signal, Shutdown, a fatal error)
        self._stop_timeout: float | None = None
        self.exit_code = 0
        self._exit_reason = ""  # why a refusal or failure stopped it (kept as STATUS=)
        self.models = Models(config=config, notifier=self.notifier, lifecycle=self.lifecycle, scheduler=self.scheduler,
                             stopping=self.stopping, health=self.set_health, drain=self.drain, exit=self._exit,
                             transport_factory=transport_factory, run_dir=run_dir, state_dir=state_dir)
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
            self.models.bring_up()
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
        self.notifier.ready(self.models.serving_status())

    def _exit(self, code: int, why: str) -> None:
        """Stop with exit status `code`; `why` stays the unit's STATUS= after the exit."""
        self.exit_code, self._exit_reason = code, why
        self.notifier.status(why)
        if self.lifecycle.state != ServingState.FAILED:  # a failed load already said why
            self.lifecycle.failed(f"ntransformerd is stopping: {why}")
        self.request_shutdown(0)

    def _model_fault(self, reason: str) -> None:
        """The scheduler found the model broken (its logits): not serving until a good load."""
        self.set_health(False)
        self.notifier.status(f"not serving: {reason}")

    def wait(self) -> None:
        while not self.stopping.wait(0.5):
            pass

    def request_shutdown(self, timeout: float | None = None) -> None:
        self._stop_timeout = timeout
        self.stopping.set()

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
        self.models.release()
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

