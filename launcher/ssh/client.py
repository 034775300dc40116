"""SSH over paramiko: resolve a host like OpenSSH would, verify its key, run commands.

The only module that imports paramiko.  Host keys are checked against
~/.ssh/known_hosts (and /etc/ssh/ssh_known_hosts); an unknown key is refused
unless the user asked for `--ssh-accept-new-hosts`, and a changed key is
always refused, like OpenSSH's `StrictHostKeyChecking accept-new`.
"""
from __future__ import annotations

import dataclasses
import fcntl
import importlib
import logging
import os
import socket
import sys
import threading
import types
from typing import Any, Callable


class _DeferredInvoke(types.ModuleType):
    """Stands in for `invoke`, which paramiko imports at start-up (a third of its import
    time, paid again by every SSH agent) but uses only to run ssh_config `Match exec`
    lines: the real module is imported the first time paramiko touches it."""

    def __getattr__(self, name: str) -> Any:
        if sys.modules.get("invoke") is self:
            del sys.modules["invoke"]
        try:
            real = importlib.import_module("invoke")
        except ImportError:
            raise AttributeError(name) from None
        self.__dict__.update(real.__dict__)
        return getattr(real, name)


class _VersionOnlyMetadata(types.ModuleType):
    """Stands in for `importlib.metadata` while paramiko is imported: its __init__ reads only
    its own version there, and the real module costs ~20 ms (email, zipfile, csv, a scan of
    sys.path) of every launch. The version comes from paramiko's dist-info folder name; any
    other use, or a layout without that folder, gets the real module."""

    def version(self, name: str) -> str:
        for entry in sys.path:
            try:
                if os.path.isdir(os.path.join(entry or ".", name)):
                    found = [f for f in os.listdir(entry or ".")
                             if f.startswith(f"{name}-") and f.endswith(".dist-info")]
                    if len(found) == 1:
                        return found[0][len(name) + 1:-len(".dist-info")]
                    break
            except OSError:
                continue
        return self._real().version(name)

    def _real(self) -> Any:
        _restore_metadata(self)
        return importlib.import_module("importlib.metadata")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)


def _restore_metadata(stand_in: types.ModuleType) -> None:
    if sys.modules.get("importlib.metadata") is stand_in:
        del sys.modules["importlib.metadata"]
    if getattr(importlib, "metadata", None) is stand_in:
        del importlib.metadata


if "invoke" not in sys.modules:
    sys.modules["invoke"] = _DeferredInvoke("invoke")
_metadata = None
if "importlib.metadata" not in sys.modules and "paramiko" not in sys.modules:
    _metadata = sys.modules["importlib.metadata"] = _VersionOnlyMetadata("importlib.metadata")
    importlib.metadata = _metadata  # type: ignore[attr-defined]  # `from importlib import metadata`
try:
    import paramiko  # noqa: E402
finally:
    if _metadata is not None:
        _restore_metadata(_metadata)

from mtrain.launcher.cli.config import SshOptions

# paramiko logs transport errors (a socket closed under its reader thread, say) that our own
# messages already explain; without a handler Python would print them bare on stderr.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
# A dead link must end the job in bounded time: unacknowledged data (our
# heartbeats) aborts the TCP connection after this many milliseconds.
TCP_USER_TIMEOUT_MS = 6000


class SshError(Exception):
    """Reaching or using a host failed; str() is one actionable line naming the host."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"host {host}: {message}")
        self.host = host


@dataclasses.dataclass(frozen=True)
class SshTarget:
    """Where an alias really points, after ~/.ssh/config and command-line flags."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts_files: tuple[str, ...]


def _user_path(path: str) -> str:
    return os.path.expanduser(path)


_parsed_configs: dict[tuple[str, int, int], paramiko.SSHConfig] = {}
_parsed_lock = threading.Lock()


def _ssh_config(path: str) -> paramiko.SSHConfig | None:
    """~/.ssh/config parsed once per launch (and again only if the file changes)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    key = (path, info.st_mtime_ns, info.st_size)
    with _parsed_lock:
        parsed = _parsed_configs.get(key)
        if parsed is None:
            parsed = _parsed_configs[key] = paramiko.SSHConfig.from_path(path)
        return parsed


def resolve(alias: str, options: SshOptions) -> SshTarget:
    """Apply ~/.ssh/config to `alias`; command-line flags win, as with OpenSSH."""
    config_path = _user_path("~/.ssh/config")
    found: dict[str, Any] = {}
    try:
        parsed = _ssh_config(config_path)
        if parsed is not None:
            found = parsed.lookup(alias)
    except Exception as error:  # paramiko raises several types for a bad config
        raise SshError(alias, f"cannot read {config_path}: {error}") from None
    try:
        port = options.port or int(found.get("port", 22))
    except ValueError:
        raise SshError(alias, f"{config_path}: Port {found.get('port')!r} is not a number") from None
    user = found.get("user") or _local_user()
    if options.identity_file:
        identities = (_user_path(options.identity_file),)
        identities_only = True  # the user named a key: use that one (and the agent's)
    else:
        identities = tuple(_user_path(p) for p in found.get("identityfile", []))
        identities_only = str(found.get("identitiesonly", "no")).lower() == "yes"
    known = [_user_path(p) for p in str(found.get("userknownhostsfile", "~/.ssh/known_hosts")).split()]
    if os.path.exists(SYSTEM_KNOWN_HOSTS):
        known.append(SYSTEM_KNOWN_HOSTS)
    return SshTarget(alias, found.get("hostname", alias), port, user, identities,
                     identities_only, tuple(known))


def _local_user() -> str:
    import getpass
    return getpass.getuser()


def known_hosts_name(target: SshTarget) -> str:
    """The name OpenSSH files this host's key under."""
    return target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"


class _UnknownKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("unknown host key")
        self.key = key


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key) -> None:  # noqa: D102
        raise _UnknownKey(key)


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Record a first-seen key in the user's known_hosts (never replaces a known one)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: D102
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        # Several preflight threads may append at once; lock so lines never interleave.
        with open(self.path, "a", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _open_socket(target: SshTarget, timeout: float) -> socket.socket:
    try:
        infos = socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise SshError(target.alias, f"unknown host name {target.hostname!r} "
                       "(check the spelling, DNS, or a Host entry in ~/.ssh/config)") from None
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError as error:
            sock.close()
            last = error
            continue
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
        return sock
    if isinstance(last, socket.timeout) or (last is not None and "timed out" in str(last)):
        reason = f"no answer within {timeout:g} s"
    else:
        reason = getattr(last, "strerror", None) or str(last)
    raise SshError(target.alias, f"cannot reach {target.hostname}:{target.port} ({reason}); "
                   "is the host up and sshd running?")


def connect(alias: str, options: SshOptions, timeout: float | None = None) -> paramiko.SSHClient:
    """An authenticated SSH client for `alias`, or SshError with one actionable line."""
    timeout = options.connect_timeout if timeout is None else timeout
    target = resolve(alias, options)
    for path in target.identity_files:
        if options.identity_file and not os.path.exists(path):
            raise SshError(alias, f"identity file {path} does not exist")
    client = paramiko.SSHClient()
    for path in target.known_hosts_files:
        if os.path.exists(path):
            try:
                client.load_host_keys(path) if path != SYSTEM_KNOWN_HOSTS else client.load_system_host_keys(path)
            except (OSError, paramiko.SSHException) as error:
                raise SshError(alias, f"cannot read {path}: {error}") from None
    client.set_missing_host_key_policy(
        _AcceptNew(target.known_hosts_files[0]) if options.accept_new_hosts else _RefuseUnknown())
    sock = _open_socket(target, timeout)
    try:
        client.connect(
            target.hostname, port=target.port, username=target.user, sock=sock,
            key_filename=list(target.identity_files) or None,
            look_for_keys=not target.identities_only, allow_agent=True,
            timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
        )
    except _UnknownKey as unknown:
        sock.close()
        name = known_hosts_name(target)
        port_flag = f" -p {target.port}" if target.port != 22 else ""
        raise SshError(alias, f"unknown host key ({unknown.key.get_name()} "
                       f"{unknown.key.fingerprint}); if you trust it, run "
                       f"`ssh-keyscan{port_flag} {target.hostname} >> ~/.ssh/known_hosts` "
                       f"or pass --ssh-accept-new-hosts (looked up as {name})") from None
    except paramiko.BadHostKeyException:
        sock.close()
        raise SshError(alias, "host key CHANGED since it was recorded in known_hosts (possible "
                       "man-in-the-middle); if the host was reinstalled, run "
                       f"`ssh-keygen -R {known_hosts_name(target)}` and accept the new key") from None
    except paramiko.PasswordRequiredException:
        sock.close()
        raise SshError(alias, "the identity file is passphrase-protected; load it into "
                       "ssh-agent (`ssh-add`) first") from None
    except paramiko.AuthenticationException:
        sock.close()
        which = ", ".join(target.identity_files) or "ssh-agent and default keys"
        raise SshError(alias, f"authentication as {target.user} refused (tried {which}); "
                       "check -i / IdentityFile and the host's authorized_keys") from None
    except (paramiko.SSHException, OSError, EOFError) as error:
        sock.close()
        raise SshError(alias, f"SSH handshake failed: {error or type(error).__name__}") from None
    return client


def start_command(client: paramiko.SSHClient, command: str, timeout: float,
                  answered: Callable[[str], bool]) -> tuple[paramiko.Channel, int | None, str, str]:
    """Start a shell command string and read its stdout until `answered(stdout so far)`.

    (channel, None, stdout, "") with the command still running and the channel open (the
    caller owns it), or, if the command ended first, (closed channel, exit status, stdout,
    stderr).  Bounded by `timeout`.
    """
    channel = client.get_transport().open_session(timeout=timeout)
    try:
        channel.settimeout(timeout)
        channel.exec_command(command)
        out, was_answered = _read_to_end(channel.recv, answered)
        if was_answered:
            channel.settimeout(None)  # from here on its reader waits as long as the job runs
            return channel, None, out.decode(errors="replace"), ""
        channel.shutdown_write()
        err, _ = _read_to_end(channel.recv_stderr)
        if not channel.status_event.wait(timeout):
            raise socket.timeout()
        status = channel.recv_exit_status()
    except socket.timeout:
        channel.close()
        raise TimeoutError(f"command did not finish within {timeout:g} s") from None
    except BaseException:
        channel.close()
        raise
    channel.close()
    return channel, status, out.decode(errors="replace"), err.decode(errors="replace")


def _read_to_end(recv: Any, answered: "Callable[[str], bool] | None" = None) -> "tuple[bytearray, bool]":
    """Everything a channel stream gives until its end (``recv`` is channel.recv or recv_stderr),
    or until ``answered(all so far)`` is true after a chunk with a line end in it: (what was
    read, whether it was answered)."""
    got = bytearray()
    while True:
        data = recv(65536)
        if not data:
            return got, False
        got += data
        if answered is not None and b"\n" in data and answered(got.decode(errors="replace")):
            return got, True


def run_command(client: paramiko.SSHClient, command: str, timeout: float) -> tuple[int, str, str]:
    """Run a shell command string; (exit status, stdout, stderr).  Bounded by `timeout`."""
    channel = client.get_transport().open_session(timeout=timeout)
    channel.settimeout(timeout)
    channel.exec_command(command)
    channel.shutdown_write()
    try:
        out, _ = _read_to_end(channel.recv)
        err, _ = _read_to_end(channel.recv_stderr)
        if not channel.status_event.wait(timeout):
            raise socket.timeout()
        status = channel.recv_exit_status()
    except socket.timeout:
        raise TimeoutError(f"command did not finish within {timeout:g} s") from None
    finally:
        channel.close()
    return status, out.decode(errors="replace"), err.decode(errors="replace")
