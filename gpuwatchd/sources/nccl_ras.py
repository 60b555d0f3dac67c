"""NCCL's RAS port: which process listens on it, and one bounded ``STATUS`` query in JSON.

NCCL 2.24 and later run one RAS thread per process, each listening on ``NCCL_RAS_ADDR``
(``localhost:28028`` by default) with SO_REUSEPORT, so every NCCL process of a user on the node
shares the port and a connection reaches one of them. The kernel lets only processes of one uid
share a port; another user can still bind it first. So before a byte is sent, every listening
socket on the port in the rank's network namespace (``/proc/PID/net/tcp`` and ``tcp6``, state
``0A``) must be a socket of a rank of the job (its inode among the ``socket:[N]`` links of that
rank's ``/proc/PID/fd``): a squatted or shared port is refused, never asked.

The protocol is NCCL's own client's (``src/ras/client.cc`` in NVIDIA/nccl):
``CLIENT PROTOCOL 2`` -> ``SERVER PROTOCOL <n>``, ``TIMEOUT <s>`` -> ``OK``, ``SET FORMAT json``
-> ``OK`` (NCCL 2.28 and later; 2.24-2.27 answer ``ERROR: Unknown command``, and their
``STATUS`` is text, returned as a ``str`` of printable ASCII for join/ras_text.py), ``STATUS`` ->
the JSON document, then the server closes. One connection per
query, closed at the end; a connect and total deadline (``timeout``), and at most ``max_bytes``
read; the JSON is decoded with the flight recorder's bounds (nesting, number size).

Reads: the listeners on the port by sock_diag(7) where the rank shares the daemon's network
namespace (else the rank's ``net/tcp{,6}``), and its ``fd`` links until the listeners are found. Privilege: the
``fd`` links of other users' processes need CAP_DAC_READ_SEARCH (the daemon's unit has it).
Shell equivalent: ``ncclras -f json -t 1``, after ``ss -ltnp sport = :28028``.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.sources.flight_recorder_files import loads_answer

DEFAULT_PORT = 28028  # NCCL_RAS_CLIENT_PORT (src/ras/ras_internal.h)
PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL, unchanged from 2.24 to 2.30
MAX_ANSWER_BYTES = 1 << 20  # 64 ranks answer about 45 KB; 1,024 about 700 KB
MAX_LINE_BYTES = 4096  # a handshake line (the server's own buffer is 4096)
MAX_NET_BYTES = 8 << 20  # net/tcp of a namespace with about 50,000 sockets
MAX_FDS_SCANNED = 16384  # per process: NCCL opens its RAS socket at init, among the first fds
_LISTEN = "0A"
# NCCL 2.28.7-2.28.9 print a missing rank with no comma after "nvml_dev" (src/ras/client_support.cc
# ``jsonWriteMissingRank``: ``"nvml_dev": %d\n`` then ``"status": {``; 2.29.2 adds the comma), so
# every answer that names a missing rank, the one that matters most, is not JSON as printed. The
# comma is put back there only: the pattern is bounded (one line, the digits of an int).
_NO_COMMA = re.compile(rb'("nvml_dev": -?[0-9]{1,11})(\r?\n[ ]{0,32}"status": \{)')


class RasRefused(Exception):
    """The port was not asked, or its answer not kept; the message says why in a few words."""


@dataclass(frozen=True)
class Listener:
    address: str  # the bound address, e.g. "127.0.0.1", "0.0.0.0", "::1"
    port: int
    inode: int


def ras_address(value: str | None) -> tuple[str, int]:
    """``NCCL_RAS_ADDR`` (``host:port``, ``[v6]:port``) as (address, port); ValueError for no
    port. NCCL resolves a host name (``ncclSocketGetAddrFromString``: getaddrinfo, the first
    answer); the daemon does no name lookup in its cycle and needs none: the listeners on the port
    (``owned_listener``) say where to connect, so a name is returned as written."""
    if not value:
        return "127.0.0.1", DEFAULT_PORT
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"NCCL_RAS_ADDR {value[:64]!r} is not host:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"NCCL_RAS_ADDR port {port} is out of range")
    host = host.strip("[]")
    if host == "localhost":
        return "127.0.0.1", port
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return host[:253], port


def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp{,6}: host-order 32-bit words in hex."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(net_dir: str, port: int) -> list[Listener]:
    """The listening TCP sockets on ``port`` in ``net_dir`` (``/proc/PID/net``)."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(net_dir, name), "rb") as f:
                raw = f.read(MAX_NET_BYTES)
        except FileNotFoundError:
            continue
        for line in raw.split(b"\n")[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _LISTEN.encode():
                continue
            addr, _, port_hex = cols[1].decode("ascii", "replace").partition(":")
            try:
                if int(port_hex, 16) != port:
                    continue
                out.append(Listener(_hex_address(addr), port, int(cols[9])))
            except ValueError:
                continue
    return out


# sock_diag(7): the listening TCP sockets on one port, from the kernel's listening hash alone.
# /proc/PID/net/tcp and tcp6 walk every bucket of the established hash on each read (5.5 ms for
# both on the 2-core VM with 200 sockets; the table grows with the host's memory), every time a
# stalled job is asked; the dump filtered to TCP_LISTEN and the port walks the listeners only.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300  # NLM_F_REQUEST | NLM_F_DUMP
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCPF_LISTEN = 1 << 10
_NO_COOKIE = 0xFFFFFFFF
_DIAG_MAX_MESSAGES = 1 << 16  # a port shared by many processes (SO_REUSEPORT): bounded


def diag_listeners(port: int) -> list[Listener] | None:
    """The listening TCP sockets on ``port`` in the calling process's network namespace, by
    sock_diag (``ss -ltn sport = :PORT``); None where netlink is refused (a seccomp filter, a
    kernel without inet_diag): the caller reads ``/proc/PID/net`` then."""
    out: list[Listener] = []
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    except OSError:
        return None
    with sock:
        sock.settimeout(1.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            sockid = struct.pack("!HH16s16s", port, 0, b"", b"") + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
            req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _TCPF_LISTEN) + sockid
            try:
                sock.sendto(
                    struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, seq, 0) + req,
                    (0, 0),
                )
                if not _diag_read(sock, seq, family, port, out):
                    return None
            except OSError:
                return None
    return out


def _diag_read(sock: socket.socket, seq: int, family: int, port: int, out: list[Listener]) -> bool:
    """One dump's answers into ``out``; False on an error answer or an unbounded one."""
    seen = 0
    while seen < _DIAG_MAX_MESSAGES:
        data = sock.recv(1 << 16)
        off = 0
        while off + 16 <= len(data):
            length, kind, _, got_seq, _ = struct.unpack_from("=IHHII", data, off)
            if length < 16:
                return False
            if got_seq == seq:
                if kind == _NLMSG_DONE:
                    return True
                if kind == _NLMSG_ERROR:
                    return False
                seen += 1
                if length >= 16 + 72:  # inet_diag_msg: family, state, .., sockid, .., inode
                    sport = struct.unpack_from("!H", data, off + 20)[0]
                    raw = data[off + 24 : off + 24 + (4 if family == socket.AF_INET else 16)]
                    inode = struct.unpack_from("=I", data, off + 16 + 68)[0]
                    if sport == port:
                        out.append(Listener(str(ipaddress.ip_address(raw)), port, inode))
            off += (length + 3) & ~3
    return False


def socket_inodes(fd_dir: str, wanted: set[int]) -> set[int]:
    """Which of ``wanted`` socket inodes ``fd_dir`` (``/proc/PID/fd``) holds, stopping once all
    are found or after ``MAX_FDS_SCANNED`` links."""
    found: set[int] = set()
    try:
        with os.scandir(fd_dir) as it:
            for n, entry in enumerate(it):
                if n >= MAX_FDS_SCANNED or found == wanted:
                    break
                try:
                    link = os.readlink(entry.path)
                except OSError:
                    continue
                if link.startswith("socket:[") and link.endswith("]"):
                    inode = int(link[8:-1]) if link[8:-1].isdigit() else -1
                    if inode in wanted:
                        found.add(inode)
    except OSError:
        pass
    return found


def owned_listener(proc: Any, pids: Iterable[int], port: int) -> tuple[str, int]:
    """(address to connect to, the rank PID whose socket it is) when every listener on ``port``
    in the namespace of the first readable rank of ``pids`` is a socket of one of ``pids``;
    RasRefused naming why not. ``proc(pid, *parts)`` builds a path under the procfs root."""
    pids = list(pids)
    self_ns = _netns(proc("self", "ns", "net"))
    for pid in pids:
        ns = _netns(proc(pid, "ns", "net"))
        if ns is None:
            continue
        if self_ns is not None and ns != self_ns:
            raise RasRefused("the ranks are in another network namespace")
        # the daemon's own namespace is the rank's: the kernel's listeners there, else /proc
        diag = diag_listeners(port) if self_ns is not None else None
        found = diag if diag is not None else listeners(proc(pid, "net"), port)
        break
    else:
        raise RasRefused("no rank's network namespace is readable")
    if not found:
        raise RasRefused(f"nothing listens on port {port}")
    wanted = {li.inode for li in found}
    owner: dict[int, int] = {}
    for pid in pids:
        for inode in socket_inodes(proc(pid, "fd"), wanted - set(owner)):
            owner[inode] = pid
        if len(owner) == len(wanted):
            break
    strangers = [li for li in found if li.inode not in owner]
    if strangers:
        raise RasRefused(
            f"port {port} has {len(strangers)} listener(s) that are not the job's ({strangers[0].address})"
        )
    first = found[0]
    address = first.address
    if ipaddress.ip_address(address).is_unspecified:
        address = "127.0.0.1" if ipaddress.ip_address(address).version == 4 else "::1"
    return address, owner[first.inode]


def _netns(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class _Conn:
    """One socket with a deadline for every read and write."""

    def __init__(self, address: str, port: int, deadline: float) -> None:
        self.deadline = deadline
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.buf = b""
        self._arm()
        self.sock.connect((address, port))

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasRefused("timed out")
        self.sock.settimeout(left)

    def send(self, line: str) -> None:
        self._arm()
        self.sock.sendall(line.encode("ascii"))

    def line(self) -> str:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE_BYTES:
                raise RasRefused("a handshake line longer than 4096 bytes")
            self._arm()
            chunk = self.sock.recv(MAX_LINE_BYTES)
            if not chunk:
                raise RasRefused("closed during the handshake")
            self.buf += chunk
        head, _, self.buf = self.buf.partition(b"\n")
        return head.decode("ascii", "replace").strip()

    def rest(self, max_bytes: int) -> bytes:
        parts = [self.buf]
        size = len(self.buf)
        while size <= max_bytes:
            self._arm()
            chunk = self.sock.recv(min(65536, max_bytes + 1 - size))
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            size += len(chunk)
        raise RasRefused(f"an answer larger than {max_bytes} bytes")


def query(
    address: str, port: int, timeout: float = 2.0, max_bytes: int = MAX_ANSWER_BYTES, leg_timeout: int = 1
) -> Any:
    """NCCL's ``STATUS`` in JSON from ``address:port``, decoded with bounds; RasRefused naming
    what went wrong (time-out, refused connection, not a RAS server, no JSON, too large, not
    JSON). ``leg_timeout``: seconds each RAS peer may take to answer the one asked."""
    deadline = time.monotonic() + timeout
    try:
        conn = _Conn(address, port, deadline)
    except RasRefused:
        raise
    except TimeoutError:
        raise RasRefused("timed out") from None
    except OSError as exc:
        raise RasRefused(f"connect: {exc.strerror or exc}") from None
    try:
        conn.send(f"CLIENT PROTOCOL {PROTOCOL}\n")
        if not conn.line().upper().startswith("SERVER PROTOCOL "):
            raise RasRefused("not an NCCL RAS server")
        conn.send(f"TIMEOUT {leg_timeout}\n")
        if conn.line().upper() != "OK":
            raise RasRefused("TIMEOUT refused")
        conn.send("SET FORMAT json\n")
        reply = conn.line().upper()
        if reply != "OK" and not reply.startswith("ERROR"):
            raise RasRefused("SET FORMAT json refused")
        conn.send("STATUS\n")
        raw = conn.rest(max_bytes)
    except TimeoutError:
        raise RasRefused("timed out") from None
    except OSError as exc:
        raise RasRefused(f"socket: {exc.strerror or exc}") from None
    finally:
        conn.sock.close()
    if reply != "OK":  # NCCL 2.24-2.27: "ERROR: Unknown command", and STATUS answers text
        text = raw.decode("utf-8", "replace")
        if not text.isascii() or any(not (c.isprintable() or c in "\n\r\t") for c in text):
            raise RasRefused("a text answer that is not printable ASCII")
        return text
    try:
        return decode_status(raw, max_bytes)
    except ValueError as exc:
        raise RasRefused(f"not JSON: {str(exc)[:80]}") from None


def decode_status(raw: bytes, max_bytes: int = MAX_ANSWER_BYTES) -> Any:
    """The ``STATUS`` document as NCCL printed it, decoded with the flight recorder's bounds;
    a missing rank of NCCL 2.28.7-2.28.9 (``_NO_COMMA``) is read as 2.29 prints it. ValueError."""
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    fixed = _NO_COMMA.sub(rb"\1,\2", raw)
    return loads_answer(fixed, max_bytes + len(fixed) - len(raw))


def local_addresses(proc: Any, pid: int) -> frozenset[str]:
    """The addresses of the rank's network namespace (``net/fib_trie`` LOCAL entries and
    ``net/if_inet6``): a RAS rank on one of them runs on this node."""
    out: set[str] = set()
    try:
        with open(proc(pid, "net", "fib_trie"), "rb") as f:
            lines = f.read(MAX_NET_BYTES).decode("ascii", "replace").splitlines()
        for prev, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                out.add(prev.strip().lstrip("|-+` ").strip())
    except OSError:
        pass
    try:
        with open(proc(pid, "net", "if_inet6"), "rb") as f:
            for line in f.read(MAX_NET_BYTES).decode("ascii", "replace").splitlines():
                cols = line.split()
                if cols and len(cols[0]) == 32:
                    out.add(str(ipaddress.ip_address(bytes.fromhex(cols[0]))))
    except (OSError, ValueError):
        pass
    return frozenset(out)


def env_address(environ: Mapping[str, str]) -> tuple[str, int]:
    """The rank's RAS address from its environment (``ras_address``)."""
    return ras_address(environ.get("NCCL_RAS_ADDR"))
