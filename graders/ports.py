"""Ports: whether one is taken, and a free one. Plain sockets, no gRPC or Ray: the CLI and the
driver check before anything starts (a second server on a held port is refused in one line)."""

from __future__ import annotations

import errno
import socket

from config.grader import GraderConfig

_GRADER = GraderConfig()  # the schema's defaults: declared there, read here

def port_taken(host: str, port: int) -> bool:
    """Whether host:port is held by another socket (bound without SO_REUSEPORT, so a grpcio
    server that set it is seen too). ``::`` covers every IPv4 and IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def free_port(host: str = _GRADER.host) -> int:
    """A port nothing holds now (for Serve's proxies, which cannot report one they picked)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
