"""Batched UDP I/O: GSO for sending, GRO for receiving, plain sendto/recv as the fallback.

Python pays roughly a microsecond per system call and more per object, so one datagram per call
caps a process at about 200 k packets/s. Linux can do the batching for us:

- UDP GSO (setsockopt or cmsg SOL_UDP/UDP_SEGMENT): one sendmsg hands the kernel a buffer of up
  to 64 segments; it goes out as that many datagrams, each a complete UDP datagram of its own
  (our SwitchML header is part of every segment, so the receiver sees ordinary packets).
- UDP GRO (setsockopt SOL_UDP/UDP_GRO): the kernel hands a socket several datagrams of one flow
  and one size in one buffer, with their size in a cmsg; we split it again.

Both are optional in the kernel and per path (GSO refuses a segment larger than the route's MTU),
so every use falls back to one datagram per call, for good, at the first refusal.

GRO only coalesces what reaches the socket through a GRO-capable receive path; results that a
bridge floods to a veth, for one, arrive one skb per datagram (see RowReceiver). So receiving
also batches system calls: recvmmsg(2), through ctypes, fetches up to 32 messages -- single
datagrams or GRO buffers -- in one call, straight into a reusable buffer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import struct
import sys
from collections.abc import Callable, Iterator

import numpy as np

SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)

MAX_GSO_SEGMENTS = 64  # UDP_MAX_SEGMENTS of older kernels (newer ones allow 128)
MAX_GSO_BYTES = 65507 - 8  # a GSO buffer is one IPv4 datagram's worth of UDP payload, at most
RECV_CHUNK = 65536 + 4096  # room one recvmsg needs: a GRO buffer is at most one 64 KiB datagram
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4)

# errors on which GSO is given up for plain datagrams (not supported, or segment > MTU)
_GSO_REFUSED = {errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EMSGSIZE}
# errors after which the datagrams are simply lost: the sender's timers recover them
_TRANSIENT = {
    errno.EAGAIN,
    errno.ENOBUFS,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    errno.ECONNREFUSED,
    errno.EPERM,  # a firewall rule
}


class DatagramSocket:
    """A non-blocking UDP socket that sends and receives batches of datagrams.

    `bind` is the (address, port) to bind; port 0 picks a free one. `rcvbuf`/`sndbuf` are asked
    for with SO_RCVBUFFORCE first (root can exceed net.core.rmem_max), else SO_RCVBUF.
    """

    def __init__(
        self,
        bind: tuple[str, int],
        *,
        gso: bool = True,
        gro: bool = True,
        rcvbuf: int = 8 << 20,
        sndbuf: int = 4 << 20,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind(bind)
        except OSError as e:
            self.sock.close()
            raise OSError(e.errno, f"cannot bind UDP {bind[0]}:{bind[1]}: {e.strerror}") from None
        self.sock.setblocking(False)
        _set_buffer(self.sock, socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", 33), rcvbuf)
        _set_buffer(self.sock, socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", 32), sndbuf)
        self.gso = gso
        self.gro = False
        if gro:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)
        self.send_calls = 0
        self.recv_calls = 0
        self.send_errors = 0
        self.last_send_error: OSError | None = None

    # --- plumbing ---------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def wait_readable(self, timeout: float) -> bool:
        """Block until a datagram is waiting or `timeout` seconds passed."""
        return bool(self._poll.poll(max(0, int(timeout * 1000 + 0.999))))

    def receive_drops(self) -> int | None:
        """Datagrams the kernel dropped for this socket since it was opened (its receive buffer
        was full, or the datagram was malformed): the `drops` column of /proc/net/udp for this
        socket's inode, which the process's own network namespace shows. None if unreadable."""
        try:
            inode = str(os.fstat(self.sock.fileno()).st_ino)
            with open("/proc/self/net/udp") as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if len(cols) >= 13 and cols[9] == inode:
                        return int(cols[12])
        except (OSError, ValueError):
            pass
        return None

    def ensure_buffers(self, rcvbuf: int, sndbuf: int) -> None:
        """Grow the socket's receive/send buffers to at least these sizes (never shrink them).

        Linux reports twice what was asked (the bookkeeping share), so what getsockopt says is
        compared against twice the wish.
        """
        for opt, force, size in (
            (socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", 33), rcvbuf),
            (socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", 32), sndbuf),
        ):
            if self.sock.getsockopt(socket.SOL_SOCKET, opt) < 2 * size:
                _set_buffer(self.sock, opt, force, size)

    # --- sending ----------------------------------------------------------------------------
    def send_rows(self, rows: np.ndarray, addr: tuple[str, int]) -> int:
        """Send each row of an (m, plen) uint8 array as one datagram to `addr`.

        Returns the number of datagrams handed to the kernel. Datagrams the kernel refuses
        (full buffer, no route) are counted in send_errors and left to the caller's timers.
        """
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        m, plen = rows.shape
        if m == 0:
            return 0
        per_call = min(MAX_GSO_SEGMENTS, max(1, MAX_GSO_BYTES // plen)) if self.gso else 1
        sent = 0
        for i in range(0, m, per_call):
            block = rows[i : i + per_call]
            if self._send_block(block.data.cast("B"), len(block), plen, addr):
                sent += len(block)
        return sent

    def _send_block(self, buf: memoryview, count: int, plen: int, addr: tuple[str, int]) -> bool:
        if count == 1:
            return self._send_plain(buf, addr)
        if not self.gso:
            ok = True
            for j in range(count):
                ok &= self._send_plain(buf[j * plen : (j + 1) * plen], addr)
            return ok
        cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", plen))]
        return self._one_send(
            lambda: self.sock.sendmsg([buf], cmsg, 0, addr),
            gso_refused=lambda: self._send_block(buf, count, plen, addr),
        )

    def _send_plain(self, data: memoryview, addr: tuple[str, int]) -> bool:
        return self._one_send(lambda: self.sock.sendto(data, addr))

    def _one_send(
        self, send: Callable[[], object], gso_refused: Callable[[], bool] | None = None
    ) -> bool:
        """One send system call; on a full buffer wait once for room and retry; transient errors
        count as refused (the packet's timer resends it). `gso_refused`, for a GSO send: what to do
        once the kernel or the path refuses GSO (it is turned off for good)."""
        for attempt in range(2):
            try:
                self.send_calls += 1
                send()
                return True
            except BlockingIOError:
                if attempt == 0 and self._wait_writable(0.02):
                    continue
                return self._refused(OSError(errno.EAGAIN, "send buffer full"))
            except OSError as e:
                if gso_refused is not None and e.errno in _GSO_REFUSED:
                    self.gso = False  # for good: the path or the kernel cannot do it
                    return gso_refused()
                if e.errno in _TRANSIENT:
                    return self._refused(e)
                raise
        return False

    def _refused(self, e: OSError) -> bool:
        self.send_errors += 1
        self.last_send_error = e
        return False

    def _wait_writable(self, timeout: float) -> bool:
        p = select.poll()
        p.register(self.sock.fileno(), select.POLLOUT)
        return bool(p.poll(int(timeout * 1000)))

    # --- receiving --------------------------------------------------------------------------
    def recv_into(self, buf: memoryview) -> tuple[int, int, tuple[str, int]] | None:
        """One recvmsg into `buf` (which should hold RECV_CHUNK bytes).

        Returns (nbytes, segment size, source address), the segment size being the GRO size
        of a coalesced buffer or nbytes for a single datagram; None when nothing is waiting.
        """
        try:
            self.recv_calls += 1
            n, anc, _flags, addr = self.sock.recvmsg_into([buf], _GRO_CMSG_SPACE)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in _TRANSIENT:  # an ICMP error queued on the socket: not data
                return None
            raise
        seg = n
        for level, kind, data in anc:
            if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
                seg = struct.unpack("=i", data[:4])[0]
        return n, seg, addr

    def recv_datagrams(self, max_calls: int = 64) -> Iterator[tuple[bytes, tuple[str, int]]]:
        """Drain up to `max_calls` recvmsg calls; yields (datagram bytes, source address)."""
        buf = bytearray(RECV_CHUNK)
        mv = memoryview(buf)
        for _ in range(max_calls):
            got = self.recv_into(mv)
            if got is None:
                return
            n, seg, addr = got
            seg = seg or n
            for off in range(0, n, seg):
                yield bytes(mv[off : min(off + seg, n)]), addr


class RowReceiver:
    """Receives datagrams of one fixed length into rows of a reusable buffer.

    Datagrams of any other length are not ours (or are damaged) and are counted in `malformed`.

    On Linux one drain() is one recvmmsg(2) call for up to `batch` messages. Each message gets a
    slot that holds a whole GRO buffer when the socket has UDP_GRO (else one row), and the rows
    come back as a view: contiguous rows without GRO, rows 64 KiB apart when every message was a
    single datagram, gathered into a scratch buffer when some were coalesced. Elsewhere (or if
    libc has no recvmmsg) it falls back to one recvmsg per message.
    """

    def __init__(self, sock: DatagramSocket, plen: int, max_rows: int, batch: int = 32) -> None:
        self.sock = sock
        self.plen = plen
        self.rows = max(max_rows, 1)
        self.malformed = 0
        self.bytes = 0
        self._mm = _MMsg(sock, plen, self.rows, batch) if _HAVE_MMSG else None
        if self._mm is None:
            # room for max_rows rows plus one whole recv chunk past the last full row
            self._buf = np.empty(self.rows * plen + RECV_CHUNK, dtype=np.uint8)
            self._mv = self._buf.data
        self.empty = np.empty((0, plen), dtype=np.uint8)

    def drain(self, max_calls: int = 256) -> np.ndarray:
        """What is waiting now (non-blocking), as an (m, plen) view valid until the next call."""
        if self._mm is not None:
            return self._drain_mmsg(self._mm)
        plen, pos = self.plen, 0
        for _ in range(max_calls):
            if pos >= self.rows:
                break
            got = self.sock.recv_into(self._mv[pos * plen :])
            if got is None:
                break
            n, seg, _addr = got
            self.bytes += n
            # seg is the GRO segment size (n for a single datagram); a coalesced buffer may end
            # with one shorter datagram: keep the full rows, count the rest
            full = n // plen if seg == plen else 0
            if full * plen != n:
                self.malformed += 1
            pos += full
        return self._buf[: pos * plen].reshape(pos, plen)

    def _drain_mmsg(self, mm: _MMsg) -> np.ndarray:
        plen = self.plen
        m = mm.receive(self.sock)
        if m <= 0:
            return mm.empty
        lens = mm.hdr["len"][:m]
        if not mm.gro:
            rows = mm.rows[:m]
            bad = (lens != plen) | ((mm.hdr["flags"][:m] & _MSG_TRUNC) != 0)
            self.bytes += int(lens.sum())
            if not np.count_nonzero(bad):
                return rows
            self.malformed += int(np.count_nonzero(bad))
            return rows[~bad]
        if not np.count_nonzero(mm.ctrl_len[:m]) and not np.count_nonzero(lens != plen):
            # no GRO control message: nothing was coalesced, one row per slot
            self.bytes += m * plen
            return mm.rows[:m]
        self.bytes += int(lens.sum())
        segs = np.where(mm.cmsg_ok(m), mm.ctrl[:m, 4], lens)  # GRO segment size, else the length
        # some messages hold several datagrams: gather the full rows of each into the scratch
        out, pos = mm.scratch, 0
        for i in range(m):
            n, seg = int(lens[i]), int(segs[i])
            full = n // plen if seg == plen else 0
            if full * plen != n:
                self.malformed += 1
            full = min(full, len(out) - pos)
            if full:
                out[pos : pos + full] = mm.slots[i, : full * plen].reshape(full, plen)
                pos += full
        return out[:pos]


# --- recvmmsg through ctypes (Linux) ---------------------------------------------------------
_MSG_DONTWAIT, _MSG_TRUNC = 0x40, 0x20
# struct mmsghdr on LP64 Linux: struct msghdr (56 bytes) then unsigned msg_len, padded to 64
_MMSGHDR = np.dtype(
    [
        ("name", "<u8"),
        ("namelen", "<u4"),
        ("pad0", "<u4"),
        ("iov", "<u8"),
        ("iovlen", "<u8"),
        ("control", "<u8"),
        ("controllen", "<u8"),
        ("flags", "<i4"),
        ("pad1", "<u4"),
        ("len", "<u4"),
        ("pad2", "<u4"),
    ]
)
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
_CTRL_WORDS = _GRO_CMSG_SPACE // 4  # per message: cmsg_len (8), level (4), type (4), data (4+pad)


def _load_recvmmsg() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_recvmmsg = _load_recvmmsg()
_HAVE_MMSG = _recvmmsg is not None and _MMSGHDR.itemsize == 64 and _CTRL_WORDS == 6


class _MMsg:
    """The buffers and headers of one recvmmsg receiver (kept alive as long as it is)."""

    def __init__(self, sock: DatagramSocket, plen: int, max_rows: int, batch: int) -> None:
        if _recvmmsg is None:
            raise OSError(errno.ENOSYS, "recvmmsg is not available from libc here")
        self._recvmmsg = _recvmmsg
        self.gro = sock.gro
        self.slot = RECV_CHUNK if self.gro else plen
        # without GRO every message is one row: take as many as the caller wants at once
        self.count = max(1, min(batch, max_rows)) if self.gro else max_rows
        self.buf = np.zeros(self.count * self.slot, dtype=np.uint8)
        self.slots = self.buf.reshape(self.count, self.slot)
        self.rows = self.slots[:, :plen]  # one row per message (strided when slot > plen)
        self.empty = self.rows[:0]
        # where coalesced messages are gathered (GRO only: without it a message is one row)
        self.scratch = np.empty((max_rows if self.gro else 0, plen), dtype=np.uint8)
        self.iov = np.zeros(self.count, dtype=_IOVEC)
        self.iov["base"] = self.buf.ctypes.data + self.slot * np.arange(self.count, dtype=np.uint64)
        self.iov["len"] = self.slot
        self.ctrl = np.zeros((self.count, _CTRL_WORDS), dtype=np.int32)
        self.hdr = np.zeros(self.count, dtype=_MMSGHDR)
        self.hdr["iov"] = self.iov.ctypes.data + _IOVEC.itemsize * np.arange(
            self.count, dtype=np.uint64
        )
        self.hdr["iovlen"] = 1
        if self.gro:
            self.hdr["control"] = self.ctrl.ctypes.data + _GRO_CMSG_SPACE * np.arange(
                self.count, dtype=np.uint64
            )
        self.ctrl_len = self.hdr["controllen"]
        self.hdr_addr: int = self.hdr.ctypes.data

    def receive(self, sock: DatagramSocket) -> int:
        """One recvmmsg: the number of messages received (0 when none was waiting)."""
        if self.gro:
            self.ctrl_len[:] = _GRO_CMSG_SPACE  # the kernel writes back what it used
        sock.recv_calls += 1
        m = self._recvmmsg(sock.fileno(), self.hdr_addr, self.count, _MSG_DONTWAIT, None)
        if m < 0:
            e = ctypes.get_errno()
            if e in (errno.EAGAIN, errno.EINTR) or e in _TRANSIENT:  # nothing, or an ICMP error
                return 0
            raise OSError(e, f"recvmmsg: {errno.errorcode.get(e, e)}")
        return m

    def cmsg_ok(self, m: int) -> np.ndarray:
        """Which of the first m messages carry a UDP_GRO control message."""
        c = self.ctrl[:m]
        return (
            (self.ctrl_len[:m] >= socket.CMSG_LEN(4)) & (c[:, 2] == SOL_UDP) & (c[:, 3] == UDP_GRO)
        )


def _set_buffer(sock: socket.socket, opt: int, force_opt: int, size: int) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_opt, size)
        return
    except OSError:
        pass
    try:
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
    except OSError:
        pass
