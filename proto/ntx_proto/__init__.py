"""ntx_proto: ntransformer's API, what the daemon, its clients and other services share.

    ntx_proto/ntransformer/v1/*.proto     the only source of the API
    ntx_proto.ntransformer.v1             their generated stubs (proto/generate.py)
    ntx_proto.paths                       where the sockets are (the one place both ends resolve them)
    ntx_proto.wire                        what the messages mean beyond their fields: the
                                          trailing metadata that names a refused field, token
                                          bytes as text
    ntx_proto.states                      the proto's state enums as Python enums

It imports no other package of the project, so a service links it without the client library.
"""
