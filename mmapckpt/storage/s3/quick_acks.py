"""Responses read without the 40 ms stall of a delayed acknowledgement, on the client's connections.

A server that writes a response's headers and its body in two sends, with Nagle's algorithm on
(Ceph's radosgw does), holds the body's last, partial segment until the client acknowledges the
headers; Linux delays that acknowledgement up to 40 ms (more where the connection has been
quiet). Every small response pays it: a commit's first bytes, a listing, a HEAD, the XML of a
multipart upload's start and completion (measured on radosgw: 43-48 ms a request, 2.5-8 ms with
this), so opening a checkpoint and every save paid it several times. The client asks for
immediate acknowledgements (``TCP_QUICKACK``) each time it starts reading a response; the option
does not stay set, so it is set per response. Where the platform has no ``TCP_QUICKACK``
(not Linux) or botocore's session does not look as expected, the client is left as it is.
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["quick_acks"]

_QUICKACK = getattr(socket, "TCP_QUICKACK", None)
_classes: dict[type, type] = {}


def _quick(pool_cls: type) -> type:
    """``pool_cls`` (botocore's connection pool) with connections that acknowledge a response's segments at once."""
    made = _classes.get(pool_cls)
    if made is not None:
        return made
    base = pool_cls.ConnectionCls

    class QuickAckConnection(base):  # type: ignore[misc, valid-type]
        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            sock = getattr(self, "sock", None)
            if sock is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
                except OSError:  # a socket that takes no TCP options (a proxy's tunnel): as it was
                    pass
            return super().getresponse(*args, **kwargs)

    made = _classes[pool_cls] = type(f"QuickAck{pool_cls.__name__}", (pool_cls,), {"ConnectionCls": QuickAckConnection})
    return made


def quick_acks(client: Any) -> bool:
    """Make the connections of boto3 ``client`` acknowledge responses at once (see the module docstring); whether
    it could."""
    if _QUICKACK is None:
        return False
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    classes = getattr(session, "_pool_classes_by_scheme", None)  # shared with its pool managers (botocore)
    if not isinstance(classes, dict) or not all(hasattr(c, "ConnectionCls") for c in classes.values()):
        return False
    for scheme, cls in list(classes.items()):
        classes[scheme] = _quick(cls)
    return True
