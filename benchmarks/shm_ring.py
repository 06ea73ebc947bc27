"""Broadcast latency of one decode step's inputs: the shared-memory ring against ZeroMQ ipc, in one run.

The message is what a 64-request decode step sends to the tensor-parallel workers: token ids, positions
and slot ids (64 int64 each), sequence lengths (64 int32), a 64x32 int64 block table and the sampling
rows (temperature, top-p as float32, top-k as int32): 18,960 bytes in 9 parts. Latency is from just
before the writer's call to the moment read() / recv() has returned in the *last* reader (each reader
timestamps with CLOCK_MONOTONIC, which all processes share), for 1 and 3 reader processes.

Two regimes, each with its own baseline:
- readers asleep: messages `--gap-ms` apart, so every reader has given up spinning and waits in a
  blocking poll (the ring's ZeroMQ wake-up; ZeroMQ's own blocking recv);
- readers spinning: the ring's readers spin for up to `--spin-ms` (longer than the gap), the ZeroMQ
  readers poll recv(NOBLOCK) in a loop: what a busy engine could choose.
The baseline sends the same parts as one multipart message on a PUSH socket per reader.

    python benchmarks/shm_ring.py                    # 3 rounds of 1,000 messages per case
    python benchmarks/shm_ring.py --messages 5000 --gap-ms 2 --spin-ms 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time

import msgspec
import numpy as np
import zmq

from pagoda.engine_core.parallel.shm_ring import RingReader, RingSpec, RingWriter

WARMUP = 100  # messages not measured: readers attach, connections settle


def step_inputs(batch: int = 64, blocks_per_seq: int = 32) -> list[np.ndarray]:
    """The persistent input buffers of a decode step (values do not matter, sizes do)."""
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 49152, batch, dtype=np.int64),  # token ids
        rng.integers(0, 4096, batch, dtype=np.int64),  # positions
        rng.integers(0, 1 << 20, batch, dtype=np.int64),  # slot mapping
        rng.integers(1, 4096, batch, dtype=np.int32),  # sequence lengths
        rng.integers(0, 1 << 16, (batch, blocks_per_seq), dtype=np.int64),  # block table
        np.ones(batch, dtype=np.float32),  # temperature
        np.ones(batch, dtype=np.float32),  # top-p
        np.zeros(batch, dtype=np.int32),  # top-k
    ]


def reader_main(kind: str, target: bytes, index: int, count: int, spin_s: float, spinning: bool, conn) -> None:
    """Receive `count` messages; send back each one's latency in ns (receive time - send time)."""
    latencies = []
    if kind == "ring":
        reader = RingReader(msgspec.msgpack.decode(target, type=RingSpec), index, spin_s=spin_s)
        conn.send_bytes(b"ready")
        for _ in range(count):
            view = reader.read(timeout_s=60)
            latencies.append(time.perf_counter_ns() - int.from_bytes(view[:8], "little"))
        reader.close()
    else:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.connect(target.decode())
        conn.send_bytes(b"ready")
        for _ in range(count):
            if spinning:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        pass
            else:
                frames = sock.recv_multipart()
            latencies.append(time.perf_counter_ns() - int.from_bytes(frames[0][:8], "little"))
        ctx.destroy(linger=0)
    conn.send_bytes(msgspec.msgpack.encode(latencies[WARMUP:]))


def run_case(kind: str, num_readers: int, spinning: bool, args) -> tuple[list[int], list[int]]:
    """One transport, one reader count, one regime: (latency of the last reader per message, write call ns)."""
    mp = multiprocessing.get_context("spawn")
    count, gap_s = args.messages + WARMUP, args.gap_ms / 1000
    spin_s = args.spin_ms / 1000 if spinning else 50e-6
    runtime_dir = tempfile.mkdtemp(prefix="pagoda-bench-")
    ctx = zmq.Context()
    writer, sockets, targets = None, [], []
    if kind == "ring":
        writer = RingWriter(num_readers, slot_bytes=1 << 16, num_slots=8, runtime_dir=runtime_dir)
        targets = [msgspec.msgpack.encode(writer.spec)] * num_readers
    else:
        for index in range(num_readers):
            sock = ctx.socket(zmq.PUSH)
            address = f"ipc://{runtime_dir}/push-{index}.sock"
            sock.bind(address)
            sockets.append(sock)
            targets.append(address.encode())
    pipes, processes = [], []
    for index in range(num_readers):
        mine, theirs = mp.Pipe()
        process = mp.Process(target=reader_main, args=(kind, targets[index], index, count, spin_s, spinning, theirs))
        process.start()
        pipes.append(mine)
        processes.append(process)
    for pipe in pipes:
        assert pipe.recv_bytes() == b"ready"
    time.sleep(0.2)
    inputs = step_inputs()
    header = np.zeros(1, dtype=np.int64)
    parts = [header, *inputs]
    write_ns = []
    for _ in range(count):
        time.sleep(gap_s)
        start = time.perf_counter_ns()
        header[0] = start
        if writer is not None:
            writer.write(parts, timeout_s=60)
        else:
            for sock in sockets:
                sock.send_multipart(parts)
        write_ns.append(time.perf_counter_ns() - start)
    per_reader = [msgspec.msgpack.decode(pipe.recv_bytes()) for pipe in pipes]
    for process in processes:
        process.join()
    if writer is not None:
        writer.close()
    ctx.destroy(linger=0)

    shutil.rmtree(runtime_dir, ignore_errors=True)
    return [max(column) for column in zip(*per_reader, strict=True)], write_ns[WARMUP:]


def quantiles(ns: list[int]) -> tuple[float, float]:
    ordered = sorted(ns)
    return statistics.median(ordered) / 1000, ordered[int(0.99 * (len(ordered) - 1))] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000, help="measured messages per case and round")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="pause between messages")
    parser.add_argument("--spin-ms", type=float, default=5.0, help="ring readers' spin budget when spinning")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--rounds", type=int, default=3, help="ring and ZeroMQ alternate, this many times each")
    args = parser.parse_args()
    size = sum(a.nbytes for a in step_inputs()) + 8
    print(
        f"decode step of 64 requests: {size} bytes; {args.rounds} x {args.messages} messages per case, "
        f"{args.gap_ms} ms apart; spinning readers spin up to {args.spin_ms} ms"
    )
    print(
        f"{'readers':>7} {'regime':<15} {'ring med':>9} {'ring p99':>9} {'zmq med':>9} {'zmq p99':>9} "
        f"{'zmq/ring':>8} {'ring write':>10} {'zmq send':>9}   (µs)"
    )
    for num_readers in args.readers:
        for spinning in (False, True):
            ring, ring_write, zmq_lat, zmq_write = [], [], [], []
            for _ in range(args.rounds):  # alternating, so that both see the machine's load alike
                latencies, writes = run_case("ring", num_readers, spinning, args)
                ring += latencies
                ring_write += writes
                latencies, writes = run_case("zmq", num_readers, spinning, args)
                zmq_lat += latencies
                zmq_write += writes
            (ring_med, ring_p99), (zmq_med, zmq_p99) = quantiles(ring), quantiles(zmq_lat)
            regime = "spinning" if spinning else "asleep"
            print(
                f"{num_readers:>7} {regime:<15} {ring_med:>9.1f} {ring_p99:>9.1f} {zmq_med:>9.1f} {zmq_p99:>9.1f} "
                f"{zmq_med / ring_med:>7.2f}x {quantiles(ring_write)[0]:>10.1f} {quantiles(zmq_write)[0]:>9.1f}"
            )


if __name__ == "__main__":
    main()
