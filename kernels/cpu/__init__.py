"""Compiled CPU kernels: C sources built once with the system C compiler and loaded with ctypes.

Built on first use into `build_dir` (the engine sets it to `$PAGODA_CACHE/kernels/`; keyed by the
source, compiler flags and machine), in about a second. Where no compiler works, `available()` is
False and the torch reference is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from pagoda.kernels import panels
from pagoda.kernels.quantized import PackedWeight, reference_linear

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# -mprefer-vector-width=512: where the CPU has AVX-512, GCC's tuning for it (Intel's server cores) still
# vectorizes loops 256 bits wide, and the kernels' tiles are shaped for 512-bit registers: the prefill
# attention's 8 x 32 score tile is 16 zmm accumulators, but 32 ymm ones, which spill (a 512-token prompt's
# attention, 30 layers: 94 -> 47 ms; the whole prefill 468-490 -> 396-403 ms, docs/decode-speed.md).
# Where there is no AVX-512 it changes nothing; the intrinsics code paths choose their own width anyway.
_COMMON_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC", "-pthread"]
# Attention may reassociate sums and use vector expf; the element-wise ops must round exactly like torch.
# Not `-ffast-math` itself: when it links a shared library, GCC 12 adds crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process that loads it (every float in it, torch's and Python's
# included, then loses its subnormals). These are -ffast-math's code-generation flags without that.
_FAST_MATH = [
    "-fno-math-errno",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fassociative-math",
    "-freciprocal-math",
    "-fno-rounding-math",
    "-fcx-limited-range",
]
_LIBRARIES = {
    "paged_attention": [*_FAST_MATH, "-fopenmp"],  # libgomp: torch's own, already loaded
    "varlen_attention": [*_FAST_MATH, "-fopenmp"],
    "elementwise": ["-fno-fast-math", "-ffp-contract=off"],
    "quantized_matmul": ["-fopenmp"],
    "panel_matmul": ["-fopenmp"],
    "amx_matmul": ["-fopenmp"],
    "layer_ops": ["-fopenmp"],
    "argmax": ["-fopenmp"],
    "decoder": ["-fopenmp"],  # (calls the others' kernels through pointers: its own flags are its own ops')
}
_POINTER, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention_f32": [_POINTER] * 7 + [_I64] * 8 + [_F32, _I64],
    "paged_decode_attention_f16kv": [_POINTER] * 7 + [_I64] * 8 + [_F32, _I64],  # only where the CPU has F16C
    "paged_decode_attention_workspace": [_I64] * 3,
    "varlen_attention_f32": [_POINTER] * 6 + [_I64] * 10 + [_F32, _I64],
    "varlen_attention_workspace": [_I64] * 3,
    "paged_prefill_attention_f32": [_POINTER] * 8 + [_I64] * 9 + [_F32, _I64],
    "rotary_embedding_f32": [_POINTER] * 4 + [_I64] * 8,
    "reshape_and_cache_f32": [_POINTER] * 5 + [_I64] * 4,
    "reshape_and_cache_f16kv": [_POINTER] * 5 + [_I64] * 4,
    "quantized_linear_f32": [_POINTER] * 7 + [_I64] * 11,
    "quantized_dequantize_f32": [_POINTER] * 4 + [_I64] * 9,
    "quantized_linear_q8_f32": [_POINTER] * 7 + [_I64] * 10,  # only where the CPU has VNNI
    "quantized_q8_unit": [],
    "quantized_q8_workspace": [_I64] * 5,
    "quantized_batch_workspace": [_I64] * 3,
    "panel_linear_f32": [_POINTER] * 4 + [_I64] * 4,
    "amx_linear_f32": [_POINTER] * 4 + [_I64] * 4,
    "rms_norm_f32": [_POINTER] * 3 + [_I64] * 5 + [_F32, _I64],
    "add_rms_norm_f32": [_POINTER] * 5 + [_I64] * 2 + [_F32, _I64],
    "silu_and_mul_f32": [_POINTER] * 2 + [_I64] * 3,
    "argmax_rows_f32": [_POINTER] * 2 + [_I64] * 4,
    "decode_layers_f32": [_POINTER, _POINTER, _I64, _POINTER],
    "decoder_scratch_floats": [_POINTER, _I64, _I64, _I64],
}
_RESULTS = {
    "amx_linear_f32": ctypes.c_int,
    "varlen_attention_f32": ctypes.c_int,
    "paged_decode_attention_f16kv": ctypes.c_int,
    "paged_decode_attention_workspace": _I64,
    "varlen_attention_workspace": _I64,
    "paged_prefill_attention_f32": ctypes.c_int,
    "decoder_scratch_floats": _I64,
    "quantized_q8_unit": _I64,
    "quantized_q8_workspace": _I64,
    "quantized_batch_workspace": _I64,
}
_lib: dict[str, Callable[..., None]] = {}  # C function name -> the ctypes function
_failed = False
build_dir = Path(tempfile.gettempdir()) / f"pagoda-kernels-{os.getuid()}"  # pagoda.kernels.configure sets it


def _build(name: str) -> Path:
    source_path = _DIR / f"{name}.c"
    flags = _COMMON_FLAGS + _LIBRARIES[name]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    key = hashlib.sha256(  # (another compiler, or CC set to one with other flags, builds its own copy)
        source_path.read_bytes()
        + b"".join(header.read_bytes() for header in sorted(_DIR.glob("*.h")))  # (what the sources include)
        + " ".join([compiler, *flags]).encode()
        + platform.machine().encode()
        + _cpu_signature()
    ).hexdigest()[:16]
    target = build_dir / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *flags, str(source_path), "-o", str(built), "-lm"], check=True, capture_output=True
            )
            built.rename(target)  # atomic: concurrent builders never load a half-written library
    return target


def _cpu_signature() -> bytes:
    try:
        return next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).encode()
    except OSError:
        return b""


def _load() -> dict[str, Callable[..., None]] | None:
    """Every C function by name, or None (after one warning) if the libraries cannot be built."""
    global _failed
    if not _lib and not _failed:
        try:
            functions = {}
            for name in _LIBRARIES:
                lib = ctypes.CDLL(str(_build(name)))
                for symbol, argtypes in _SIGNATURES.items():
                    if hasattr(lib, symbol):
                        fn = getattr(lib, symbol)
                        fn.argtypes, fn.restype = argtypes, _RESULTS.get(symbol)
                        functions[symbol] = fn
            _lib.update(functions)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            _failed = True
            logger.warning("CPU kernels unavailable (%s); using the torch reference", exc)
    return _lib or None


def available() -> bool:
    return _load() is not None


_workspace = torch.empty(0)


def _int64(index: torch.Tensor) -> torch.Tensor:
    """`index` as contiguous int64, itself when it is already (the usual case): two attribute reads
    instead of two dispatched torch ops, which add up over every layer's calls."""
    if index.dtype == torch.int64 and index.is_contiguous():
        return index
    return index.to(torch.int64).contiguous()


def _scratch(numel: int) -> torch.Tensor:
    """A float32 scratch buffer reused across calls (grown when too small): no allocation per layer."""
    global _workspace
    if _workspace.numel() < numel:
        _workspace = torch.empty(max(numel, 2 * _workspace.numel()), dtype=torch.float32)
    return _workspace


def decode_attention_threads(batch: int, longest: int) -> int:
    """Threads for decode attention over `batch` sequences of at most `longest` keys: torch's count (fewer
    sequences than threads: each is split between them), or one where there is too little work to pay for
    waking a thread (from 256 keys on, two win)."""
    return 1 if batch * longest < 256 else torch.get_num_threads()


def _decode_attention_function(
    lib: dict[str, Callable[..., None]] | None,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> Callable[..., None] | None:
    """The C paged decode attention for this query and cache (K and V alike), or None (the torch
    reference's case)."""
    if lib is None or query.dtype != torch.float32 or value_cache.dtype != key_cache.dtype:
        return None
    if key_cache.dtype == torch.float32:
        return lib["paged_decode_attention_f32"]
    if key_cache.dtype == torch.float16 and query.shape[-1] % 8 == 0:  # (the C code's condition)
        return lib.get("paged_decode_attention_f16kv")
    return None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.paged_decode_attention` (float32 queries, CPU; a
    float32 or float16 cache)."""
    lib = _load()
    function = _decode_attention_function(lib, query, key_cache, value_cache)
    if function is None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        from pagoda.kernels.torch_ref.attention import paged_decode_attention as reference

        return reference(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, max_seq_len)
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if not query.is_contiguous():
        query = query.contiguous()
    block_tables = _int64(block_tables)
    seq_lens = _int64(seq_lens)
    max_len = block_tables.shape[1] * block_size
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    threads = decode_attention_threads(batch, longest)
    out = torch.empty_like(query)
    assert lib is not None
    workspace_size = cast(Callable[..., int], lib["paged_decode_attention_workspace"])  # (restype int64)
    workspace = _scratch(workspace_size(num_heads, max_len, threads))
    function(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        max_len,
        sliding_window or 0,
        scale,
        threads,
    )
    return out


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.varlen_attention` (float32, CPU)."""
    lib = _load()
    if lib is None or not all(_rows_contiguous(x) for x in (query, key, value)):
        from pagoda.kernels.torch_ref.attention import varlen_attention as reference

        return reference(query, key, value, query_start_loc, scale, causal, sliding_window)
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window applies to causal attention only")
    tokens, num_heads, head_dim = query.shape
    cu_seqlens = _int64(query_start_loc)
    starts = cu_seqlens.tolist()  # (host arithmetic: tensor ops on a few numbers cost more than the lists)
    lens = [end - start for start, end in itertools.pairwise(starts)]
    num_seqs = len(lens)
    max_len = max(lens, default=0)
    out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    if max_len == 0:
        return out
    threads, workspace = _prefill_threads_and_workspace(lib, lens, lens, num_heads, key.shape[1], head_dim)
    failed = lib["varlen_attention_f32"](
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        cu_seqlens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        num_seqs,
        num_heads,
        key.shape[1],
        head_dim,
        query.stride(0),
        key.stride(0),
        value.stride(0),
        max_len,
        int(causal),
        sliding_window or 0,
        scale,
        threads,
    )
    if failed:
        raise MemoryError("varlen attention: no memory for its job table")
    return out


def _prefill_threads_and_workspace(
    lib: dict[str, Callable[..., None]],
    query_lens: list[int],
    key_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[int, torch.Tensor]:
    """Threads and workspace for varlen_attention.c's jobs (64 query rows of one KV head each): torch's
    thread count, or one where there is too little work to pay for waking a thread."""
    threads = torch.get_num_threads()
    if sum(q * k for q, k in zip(query_lens, key_lens, strict=True)) * num_heads * head_dim < 1 << 18:
        threads = 1
    threads = min(threads, sum(-(-q // 64) for q in query_lens) * num_kv_heads)
    workspace_size = cast(Callable[..., int], lib["varlen_attention_workspace"])  # (restype int64)
    return threads, _scratch(workspace_size(head_dim, max(key_lens, default=0), threads))


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.paged_prefill_attention` (float32 queries and caches,
    CPU; other caches go to the reference)."""
    lib = _load()
    caches_ok = all(c.dtype == torch.float32 and c.is_contiguous() for c in (key_cache, value_cache))
    if lib is None or not caches_ok or not _rows_contiguous(query):
        from pagoda.kernels.torch_ref.attention import paged_prefill_attention as reference

        return reference(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    cu_seqlens, seq_lens, block_tables = _int64(query_start_loc), _int64(seq_lens), _int64(block_tables)
    starts, lens = cu_seqlens.tolist(), seq_lens.tolist()  # (host arithmetic, as in varlen_attention)
    chunks = [end - start for start, end in itertools.pairwise(starts)]
    if any(chunk > length for chunk, length in zip(chunks, lens, strict=True)):
        raise ValueError("paged prefill attention: a sequence has more query rows than keys")
    out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    max_len = max(lens, default=0)
    if tokens == 0:
        return out
    threads, workspace = _prefill_threads_and_workspace(lib, chunks, lens, num_heads, num_kv_heads, head_dim)
    failed = lib["paged_prefill_attention_f32"](
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        cu_seqlens.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        len(lens),
        num_heads,
        num_kv_heads,
        head_dim,
        query.stride(0),
        block_size,
        block_tables.shape[1],
        max_len,
        sliding_window or 0,
        scale,
        threads,
    )
    if failed:
        raise MemoryError("paged prefill attention: no memory for its job table")
    return out


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, D] whose heads of one token are adjacent (any token stride): views of a fused QKV output."""
    return x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pagoda.kernels.torch_ref.layers.rotary_embedding`; rotates `query` and `key` in place."""
    lib = _load()
    if (
        lib is None
        or not (_rows_contiguous(query) and _rows_contiguous(key))
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
    ):
        from pagoda.kernels.torch_ref.layers import rotary_embedding as reference

        return reference(positions, query, key, cos_sin_cache, is_neox_style)
    positions = _int64(positions)
    lib["rotary_embedding_f32"](
        positions.data_ptr(),
        query.data_ptr(),
        key.data_ptr(),
        cos_sin_cache.data_ptr(),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        query.shape[2],
        cos_sin_cache.shape[1],
        query.stride(0),
        key.stride(0),
        int(is_neox_style),
    )
    return query, key


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `pagoda.kernels.torch_ref.attention.reshape_and_cache` (float32 rows, CPU; a float32 or
    float16 cache)."""
    lib = _load()
    function = None
    if lib is not None and key.dtype == value.dtype == torch.float32 and key_cache.dtype == value_cache.dtype:
        if key_cache.dtype == torch.float32:
            function = lib["reshape_and_cache_f32"]
        elif key_cache.dtype == torch.float16:
            function = lib.get("reshape_and_cache_f16kv")  # (compilers without _Float16 have none)
    if (
        function is None
        or not (_rows_contiguous(key) and _rows_contiguous(value))
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        from pagoda.kernels.torch_ref.attention import reshape_and_cache as reference

        return reference(key, value, key_cache, value_cache, slot_mapping)
    slot_mapping = _int64(slot_mapping)
    function(
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        key.stride(0),
        value.stride(0),
    )


# Which way a quantized linear runs (`path`), by its number of input rows M; crossovers measured on
# SmolLM2's shapes (one thread, against each other and fp32 in the same run), the C paths described in
# quantized_matmul.c:
# - "fused" (1-2 rows; 8-bit: 1-3): every weight block widened in registers once per tile of input
#   rows, scales applied per group; 2-2.6x the fp32 matmul at one row (it reads 1/4-1/8 of the bytes);
# - "batch" (batched decode, from _BATCH_ROWS): register tiles of 6 input rows x 3 weight rows, each
#   weight vector widened and scaled in registers once for the tile's input rows. At 8-16 rows, 1.0-1.3x
#   fp32 for 8-bit weights (per channel: scaled once per output) and 0.95-1.15x for 4-bit groups of 32;
#   up to 64-128 rows it still beats dequantizing for oneDNN;
# - "int8" (where the CPU has VNNI and `int8_activations` is on), from 2 rows on: input rows quantized
#   to int8 per row, integer dot products. 8-bit weights: 1.5-2.5x the fp32 matmul's speed here at any
#   row count. 4-bit weights in groups of 128 columns: ~1.4x the float path at any row count; in groups
#   of 64: ~1.1-1.3x below _INT4_G64_ROWS, slower beyond (the per-group float work eats the gain); other
#   groups: float. One row (single-stream decode) always keeps float activations. (These ratios were
#   measured against the float path before "batch" replaced its dequantized strips, which were
#   1.1-1.3x slower than "batch" at 8-16 rows.);
# - "tiles" (prefill, from _ONEDNN_ROWS): _TILE_FLOATS of dequantized weight at a time, multiplied by
#   oneDNN (this machine's fastest float32 matmul, 2x MKL's here) into the output columns of that tile:
#   its cache blocking wins once the input rows no longer fit the caches beside the weight tile.
_BATCH_ROWS = {4: 3, 8: 4}
_INT4_G64_ROWS = 32  # 4-bit weights in 64-column groups: from here on, the float paths are faster
_ONEDNN_ROWS = {4: 128, 8: 256}
_TILE_FLOATS = 1 << 17  # 512 KiB of dequantized weight per oneDNN tile
_THREADED_WORK = 1 << 16  # multiply-adds below which one thread is faster than waking the others
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_tile = torch.empty(0)
_q8_units: dict[int, int] = {}  # columns per integer vector, by library
# The "int8" path is opt-in (pagoda.kernels.configure): it changes results with the batch a row is in.
int8_activations = False


def quantized_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `pagoda.kernels.quantized.reference_linear` (float32 activations on the CPU)."""
    lib = _load()
    if (
        lib is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or packed.data.device.type != "cpu"
        or (bias is not None and bias.dtype != torch.float32)
    ):
        return reference_linear(x, packed, bias)
    return _quantized_linear(lib, x, packed, bias)


def path(lib, rows: int, packed: PackedWeight) -> str:
    """How `rows` input rows go through `packed` with `lib`: "fused", "batch", "int8" or "tiles"."""
    if rows >= 2 and _int8_activations_pay(lib, rows, packed):
        return "int8"
    if rows >= _ONEDNN_ROWS[packed.bits]:
        return "tiles"
    return "fused" if rows < _BATCH_ROWS[packed.bits] else "batch"


def _int8_activations_pay(lib, rows: int, packed: PackedWeight) -> bool:
    if not int8_activations:
        return False
    key = id(lib["quantized_linear_f32"])
    if key not in _q8_units:  # (a library built without VNNI has no integer path)
        _q8_units[key] = lib["quantized_q8_unit"]() if "quantized_q8_unit" in lib else 0
    unit = _q8_units[key]
    if not unit:
        return False
    if packed.bits == 8:  # one group per row, or groups of whole vectors
        return (
            packed.group_size % unit == 0
            and packed.padded_in_features % unit == 0
            and (packed.num_groups == 1 or packed.group_size >= 2 * unit)
        )
    return packed.group_size % 128 == 0 or (packed.group_size % 64 == 0 and rows < _INT4_G64_ROWS)


def _mins_f32(packed: PackedWeight) -> int:
    """The C kernels read raw pointers to `pagoda.kernels.quantized.pack`'s layout: contiguous float16 scales,
    and mins contiguous in float16 or float32 (this flag tells them which). Checked on every call, cheaply:
    the C code would read anything else as garbage."""
    scales, mins = packed.scales, packed.mins
    if (
        scales.dtype != torch.float16
        or not scales.is_contiguous()
        or (mins is not None and (mins.dtype not in (torch.float16, torch.float32) or not mins.is_contiguous()))
    ):
        raise ValueError(
            f"packed scales {scales.dtype} / mins {None if mins is None else mins.dtype}: the CPU kernel takes "
            "contiguous float16 scales and float16 or float32 mins (build packed weights with "
            "pagoda.kernels.quantized.pack)"
        )
    return int(mins is not None and mins.dtype == torch.float32)


def _quantized_linear(lib, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    mins_f32 = _mins_f32(packed)
    k, kp, n = packed.in_features, packed.padded_in_features, packed.out_features
    if packed.perm is not None:
        x = x.index_select(-1, packed.perm)
    rows = x.reshape(-1, k)
    if kp != k:  # the kernels read whole 32-column blocks: the padding columns must be zero
        rows = torch.nn.functional.pad(rows, (0, kp - k))
    elif rows.stride(-1) != 1 or rows.stride(0) < kp:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    way = path(lib, m, packed)
    if way == "tiles":
        _tiled_matmul(lib, rows, packed, bias, out, mins_f32)
        return out.reshape(*x.shape[:-1], n)
    threads = torch.get_num_threads() if m * n * kp >= _THREADED_WORK else 1
    weight = [
        packed.data.data_ptr(),
        packed.scales.data_ptr(),
        0 if packed.mins is None else packed.mins.data_ptr(),
        0 if bias is None else bias.data_ptr(),
    ]
    sizes = [m, n, kp, packed.num_groups, packed.group_size, packed.bits, rows.stride(0), n]
    if way == "int8":  # workspace: per-row scales, per-group sums, then the int8 rows
        workspace = _scratch(
            lib["quantized_q8_workspace"](m, kp, packed.num_groups, packed.group_size, packed.bits, threads)
        )
        lib["quantized_linear_q8_f32"](
            rows.data_ptr(), *weight, out.data_ptr(), workspace.data_ptr(), *sizes, threads, mins_f32
        )
    else:
        batched = int(way == "batch")
        if batched:  # workspace: each thread's output buffer and its chunk's scales and offsets
            workspace = _scratch(lib["quantized_batch_workspace"](m, packed.num_groups, threads))
        else:  # workspace: the group sums of x
            workspace = _scratch(m * packed.num_groups)
        lib["quantized_linear_f32"](
            rows.data_ptr(), *weight, out.data_ptr(), workspace.data_ptr(), *sizes, batched, threads, mins_f32
        )
    return out.reshape(*x.shape[:-1], n)


def _matmul_rows(count: int) -> int:
    """Rows a oneDNN matmul runs at: oneDNN builds and caches a primitive (megabytes each) per shape,
    so row counts are rounded to few sizes, as engine_core/layers/linear.py's `onednn_rows` does for the
    float32 linears (the padding rows are zeros, their outputs dropped)."""
    return -(-count // 8) * 8 if count <= 128 else -(-count // 64) * 64


def _tiled_matmul(lib, rows: torch.Tensor, packed: PackedWeight, bias, out: torch.Tensor, mins_f32: int) -> None:
    """out = rows W^T (+ bias), one tile of dequantized weight rows at a time (never all of W)."""
    global _tile
    kp, n, m = packed.padded_in_features, packed.out_features, rows.shape[0]
    step = max(16, _TILE_FLOATS // kp // 16 * 16)
    if _tile.numel() < step * kp:
        _tile = torch.empty(step * kp, dtype=torch.float32)
    if _ONEDNN and _matmul_rows(m) != m:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, _matmul_rows(m) - m))
    threads = torch.get_num_threads()
    for start in range(0, n, step):
        stop = min(start + step, n)
        w = _tile[: (stop - start) * kp].view(stop - start, kp)
        lib["quantized_dequantize_f32"](
            packed.data.data_ptr(),
            packed.scales.data_ptr(),
            0 if packed.mins is None else packed.mins.data_ptr(),
            w.data_ptr(),
            n,
            kp,
            packed.num_groups,
            packed.group_size,
            packed.bits,
            start,
            stop,
            threads,
            mins_f32,
        )
        b = None if bias is None else bias[start:stop]
        if _ONEDNN:
            out[:, start:stop] = torch.ops.mkldnn._linear_pointwise(rows, w, b, "none", [], "")[:m]
        elif b is None:
            torch.mm(rows, w.t(), out=out[:, start:stop])
        else:
            torch.addmm(b, rows, w.t(), out=out[:, start:stop])


def panel_linear(
    x: torch.Tensor, weight: panels.PanelWeight, bias: torch.Tensor | None = None, bulk_rows_from: int | None = None
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.panels.reference_linear` (float32 on the CPU: kernels/cpu/panel_matmul.c;
    with `bulk_rows_from`, those rows on Intel's AMX where the CPU has it: kernels/cpu/amx_matmul.c)."""
    lib = _load()
    if lib is None or x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return panels.reference_linear(x, weight, bias)
    return _panel_linear(lib, x, weight, bias, bulk_rows_from)


# Bulk rows may use AMX (pagoda.kernels.configure). A model's projections, one call per weight, SmolLM2's 30
# layers on two threads (benchmarks/kernel_ops.py --only dense, docs/decode-speed.md): panel matmul against
# AMX, 1 row 14.2 / 26.5 ms (AMX splits every weight into bf16 pieces on each call), 64 rows 39.1 / 36.4,
# 128 rows 72.4 / 56.9, 512 rows 276 / 190. The engine sends it long prompts' rows only.
amx = True
_amx_works: bool | None = None  # (the kernel's answer to one small call, once per process)


def amx_used() -> bool:
    """Whether the panel linear's bulk rows run on AMX in this process: the switch is on, the kernels
    built, and the AMX kernel computes (the CPU has AMX and Linux lets the process use it)."""
    global _amx_works
    lib = _load()
    if not amx or lib is None:
        return False
    if _amx_works is None:
        weight = panels.PanelWeight.pack(torch.ones(32, 32))
        x, out = torch.ones(1, 32), torch.empty(1, 32)
        _amx_works = bool(
            lib["amx_linear_f32"](x.data_ptr(), weight.data.data_ptr(), None, out.data_ptr(), 1, 32, 32, 1)
        )
    return _amx_works


def _panel_linear(
    lib, x: torch.Tensor, weight: panels.PanelWeight, bias: torch.Tensor | None, bulk_rows_from: int | None = None
) -> torch.Tensor:
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:  # (the C kernel would read past the rows)
        raise ValueError(f"panel_linear: input has {x.shape[-1]} features, the weight takes {k}")
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # (the model's calls are 2-D: no reshape op)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n) if x.dim() == 2 else (*x.shape[:-1], n), dtype=torch.float32)
    bias_pointer = None if bias is None else bias.data_ptr()
    split = m if bulk_rows_from is None or not amx else max(0, min(bulk_rows_from, m))
    if split < m:  # (the bulk rows, contiguous at the end)
        threads = torch.get_num_threads()
        offset_in, offset_out = split * k * 4, split * n * 4
        done = lib["amx_linear_f32"](
            rows.data_ptr() + offset_in,
            weight.data.data_ptr(),
            bias_pointer,
            out.data_ptr() + offset_out,
            m - split,
            k,
            n,
            threads,
        )
        if not done:  # (the kernel refused: no AMX after all, or no memory)
            split = m
    if split:
        threads = torch.get_num_threads() if split * k * n >= _THREADED_WORK else 1
        lib["panel_linear_f32"](
            rows.data_ptr(), weight.data.data_ptr(), bias_pointer, out.data_ptr(), split, k, n, threads
        )
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.sampling.argmax_rows` (kernels/cpu/argmax.c): 64 rows of 49,152
    logits on two threads, 0.24 ms (0.70 from DRAM, as the LM head leaves them) against torch's max 0.82
    (2.18) and argmax 2.0."""
    lib = _load()
    usable = logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1
    # (no values: the reference raises torch's error; the kernel counts a row's indices in 32 bits)
    if lib is None or not usable or not 0 < logits.shape[1] < 2**31:
        from pagoda.kernels.torch_ref.sampling import argmax_rows as reference

        return reference(logits)
    return _argmax_rows(lib, logits)


def _argmax_rows(lib, logits: torch.Tensor) -> torch.Tensor:
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        lib["argmax_rows_f32"](logits.data_ptr(), out.data_ptr(), rows, n, logits.stride(0), torch.get_num_threads())
    return out


# The norms and activation, dispatched to by name like the kernels above (imported last: that module
# uses this one's loader).
from pagoda.kernels.cpu.layer_ops import fused_add_rms_norm as fused_add_rms_norm  # noqa: E402
from pagoda.kernels.cpu.layer_ops import rms_norm as rms_norm  # noqa: E402
from pagoda.kernels.cpu.layer_ops import silu_and_mul as silu_and_mul  # noqa: E402
