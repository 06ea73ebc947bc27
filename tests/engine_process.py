"""The engine core in its own process, driven over real ZeroMQ sockets as the tokenizer process drives it
(test_core_proc.py; test_tensor_parallel.py, whose engine starts worker processes of its own)."""

from __future__ import annotations

import multiprocessing
import time

import zmq

from pagoda.engine_core import protocol
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core_proc import run_engine_core


class EngineProcess:
    def __init__(self, tmp_path, config: EngineConfig):
        in_addr, out_addr = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        # Not daemonic: under tensor parallel the engine core starts worker processes; close() kills it.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, in_addr, out_addr), daemon=False
        )
        self.process.start()
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(out_addr)

    def send(self, message) -> None:
        self.push.send(protocol.encoder.encode(message))

    def recv(self, timeout_s: float = 120.0):
        """The next message other than an idle heartbeat (a StepOutputs without deltas)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.pull.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError("no message from the engine core")
            message = protocol.output_decoder.decode(self.pull.recv())
            if not (isinstance(message, protocol.StepOutputs) and not message.deltas):
                return message

    def collect(self, request_ids: set[str]) -> tuple[dict, dict]:
        """Tokens and finish reasons of `request_ids` until all finished; rejections count as finished."""
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        reasons = {}
        while set(reasons) != request_ids:
            message = self.recv()
            if isinstance(message, protocol.RequestRejected):
                reasons[message.request_id] = "rejected: " + message.message
            elif isinstance(message, protocol.StepOutputs):
                for delta in message.deltas:
                    tokens[delta.request_id].extend(delta.new_token_ids)
                    if delta.finish_reason:
                        reasons[delta.request_id] = delta.finish_reason
        return tokens, reasons

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
