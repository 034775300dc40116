"""Which local IPv4 subnet reaches the remote hosts (for MPI's interface choice).

Between hosts MPI must not wander onto docker0, lo or an unrelated NIC (Open
MPI's daemons then fail to call back, or worse).  The preflight knows which
local address each SSH connection left from; the subnet of that address, in
CIDR form, is valid on every host of a flat cluster network even where the
interface names differ, so it makes a good `*_if_include` value.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _ioctl_address(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


def interface_subnets() -> dict[str, str]:
    """{interface name: 'a.b.c.d/len'} for the IPv4 interfaces of this machine."""
    subnets = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_address(sock, name, _SIOCGIFADDR)
            mask = _ioctl_address(sock, name, _SIOCGIFNETMASK)
            if address and mask:
                subnets[name] = str(ipaddress.IPv4Network(f"{address}/{mask}", strict=False))
    return subnets


def subnet_of(address: str) -> str | None:
    """The CIDR subnet of the local interface that owns `address`, if any."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    for subnet in interface_subnets().values():
        network = ipaddress.IPv4Network(subnet)
        if wanted in network and not network.is_loopback:
            return subnet
    return None


def source_address(host: str, port: int = 22) -> str | None:
    """Our address on the route to `host` (a UDP connect: the kernel picks the route, nothing is sent)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)
            return sock.getsockname()[0]
    except (OSError, IndexError):
        return None
