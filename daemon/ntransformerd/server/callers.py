"""Who sent a request, as the daemon establishes it: never what the client says it is.

    user socket    the uid of the connecting process, from the kernel (relay.py: SO_PEERCRED)
    TCP with TLS   the subject of the client certificate that the configured CA signed
    admin socket   the daemon's own user (only root, or the daemon's user, can open it)

A client may name one more level below itself, `on_behalf_of` in its request: the gateway names
the API key a request came with. That sub-identity lives under the sender's own ("uid:1001/
key:3fa1…"), so a sender can split what is its own and never reach another's. What is scoped by
caller: the prefix cache (prefix_cache.py) and the requests a Status lists.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import re

from ntransformerd.server.errors import InvalidRequest, shown

ON_BEHALF_OF = re.compile(r"[A-Za-z0-9._:@=+-]{1,128}")


@dataclasses.dataclass(frozen=True)
class Caller:
    principal: str  # "uid:1001" or "tls:CN=alice,O=example"
    uid: int | None = None  # a unix caller's
    gid: int | None = None  # the uid's primary group (set where prefix_cache_share = "group" needs it)
    on_behalf_of: str = ""  # a sub-identity the sender named ("key:3fa1…"), scoped under it

    @property
    def id(self) -> str:
        return f"{self.principal}/{self.on_behalf_of}" if self.on_behalf_of else self.principal

    def below(self, on_behalf_of: str) -> "Caller":
        """This caller speaking for `on_behalf_of` (a request's field): checked, scoped under it."""
        if not on_behalf_of:
            return self
        if not ON_BEHALF_OF.fullmatch(on_behalf_of):
            raise InvalidRequest(f"on_behalf_of {shown(on_behalf_of)} is not an identity: use 1..128 letters, digits "
                                 "and . _ : @ = + - (e.g. key:3fa1c2), or leave it empty")
        return dataclasses.replace(self, on_behalf_of=on_behalf_of)

    @property
    def privileged(self) -> bool:
        """Root or the daemon's own user: sees every request in Status."""
        return self.uid is not None and self.uid in (0, os.geteuid())


def unix_caller(uid: int, *, group: bool) -> Caller:
    """The caller of uid `uid`; with `group`, its primary group from the user database (a uid
    without an entry shares with no group: its process's gid is its own to choose)."""
    gid = None
    if group:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = None
    return Caller(f"uid:{uid}", uid=uid, gid=gid)


def tls_caller(auth: dict) -> Caller | None:
    """The caller of a TLS connection from gRPC's auth context (its client certificate's subject)."""
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    subject = auth.get("x509_subject") or auth.get("x509_common_name")
    if not subject:
        return None
    return Caller("tls:" + subject[0].decode("utf-8", "backslashreplace"))


class Identify:
    """context → Caller for one gRPC server: the relay's uid for unix peers, the certificate for
    TLS ones, or `fixed` for every call (the admin socket). None: nobody the daemon can name."""

    def __init__(self, *, relay=None, fixed: Caller | None = None, group: bool = False):
        self.relay, self.fixed, self.group = relay, fixed, group

    def __call__(self, context) -> Caller | None:
        if self.fixed is not None:
            return self.fixed
        peer = context.peer() or ""
        if peer.startswith("unix") and self.relay is not None:
            uid = self.relay.uid_of(peer)
            return unix_caller(uid, group=self.group) if uid is not None else None
        return tls_caller(context.auth_context() or {})
