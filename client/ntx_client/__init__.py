"""ntx_client: talk to ntransformerd (Client, AsyncClient, AdminClient) and the ntx-client CLI."""

from ntx_client.channels import TLS
from ntx_client.client import AdminClient, AsyncClient, Chunk, Client, Completion
from ntx_client.errors import ConnectionFailed, NtxError, PermissionDenied
from ntx_proto.paths import socket_path

__all__ = ["AdminClient", "AsyncClient", "Chunk", "Client", "Completion", "ConnectionFailed",
           "NtxError", "PermissionDenied", "TLS", "socket_path"]
