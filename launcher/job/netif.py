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
from typing import Mapping, Sequence

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _ioctl_address(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


def interface_subnets() -> dict[str, str]:
    """{interface name: 'a.b.c.d/len'}: the IPv4 subnet of each interface of this machine."""
    return {name: str(ipaddress.IPv4Interface(address).network) for name, address in interface_addresses().items()}


def interface_addresses() -> dict[str, str]:
    """{interface name: 'a.b.c.d/len'}: this machine's IPv4 address on each interface."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_address(sock, name, _SIOCGIFADDR)
            mask = _ioctl_address(sock, name, _SIOCGIFNETMASK)
            if address and mask:
                found[name] = str(ipaddress.IPv4Interface(f"{address}/{mask}"))
    return found


def choose_interface(addresses: dict[str, str], networks: Sequence[str]) -> tuple[str, str] | None:
    """(interface name, address) of `addresses` (as interface_addresses gives them) on the
    first of `networks` (interface names or CIDR subnets) that has one; None if none matches."""
    for network in networks:
        if "/" in network:
            try:
                wanted = ipaddress.IPv4Network(network, strict=False)
            except ValueError:
                continue
            for name, interface in addresses.items():
                if ipaddress.IPv4Interface(interface).ip in wanted:
                    return name, str(ipaddress.IPv4Interface(interface).ip)
        elif network in addresses:
            return network, str(ipaddress.IPv4Interface(addresses[network]).ip)
    return None


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on this machine now (held together while chosen)."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


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


def shared_subnets(hosts: Sequence[Mapping[str, str]], skip: Sequence[str] = ()) -> tuple[str, ...]:
    """The IPv4 subnets on which every one of `hosts` (each as interface_addresses gives them)
    has an address, sorted; loopback, link-local and the interfaces named in `skip` aside.
    Hosts reached through a scheduler have no connection of ours to tell the network by."""
    common: set[str] | None = None
    for addresses in hosts:
        subnets = set()
        for name, address in addresses.items():
            network = ipaddress.IPv4Interface(address).network
            if name not in skip and not network.is_loopback and not network.is_link_local:
                subnets.add(str(network))
        common = subnets if common is None else common & subnets
    return tuple(sorted(common or ()))
