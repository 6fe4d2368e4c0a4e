"""ntransformerd's serving side: scheduler (continuous batching: policy decides, loop runs, steps
execute, metrics count), servicer (gRPC), models (loading), sockets, systemd."""
