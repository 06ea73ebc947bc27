"""A shared-memory broadcast ring: one writer, N readers, every reader sees every message in order.

Each step's inputs go from the engine core (the writer) to the model workers (the readers) through
`num_slots` slots of one POSIX shared-memory segment. Message m (1, 2, ...) goes to slot (m-1) % num_slots.

Protocol, all in the segment's control area (int64 fields, one 64-byte line per slot and per reader so
that no two processes write the same cache line):
- The writer copies the payload into the slot, then stores the slot's length, then its sequence number m.
- A reader waits until the slot's sequence number is m, then reads the length and the payload. It
  acknowledges m (its `done` counter) when it calls read() again, so the memoryview read() returned stays
  valid until then, without a copy.
- The writer writes message m only when every reader's `done` is at least m - num_slots: it never
  overwrites a slot a reader is still reading, so a torn read cannot happen (no seqlock retry needed).
- A message larger than a slot goes to each reader over its ZeroMQ PUSH/PULL pipe (sent before the
  slot is published); the slot then holds the marker length -1, so the order is the slots' order.

Memory ordering: CPython stores an aligned int64 through `memoryview.cast("q")` with one 8-byte store,
so a sequence number is never torn. x86 keeps stores in order and loads in order, but may let a load
pass an earlier store; ARM reorders all four. `_Fence` is a full barrier between each pair of steps
above that must not be reordered (payload -> seq, seq -> payload, payload reads -> done, done ->
overwrite, and the sleep flag's store -> load in both directions).

Waiting: a reader spins on the sequence number for `spin_s` (tens of µs), then sets its `sleeping`
flag and blocks in zmq poll on its PULL socket; the writer sends an empty wake-up frame only to readers
whose flag is set, so a busy ring costs no syscalls and an idle one no CPU. A writer waiting for a slow
reader spins, then sleeps with a backoff capped at 1 ms. Both sides re-check every 100 ms whether the
other side's process is gone, so a dead peer gives a clear error instead of a hang.

Cleanup: the writer owns the segment and the runtime files; close() (or garbage collection, or normal
interpreter exit) unlinks them. Once every reader has attached, release_name() unlinks the segment's name
early, so nothing can leave it behind. Until then it is registered with multiprocessing's resource
tracker, which unlinks it if the writer is SIGKILLed; readers attach through /dev/shm without registering, so the
tracker never warns about a segment another process unlinked. No pickle: the spec is a msgspec Struct.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.shared_memory import SharedMemory

import msgspec
import zmq

_MAGIC = 0x50474452494E4701  # "PGDRING", layout version 1
_LINE = 8  # int64 fields per 64-byte control line
_BIG = -1  # slot length marker: the payload came over ZeroMQ
# Header line fields
_H_MAGIC, _H_SLOTS, _H_SLOT_BYTES, _H_READERS, _H_CLOSED = range(5)
# Slot line fields
_S_SEQ, _S_LEN = range(2)
# Reader line fields; state: what the writer's error messages say about a reader
_R_DONE, _R_SLEEPING, _R_PID, _R_STATE = range(4)
_DETACHED, _ATTACHED, _CLOSED = 0, 1, 2

_SPIN_S = 50e-6  # how long a waiting side spins before it blocks
_CHECK_PEER_S = 0.1  # how often a blocked side checks that the other side's process is alive
_WRITER_LINGER_MS = 1000  # how long close() lets ZeroMQ deliver payloads still queued to live readers


class RingSpec(msgspec.Struct, frozen=True):
    """Everything a reader process needs to attach (msgspec-encodable, so it can go to a spawned process)."""

    shm_name: str
    num_readers: int
    num_slots: int
    slot_bytes: int
    reader_addresses: tuple[str, ...]  # ipc:// endpoint each reader binds; the writer connects to all
    writer_pid: int


class RingPeerGone(RuntimeError):
    """The other end is gone: a reader that closed or died before reading what the writer needs, or the
    writer died."""


class RingClosed(EOFError):
    """The writer closed the ring, and every message it wrote has been read."""


class _Fence:
    """A full memory barrier from Python: release then acquire a lock this object holds.

    The lock's release is a release-RMW and its acquire an acquire-RMW (CPython's threading.Lock is a
    semaphore or a mutex over atomic compare-and-swap). On x86 each is a locked instruction, a full
    barrier; on ARMv8 a store-release followed by a load-acquire is ordered, so no access before the
    release moves past any access after the acquire. ~170 ns. Not thread-safe: one per ring end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def __call__(self) -> None:
        self._lock.release()
        self._lock.acquire()


def process_gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")


class _Layout:
    """Offsets in the segment: control lines (header, one per slot, one per reader), then the slots."""

    def __init__(self, num_readers: int, num_slots: int, slot_bytes: int):
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.control_bytes = (1 + num_slots + num_readers) * _LINE * 8
        self.slot_stride = -(-slot_bytes // 64) * 64
        self.total_bytes = self.control_bytes + num_slots * self.slot_stride

    def slot(self, s: int, field: int) -> int:
        return (1 + s) * _LINE + field

    def reader(self, r: int, field: int) -> int:
        return (1 + self.num_slots + r) * _LINE + field

    def views(self, buf: memoryview) -> tuple[memoryview, list[memoryview]]:
        control = buf[: self.control_bytes].cast("q")
        slots = [buf[self.control_bytes + s * self.slot_stride :][: self.slot_bytes] for s in range(self.num_slots)]
        return control, slots


def _release_all(views: list[memoryview]) -> None:
    for view in views:
        with contextlib.suppress(BufferError):  # a caller still holds a buffer from it
            view.release()


class _WriterResources:
    """What the writer must give back: closing sets the closed flag, closes the sockets, unlinks the
    segment and removes the readers' socket files (and the private runtime directory, if it made one)."""

    def __init__(self, shm: SharedMemory, ctx: zmq.Context, paths: list[str], own_dir: str | None):
        self.shm, self.ctx, self.paths, self.own_dir = shm, ctx, paths, own_dir
        self.views: list[memoryview] = []

    def close(self) -> None:
        self.ctx.destroy(linger=_WRITER_LINGER_MS)
        if self.views:
            self.views[0][_H_CLOSED] = 1  # readers see it within _CHECK_PEER_S, after the last payload
        _release_all(self.views)
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()
        with contextlib.suppress(BufferError):  # a view is still held somewhere: unmapped when it goes
            self.shm.close()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.own_dir:
            shutil.rmtree(self.own_dir, ignore_errors=True)


class RingWriter:
    """The writing end. `runtime_dir` holds the readers' ipc sockets and names the segment
    ("<basename>-ring-<token>"); without it the writer makes (and removes) a private directory."""

    def __init__(self, num_readers: int, slot_bytes: int = 1 << 20, num_slots: int = 8, runtime_dir: str | None = None):
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"a ring needs at least one reader, slot and byte per slot: {num_readers=}, {num_slots=}, {slot_bytes=}"
            )
        token = secrets.token_hex(4)
        own_dir = None if runtime_dir else tempfile.mkdtemp(prefix="pagoda-ring-")
        directory = runtime_dir or own_dir
        assert directory is not None
        prefix = os.path.basename(os.path.normpath(runtime_dir)) if runtime_dir else f"pagoda-{os.getpid()}"
        self._layout = layout = _Layout(num_readers, num_slots, slot_bytes)
        paths = [os.path.join(directory, f"ring-{token}-r{r}.sock") for r in range(num_readers)]
        shm = SharedMemory(f"{prefix}-ring-{token}", create=True, size=layout.total_bytes)
        ctx = zmq.Context()
        self._res = _WriterResources(shm, ctx, paths, own_dir)
        self._finalizer = weakref.finalize(self, self._res.close)
        assert shm.buf is not None
        self._control, self._slots = layout.views(shm.buf)
        self._res.views = [self._control, *self._slots]
        control = self._control
        control[_H_SLOTS], control[_H_SLOT_BYTES], control[_H_READERS] = num_slots, slot_bytes, num_readers
        control[_H_MAGIC] = _MAGIC
        self._sockets = []
        for path in paths:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block a send: the ring bounds what is in flight
            sock.setsockopt(zmq.RECONNECT_IVL, 10)  # the reader binds later; connect-side pipes queue
            sock.connect(f"ipc://{path}")
            self._sockets.append(sock)
        self.spec = RingSpec(
            shm.name, num_readers, num_slots, slot_bytes, tuple(f"ipc://{p}" for p in paths), os.getpid()
        )
        self._fence = _Fence()
        self._next = 1

    def write(self, parts: Sequence[bytes | memoryview | bytearray], timeout_s: float | None = None) -> None:
        """Broadcast the concatenation of `parts` (any C-contiguous buffers). Blocks while the slot it
        needs is still held by a reader; TimeoutError after `timeout_s`, RingPeerGone if such a reader
        died. Either error leaves the ring unchanged, so the write can be retried."""
        if not self._finalizer.alive:
            raise ValueError("write() on a closed RingWriter")
        if isinstance(parts, (bytes, bytearray, memoryview)):
            raise TypeError("parts must be a sequence of buffers, not one buffer")
        layout, control, m = self._layout, self._control, self._next
        slot = (m - 1) % layout.num_slots
        if m > layout.num_slots:
            self._wait_for_slot(m, timeout_s)
        self._fence()  # the readers' last reads of this slot happened before our overwrite
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        if total <= layout.slot_bytes:
            dst, offset = self._slots[slot], 0
            for v in views:
                dst[offset : offset + v.nbytes] = v
                offset += v.nbytes
            control[layout.slot(slot, _S_LEN)] = total
        else:
            header, blob = m.to_bytes(8, "little"), b"".join(views)
            for sock in self._sockets:
                sock.send_multipart([header, blob], copy=False)
            control[layout.slot(slot, _S_LEN)] = _BIG
        self._fence()  # payload and length before the sequence number
        control[layout.slot(slot, _S_SEQ)] = m
        self._fence()  # the sequence number before we look at the sleep flags (a reader's mirror check)
        for r, sock in enumerate(self._sockets):
            if control[layout.reader(r, _R_SLEEPING)]:
                sock.send(b"", zmq.NOBLOCK)
        self._next = m + 1

    def _wait_for_slot(self, m: int, timeout_s: float | None) -> None:
        """Until every reader has acknowledged message m - num_slots, the previous tenant of m's slot."""
        layout, control, needed = self._layout, self._control, m - self._layout.num_slots
        start = time.monotonic()
        next_check, pause = start + _CHECK_PEER_S, 0.0
        while True:
            laggards = [r for r in range(layout.num_readers) if control[layout.reader(r, _R_DONE)] < needed]
            if not laggards:
                return
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                late = self._describe(laggards)
                raise TimeoutError(
                    f"ring write of message {m}: {late} did not read message {needed} within {timeout_s} s"
                )
            if now >= next_check:
                next_check = now + _CHECK_PEER_S
                dead = [r for r in laggards if self._reader_gone(r)]
                if dead:
                    raise RingPeerGone(
                        f"ring write of message {m}: {self._describe(dead)} left before reading message {needed}"
                    )
            if now - start > _SPIN_S:  # the reader is slow, not just a moment behind: stop burning a core
                pause = min(max(pause * 2, 50e-6), 1e-3)
                time.sleep(pause)

    def _reader_gone(self, r: int) -> bool:
        """Whether reader r will never read again: it closed its end, or its process died."""
        control, layout = self._control, self._layout
        if control[layout.reader(r, _R_STATE)] == _CLOSED:
            return True
        pid = control[layout.reader(r, _R_PID)]
        return pid != 0 and process_gone(pid)

    def _describe(self, readers: list[int]) -> str:
        words = []
        for r in readers:
            pid, state = self._control[self._layout.reader(r, _R_PID)], self._control[self._layout.reader(r, _R_STATE)]
            if state == _DETACHED:
                words.append(f"reader {r} (never attached)")
            else:
                status = "process gone" if process_gone(pid) else "closed its end" if state == _CLOSED else "alive"
                words.append(f"reader {r} (pid {pid}, {status})")
        return ", ".join(words)

    def release_name(self) -> None:
        """Unlink the segment's name once every reader has attached (mapped it): the mappings live on, and
        from here no death of any process, ours or the resource tracker's, can leave the segment behind.
        (Ray's workers SIGKILL their children, the tracker among them, when they exit on their own.)"""
        layout, control = self._layout, self._control
        detached = [r for r in range(layout.num_readers) if control[layout.reader(r, _R_STATE)] == _DETACHED]
        if detached:
            raise ValueError(f"ring {self.spec.shm_name}: {self._describe(detached)}; its name is still needed")
        with contextlib.suppress(FileNotFoundError):
            self._res.shm.unlink()  # (and unregistered from the resource tracker)

    def close(self) -> None:
        """End the ring: readers get RingClosed once they have read everything written. Idempotent."""
        self._finalizer()


class _ReaderResources:
    """What a reader gives back: its socket and socket file, and its mapping of the segment."""

    def __init__(self, mapping: mmap.mmap, ctx: zmq.Context, path: str):
        self.mapping, self.ctx, self.path = mapping, ctx, path
        self.views: list[memoryview] = []
        self.control: memoryview | None = None
        self.state_index = 0
        self.bound = False  # whether the socket file is ours to remove

    def close(self) -> None:
        if self.control is not None:
            self.control[self.state_index] = _CLOSED
        self.ctx.destroy(linger=0)
        if self.bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        _release_all(self.views)
        with contextlib.suppress(BufferError):  # the caller still holds the last message: unmapped when it goes
            self.mapping.close()


class RingReader:
    """Reader `index` (0 <= index < spec.num_readers) of the ring `spec` describes."""

    def __init__(self, spec: RingSpec, index: int, spin_s: float = _SPIN_S):
        if not 0 <= index < spec.num_readers:
            raise ValueError(f"reader index {index} outside [0, {spec.num_readers})")
        layout = _Layout(spec.num_readers, spec.num_slots, spec.slot_bytes)
        self._held: memoryview | None = None  # the last message returned, released at the next read()
        try:
            fd = os.open(f"/dev/shm/{spec.shm_name}", os.O_RDWR)
        except FileNotFoundError:
            raise RingClosed(f"ring segment {spec.shm_name} is gone: its writer closed it or died") from None
        try:
            if os.fstat(fd).st_size < layout.total_bytes:
                raise ValueError(f"ring segment {spec.shm_name} is smaller than its spec says")
            mapping = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        path = spec.reader_addresses[index].removeprefix("ipc://")
        ctx = zmq.Context()
        self._res = _ReaderResources(mapping, ctx, path)
        self._finalizer = weakref.finalize(self, self._res.close)
        self._control, self._slots = layout.views(memoryview(mapping))
        self._res.views = [self._control, *self._slots]
        control = self._control
        expected = (_MAGIC, spec.num_slots, spec.slot_bytes, spec.num_readers)
        if tuple(control[i] for i in (_H_MAGIC, _H_SLOTS, _H_SLOT_BYTES, _H_READERS)) != expected:
            self.close()
            raise ValueError(f"ring segment {spec.shm_name} does not match its spec")
        self._socket = ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.bind(spec.reader_addresses[index])
        self._res.bound = True
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._big: deque[list[zmq.Frame]] = deque()  # payloads that arrived while we drained wake-ups
        self._layout, self._index, self._spin_s, self._writer_pid = layout, index, spin_s, spec.writer_pid
        self._fence = _Fence()
        self._next = 1
        control[layout.reader(index, _R_PID)] = os.getpid()
        control[layout.reader(index, _R_STATE)] = _ATTACHED
        self._res.control, self._res.state_index = control, layout.reader(index, _R_STATE)

    def read(self, timeout_s: float | None = None) -> memoryview | bytes:
        """The next message, in order. The returned view is valid until the next read() (then released,
        and its slot given back to the writer). TimeoutError after `timeout_s`; RingClosed after the
        last message of a closed ring; RingPeerGone if the writer died."""
        if not self._finalizer.alive:
            raise ValueError("read() on a closed RingReader")
        layout, control, m = self._layout, self._control, self._next
        if self._held is not None:
            _release_all([self._held])
            self._held = None
        self._fence()  # our reads of message m-1 are over before the writer may overwrite its slot
        control[layout.reader(self._index, _R_DONE)] = m - 1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slot = (m - 1) % layout.num_slots
        seq_index = layout.slot(slot, _S_SEQ)
        if control[seq_index] != m:
            spin_end = time.perf_counter() + self._spin_s
            while control[seq_index] != m and time.perf_counter() < spin_end:
                pass
            if control[seq_index] != m:
                self._sleep_until(seq_index, m, deadline)
        self._fence()  # the sequence number before the length and payload
        length = control[layout.slot(slot, _S_LEN)]
        if length == _BIG:
            message = self._receive_big(m, deadline)
        else:
            message = self._slots[slot][:length]
        self._held = message
        self._next = m + 1
        return message

    def _sleep_until(self, seq_index: int, m: int, deadline: float | None) -> None:
        """Block in zmq poll until message m's sequence number is published (the writer wakes us
        because our sleep flag is set)."""
        control, flag = self._control, self._layout.reader(self._index, _R_SLEEPING)
        control[flag] = 1
        self._fence()  # the flag before the re-check (the writer's mirror: seq before the flag)
        try:
            while control[seq_index] != m:
                self._wait_socket(f"message {m}", deadline, lambda: control[seq_index] == m)
        finally:
            control[flag] = 0

    def _receive_big(self, m: int, deadline: float | None) -> memoryview:
        """Message m's payload from the ZeroMQ pipe (it was sent before the slot was published)."""
        while not self._big:
            self._wait_socket(f"the payload of message {m}", deadline, lambda: bool(self._big))
        header, payload = self._big.popleft()
        sent = int.from_bytes(header.bytes, "little")
        if sent != m:
            raise RuntimeError(f"ring reader {self._index}: message {sent} came over ZeroMQ where {m} was expected")
        return payload.buffer

    def _wait_socket(self, what: str, deadline: float | None, arrived: Callable[[], bool]) -> None:
        """One wait of at most _CHECK_PEER_S on our socket: keeps payloads, drops wake-ups. After a
        quiet wait, raises if `what` can no longer come (the writer closed the ring or died)."""
        wait_s = _CHECK_PEER_S
        if deadline is not None:
            wait_s = min(wait_s, deadline - time.monotonic())
            if wait_s <= 0:
                raise TimeoutError(f"ring reader {self._index}: no {what} from the writer (pid {self._writer_pid})")
        closed_before = self._control[_H_CLOSED]  # set only after the writer's last payload left it
        if self._poller.poll(max(1, round(wait_s * 1000))):
            while int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than a zmq.Again per drain
                frames = self._socket.recv_multipart(copy=False)
                if len(frames) == 2:
                    self._big.append(frames)
            return
        if closed_before or process_gone(self._writer_pid):
            self._fence()  # the flag (or the death) before the last look
            if not arrived():
                ending = "closed the ring" if closed_before else f"(pid {self._writer_pid}) died"
                error = RingClosed if closed_before else RingPeerGone
                raise error(f"ring reader {self._index}: the writer {ending} before {what}")

    def close(self) -> None:
        """Detach (the segment stays until the writer closes it). Idempotent."""
        if self._held is not None:
            _release_all([self._held])
            self._held = None
        self._finalizer()
