"""ntransformerd's serving side: scheduler (continuous batching), servicer (gRPC), sockets, systemd."""
