"""The server's listening socket, made by us rather than by uvicorn, so that a bad port, an unknown host or a
port in use is one `error:` line (PosttrainError) before anything is printed as served.

    sock = bind_socket(host, port)     # early: before the model loads, so a busy port fails in a second
    ...                                # load the model, build the app
    listen(sock)                       # then `serving ... on` is true: a client may connect at once
    uvicorn.Server(config).run(sockets=[sock])
"""

from __future__ import annotations

import errno
import ipaddress
import socket

from posttrain.errors import PosttrainError

MAX_PORT = 65535
BACKLOG = 2048  # uvicorn's default


def check_port(port: int) -> None:
    if not 0 <= port <= MAX_PORT:
        raise PosttrainError(f"--port {port}: must be between 0 and {MAX_PORT} (0 lets the system pick a free port)")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening. Port 0 binds a free port (see bound_port)."""
    check_port(port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise PosttrainError(f"--host {host!r}: cannot resolve the address ({error.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart may rebind while the last run's connections sit in TIME_WAIT. A socket
    # that listens on the port still makes bind (or, in a race with another binder, listen) fail.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise _cannot_listen(host, port, error) from None
    sock.set_inheritable(True)
    return sock


def listen(sock: socket.socket, host: str) -> None:
    """Start listening; connections queue in the backlog until the server accepts them."""
    try:
        sock.listen(BACKLOG)
    except OSError as error:  # another process bound the same port with SO_REUSEADDR and listened first
        raise _cannot_listen(host, bound_port(sock), error) from None


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def is_loopback(sock: socket.socket) -> bool:
    """Whether only this machine can reach the socket (127.0.0.0/8, ::1, or ::ffff:127.x.y.z)."""
    address = ipaddress.ip_address(sock.getsockname()[0].split("%")[0])  # drop an IPv6 scope id
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _cannot_listen(host: str, port: int, error: OSError) -> PosttrainError:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return PosttrainError(
            f"cannot listen on {where}: the address is already in use "
            f"(another server on that port? choose another --port)"
        )
    if error.errno == errno.EACCES:
        return PosttrainError(f"cannot listen on {where}: permission denied (ports below 1024 need privileges)")
    if error.errno == errno.EADDRNOTAVAIL:
        return PosttrainError(f"cannot listen on {where}: the address is not one of this machine's (--host)")
    return PosttrainError(f"cannot listen on {where}: {error.strerror or error}")
