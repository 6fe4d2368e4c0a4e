"""ntransformerd: the foreground daemon process (systemd Type=notify, or by hand for development).

    ntransformerd --socket ./ntx.sock --backend cpu        # unprivileged, the default model
    ntransformerd --config /etc/ntransformer/ntransformerd.toml
"""

from __future__ import annotations

import logging
import signal
import sys

from ntransformerd import config as config_mod
from ntransformerd.server.daemon import Daemon
from ntransformerd.server.sockets import SocketError
from ntransformerd.server.systemd import Notifier, setup_logging

log = logging.getLogger("ntransformerd")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_mod.load(argv)
    except config_mod.ConfigError as e:
        print(f"ntransformerd: {e}", file=sys.stderr)
        return 2
    where = setup_logging(cfg.log_level)
    config_mod.apply_to_process(cfg)  # the state directory and the host kernels' threads
    daemon = Daemon(config=cfg, notifier=Notifier())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: daemon.request_shutdown())
    log.info("ntransformerd starting (logging to %s)", where)
    try:
        daemon.start()
    except SocketError as e:
        log.error("%s", e)
        return 1
    daemon.wait()
    daemon.shutdown()
    return daemon.exit_code


if __name__ == "__main__":
    sys.exit(main())
