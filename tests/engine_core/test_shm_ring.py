"""The shared-memory broadcast ring (engine_core/parallel/shm_ring.py) between real processes.

Readers run in processes started with the "spawn" context and get the RingSpec msgpack-encoded. Every
message carries its sequence number, its body's length and CRC-32, so a lost, reordered or torn message
shows up as a mismatch in the reader, which reports what it saw back over a pipe (msgpack, no pickle).
After each test no shared-memory segment of the test's runtime directory and no socket file is left.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from pathlib import Path

import msgspec
import pytest

from pagoda.engine_core.parallel.shm_ring import RingClosed, RingPeerGone, RingReader, RingSpec, RingWriter

HEADER = struct.Struct("<QII")  # sequence number, body length, CRC-32 of the body
POOL = random.Random(16).randbytes(1 << 16)  # message bodies are slices of this
SLOT_BYTES = 4096
MAX_BODY = 3 * SLOT_BYTES  # bodies above SLOT_BYTES - HEADER.size go over ZeroMQ
ROOT = Path(__file__).resolve().parents[2]


def message(seq: int, rng: random.Random) -> list[bytes | memoryview]:
    """Message `seq` as parts: mostly small, some exactly at the slot's edge, about 3 % larger than a slot."""
    fits = SLOT_BYTES - HEADER.size
    roll = rng.random()
    if roll < 0.03:
        length = rng.randint(fits + 1, MAX_BODY)
    elif roll < 0.05:
        length = rng.choice((fits, fits + 1, 0))
    else:
        length = rng.randint(0, fits)
    start = rng.randint(0, len(POOL) - length)
    body = memoryview(POOL)[start : start + length]
    header = HEADER.pack(seq, length, zlib.crc32(body))
    cut = rng.randint(0, length)
    return [header, body[:cut], body[cut:]] if seq % 2 else [header, body]


def check(view: memoryview | bytes, expected_seq: int) -> str | None:
    """What is wrong with a received message, or None."""
    seq, length, crc = HEADER.unpack_from(view)
    body = memoryview(view)[HEADER.size :]
    if seq != expected_seq:
        return f"message {seq} where {expected_seq} was expected"
    if len(body) != length or zlib.crc32(body) != crc:
        return f"message {seq} torn: {len(body)} bytes of {length}, crc {zlib.crc32(body):#x} vs {crc:#x}"
    return None


def reader_main(spec_bytes: bytes, index: int, conn, pauses: dict[int, float], hold_at: int | None) -> None:
    """Read and check messages until the ring closes; sleep `pauses[seq]` s after message seq; after
    message `hold_at`, tell the parent and wait for its word (or be killed) while holding it."""
    reader = RingReader(msgspec.msgpack.decode(spec_bytes, type=RingSpec), index)
    count, errors, end = 0, [], ""
    try:
        while True:
            view = reader.read(timeout_s=60)
            count += 1
            problem = check(view, count)
            if problem:
                errors.append(problem)
                if len(errors) > 5:
                    break
            if count in pauses:
                time.sleep(pauses[count])
            if count == hold_at:
                conn.send_bytes(b"holding")
                conn.recv_bytes()
    except (RingClosed, RingPeerGone, TimeoutError) as error:
        end = f"{type(error).__name__}: {error}"
    reader.close()
    conn.send_bytes(msgspec.msgpack.encode({"count": count, "errors": errors, "end": end}))


def idle_reader_main(spec_bytes: bytes, conn) -> None:
    """Wait 1.5 s for a message that never comes; report the CPU time this process used meanwhile."""
    reader = RingReader(msgspec.msgpack.decode(spec_bytes, type=RingSpec), 0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        reader.read(timeout_s=1.5)
        outcome = "a message"
    except TimeoutError as error:
        outcome = str(error)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    reader.close()
    conn.send_bytes(msgspec.msgpack.encode({"cpu_s": cpu_s, "outcome": outcome}))


class Readers:
    """Reader processes, each with its pipe."""

    def __init__(self, writer: RingWriter, num: int, pauses=None, hold=None):
        mp = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for index in range(num):
            mine, theirs = mp.Pipe()
            args = (
                msgspec.msgpack.encode(writer.spec),
                index,
                theirs,
                (pauses or {}).get(index, {}),
                (hold or {}).get(index),
            )
            process = mp.Process(target=reader_main, args=args, daemon=True)
            process.start()
            theirs.close()
            self.pipes.append(mine)
            self.processes.append(process)

    def results(self, indices=None) -> list[dict]:
        out = []
        for index in indices if indices is not None else range(len(self.pipes)):
            assert self.pipes[index].poll(120), f"reader {index} reported nothing"
            out.append(msgspec.msgpack.decode(self.pipes[index].recv_bytes()))
        return out

    def stop(self) -> None:
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


class Rings:
    """The rings and reader processes a test made, in a runtime directory like `pagoda serve`'s."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="pagoda-")
        self.writers: list[RingWriter] = []
        self.reader_groups: list[Readers] = []

    def writer(self, num_readers: int, **kwargs) -> RingWriter:
        self.writers.append(RingWriter(num_readers, runtime_dir=self.dir, **kwargs))
        return self.writers[-1]

    def readers(self, writer: RingWriter, num: int, **kwargs) -> Readers:
        self.reader_groups.append(Readers(writer, num, **kwargs))
        return self.reader_groups[-1]

    def leftovers(self) -> list[str]:
        prefix = os.path.basename(self.dir) + "-"
        return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)] + os.listdir(self.dir)


@pytest.fixture
def rings():
    """Afterwards (once a failed test's writers are closed and its processes stopped, which a passing
    test has already done itself) no shared-memory segment and no socket file of the test may be left."""
    made = Rings()
    yield made
    for writer in made.writers:
        writer.close()
    for group in made.reader_groups:
        group.stop()
    assert made.leftovers() == []
    os.rmdir(made.dir)


def write_all(writer: RingWriter, count: int, seed: int = 0, first: int = 1) -> None:
    rng = random.Random(seed)
    for seq in range(first, first + count):
        writer.write(message(seq, rng), timeout_s=60)


def test_three_readers_see_100k_messages_in_order_and_whole(rings):
    writer = rings.writer(3, slot_bytes=SLOT_BYTES, num_slots=8)
    readers = rings.readers(writer, 3)
    write_all(writer, 100_000)
    writer.close()
    results = readers.results()
    for result in results:
        assert result["errors"] == [] and result["count"] == 100_000
        assert result["end"].startswith("RingClosed")


def test_stalled_readers_make_the_writer_wait_then_it_goes_on(rings):
    writer = rings.writer(3, slot_bytes=SLOT_BYTES, num_slots=8)
    # Reader 0 sleeps twice mid-stream, reader 2 once; reader 1 holds message 50 until told to go on.
    readers = rings.readers(writer, 3, pauses={0: {100: 0.3, 1500: 0.3}, 2: {700: 0.5}}, hold={1: 50})
    rng = random.Random(1)
    for seq in range(1, 58):  # 50 + 8 - 1: the last one before the held slot comes round again
        writer.write(message(seq, rng), timeout_s=60)
    assert readers.pipes[1].poll(60) and readers.pipes[1].recv_bytes() == b"holding"
    stuck = message(58, rng)
    with pytest.raises(TimeoutError, match=r"reader 1 \(pid \d+, alive\).* did not read message 50"):
        writer.write(stuck, timeout_s=0.5)
    readers.pipes[1].send_bytes(b"go")
    writer.write(stuck, timeout_s=60)  # the failed write changed nothing: retrying it is fine
    for seq in range(59, 3001):
        writer.write(message(seq, rng), timeout_s=60)
    writer.close()
    results = readers.results()
    assert [(r["count"], r["errors"]) for r in results] == [(3000, [])] * 3


def test_killed_reader_fails_the_writer_and_leaves_nothing(rings):
    writer = rings.writer(3, slot_bytes=SLOT_BYTES, num_slots=8)
    readers = rings.readers(writer, 3, hold={1: 200})
    rng = random.Random(2)
    for seq in range(1, 201):
        writer.write(message(seq, rng), timeout_s=60)
    assert readers.pipes[1].poll(60) and readers.pipes[1].recv_bytes() == b"holding"
    victim = readers.processes[1]
    os.kill(victim.pid, signal.SIGKILL)  # not reaped yet: a zombie must count as dead too
    for seq in range(201, 208):  # the slots the dead reader had already given back
        writer.write(message(seq, rng), timeout_s=60)
    with pytest.raises(
        RingPeerGone, match=rf"reader 1 \(pid {victim.pid}, process gone\) left before reading message 200"
    ):
        writer.write(message(208, rng), timeout_s=60)
    writer.close()
    results = readers.results([0, 2])
    assert [(r["count"], r["errors"]) for r in results] == [(207, [])] * 2
    assert all(r["end"].startswith("RingClosed") for r in results)


def test_a_stuck_reader_times_the_writer_out(rings):
    writer = rings.writer(2, slot_bytes=64, num_slots=2)
    readers = rings.readers(writer, 2, hold={1: 1})
    write_all(writer, 2)
    assert readers.pipes[1].poll(60) and readers.pipes[1].recv_bytes() == b"holding"
    with pytest.raises(TimeoutError, match=r"reader 1 \(pid \d+, alive\) did not read message 1 within 0.3 s"):
        writer.write([b"x"], timeout_s=0.3)
    readers.pipes[1].send_bytes(b"go")
    writer.close()
    assert [(r["count"], r["errors"]) for r in readers.results()] == [(2, [])] * 2


def test_idle_reader_blocks_without_spinning(rings):
    writer = rings.writer(1, slot_bytes=SLOT_BYTES)
    mp = multiprocessing.get_context("spawn")
    mine, theirs = mp.Pipe()
    process = mp.Process(target=idle_reader_main, args=(msgspec.msgpack.encode(writer.spec), theirs), daemon=True)
    process.start()
    assert mine.poll(60)
    result = msgspec.msgpack.decode(mine.recv_bytes())
    process.join(10)
    writer.close()
    assert result["outcome"].startswith("ring reader 0: no message 1 from the writer")
    assert result["cpu_s"] < 0.15  # a spinning reader would use most of a core for the 1.5 s


WRITER_SCRIPT = """
import sys, time, msgspec
from pagoda.engine_core.parallel.shm_ring import RingWriter
writer = RingWriter(1, slot_bytes=256, num_slots=4, runtime_dir=sys.argv[1])
for seq in range(1, 4):
    writer.write([seq.to_bytes(8, "little")])
sys.stdout.buffer.write(msgspec.msgpack.encode(writer.spec).hex().encode() + b"\\n")
sys.stdout.flush()
if sys.argv[2] == "release":  # once the test's reader has attached (it says so on stdin)
    sys.stdin.readline()
    writer.release_name()
    print("released", flush=True)
if sys.argv[2] in ("wait", "release"):
    time.sleep(600)
"""


def run_writer_process(runtime_dir: str, mode: str) -> tuple[subprocess.Popen, RingSpec]:
    """A writer in its own interpreter (and so with its own multiprocessing resource tracker)."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER_SCRIPT), runtime_dir, mode],
        cwd=ROOT,
        stdin=subprocess.PIPE if mode == "release" else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    spec = msgspec.msgpack.decode(bytes.fromhex(process.stdout.readline().decode()), type=RingSpec)
    return process, spec


def test_writer_exiting_without_close_leaves_nothing(rings):
    process, spec = run_writer_process(rings.dir, "exit")
    assert process.wait(60) == 0
    assert process.stderr is not None and process.stderr.read() == b""  # no resource-tracker warning
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")


def test_killed_writer_ends_its_readers_and_its_segment_goes(rings):
    process, spec = run_writer_process(rings.dir, "wait")
    reader = RingReader(spec, 0)
    assert [int.from_bytes(reader.read(timeout_s=60), "little") for _ in range(3)] == [1, 2, 3]
    process.kill()
    process.wait()
    with pytest.raises(RingPeerGone, match=rf"the writer \(pid {process.pid}\) died before message 4"):
        reader.read(timeout_s=60)
    reader.close()
    # The writer's resource tracker unlinks what the writer could not (and says so on stderr).
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/{spec.shm_name}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")
    process.stderr.close()
    process.stdout.close()


def test_in_process_contract(rings):
    writer = rings.writer(1, slot_bytes=16, num_slots=2)
    reader = RingReader(writer.spec, 0)
    writer.write([b"abc", bytearray(b"de"), memoryview(b"f")])
    writer.write([b"x" * 40])  # larger than a slot
    first = reader.read(timeout_s=5)
    assert bytes(first) == b"abcdef"
    assert bytes(reader.read(timeout_s=5)) == b"x" * 40
    with pytest.raises(ValueError):  # the view is valid until the next read() only
        bytes(first)
    with pytest.raises(TimeoutError):
        reader.read(timeout_s=0.05)
    with pytest.raises(TypeError):
        writer.write(b"one buffer")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RingReader(writer.spec, 1)
    writer.close()
    with pytest.raises(RingClosed):
        reader.read(timeout_s=5)
    with pytest.raises(RingClosed):
        RingReader(writer.spec, 0)
    reader.close()
    reader.close()
    writer.close()
    with pytest.raises(ValueError):
        writer.write([b"late"])


def test_a_released_name_outlives_no_kill_even_of_the_resource_tracker(rings):
    """Ray's workers SIGKILL their children when they exit on their own, the writer's resource tracker
    among them: once every reader has attached, release_name() leaves nothing for the tracker to do."""
    process, spec = run_writer_process(rings.dir, "release")
    reader = RingReader(spec, 0)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"attached\n")
    process.stdin.flush()
    assert process.stdout.readline() == b"released\n"
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")
    assert [int.from_bytes(reader.read(timeout_s=60), "little") for _ in range(3)] == [1, 2, 3]  # (mapped still)
    trackers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    for pid in [*trackers, process.pid]:
        os.kill(pid, signal.SIGKILL)
    process.wait()
    reader.close()
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")
    for stream in (process.stdin, process.stdout, process.stderr):
        stream.close()


def test_the_name_is_kept_until_every_reader_has_attached(rings):
    writer = rings.writer(2, slot_bytes=64, num_slots=2)
    first = RingReader(writer.spec, 0)
    with pytest.raises(ValueError, match=r"reader 1 \(never attached\); its name is still needed"):
        writer.release_name()
    assert os.path.exists(f"/dev/shm/{writer.spec.shm_name}")
    second = RingReader(writer.spec, 1)
    writer.release_name()
    assert not os.path.exists(f"/dev/shm/{writer.spec.shm_name}")
    writer.write([b"after"])
    assert bytes(first.read(timeout_s=10)) == bytes(second.read(timeout_s=10)) == b"after"
    first.close()
    second.close()
