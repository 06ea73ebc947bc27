"""Compiled CPU kernels: C sources built once with the system C compiler and loaded with ctypes.

Built on first use into `$PAGODA_CACHE/kernels/` (keyed by the source, compiler flags and machine), in
about a second. Where no compiler works, `available()` is False and the torch reference is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC", "-pthread"]
_lib: ctypes.CDLL | None = None
_failed = False


def _build() -> Path:
    from engine_core.default_model import cache_root

    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + platform.machine().encode()
                         + _cpu_signature()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{key}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler found")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True,
                           capture_output=True)
            built.rename(target)  # atomic: concurrent builders never load a half-written library
    return target


def _cpu_signature() -> bytes:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                    "").encode()
    except OSError:
        return b""


def _load() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            lib = ctypes.CDLL(str(_build()))
            fn = lib.paged_decode_attention_f32
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64]
            _lib = lib
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            _failed = True
            logger.warning("CPU attention kernel unavailable (%s); using the torch reference", exc)
    return _lib


def available() -> bool:
    return _load() is not None


_workspace = torch.empty(0)


def _scratch(numel: int) -> torch.Tensor:
    """A float32 scratch buffer reused across calls (grown when too small): no allocation per layer."""
    global _workspace
    if _workspace.numel() < numel:
        _workspace = torch.empty(max(numel, 2 * _workspace.numel()), dtype=torch.float32)
    return _workspace


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Same contract as `kernels.torch_ref.attention.paged_decode_attention` (float32, CPU)."""
    lib = _load()
    if lib is None or query.dtype != torch.float32 or not key_cache.is_contiguous():
        from kernels.torch_ref.attention import paged_decode_attention as reference

        return reference(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, max_seq_len)
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    query = query.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    max_len = block_tables.shape[1] * block_size
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    threads = min(torch.get_num_threads(), batch)
    if batch * longest < 2048:  # too little work to pay for starting a thread
        threads = 1
    out = torch.empty_like(query)
    workspace = _scratch(threads * num_heads * max_len)
    lib.paged_decode_attention_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), workspace.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], max_len, sliding_window or 0, scale, threads)
    return out
