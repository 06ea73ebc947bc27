"""Building and loading the compiled CPU kernels: C sources built once with the system C compiler and loaded
with ctypes.

Built on first use into `settings.build_dir` (the engine sets it to `$PAGODA_CACHE/kernels/`; keyed by the
source, compiler flags and machine), in about a second. Where no compiler works, `available()` is
False and the torch reference is used.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
    "moe": ["-fopenmp"],
    "mxfp4": ["-fopenmp"],
    "gated_delta": [*_FAST_MATH, "-fopenmp"],  # (the delta rule's sums may be reassociated, as attention's)
    "decoder": ["-fopenmp"],  # (calls the others' kernels through pointers: its own flags are its own ops')
}
_POINTER, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention_f32": [_POINTER] * 7 + [_I64] * 8 + [_F32, _I64],
    "paged_decode_attention_options_f32": [_POINTER] * 7 + [_I64] * 8 + [_F32, _I64, _POINTER, _F32],
    "paged_decode_attention_f16kv": [_POINTER] * 7 + [_I64] * 8 + [_F32, _I64],  # only where the CPU has F16C
    "paged_decode_attention_workspace": [_I64] * 3,
    # (last: sinks or NULL, softcap or 0)
    "varlen_attention_f32": [_POINTER] * 6 + [_I64] * 10 + [_F32, _I64, _POINTER, _F32],
    "varlen_attention_workspace": [_I64] * 3,
    "paged_prefill_attention_f32": [_POINTER] * 8 + [_I64] * 9 + [_F32, _I64, _POINTER, _F32],
    "rotary_embedding_f32": [_POINTER] * 4 + [_I64] * 8,
    "reshape_and_cache_f32": [_POINTER] * 5 + [_I64] * 4,
    "reshape_and_cache_f16kv": [_POINTER] * 5 + [_I64] * 4,
    "quantized_linear_f32": [_POINTER] * 7 + [_I64] * 11,
    "quantized_dequantize_f32": [_POINTER] * 4 + [_I64] * 9,
    "quantized_linear_q8_f32": [_POINTER] * 7 + [_I64] * 10,  # only where the CPU has VNNI
    "quantized_q8_supported": [_I64] * 3,
    "quantized_q8_workspace": [_I64] * 4,
    "quantized_batch_workspace": [_I64] * 3,
    "panel_linear_f32": [_POINTER] * 4 + [_I64] * 4,
    "amx_linear_f32": [_POINTER] * 4 + [_I64] * 4,
    "rms_norm_f32": [_POINTER] * 3 + [_I64] * 5 + [_F32, _I64],
    "add_rms_norm_f32": [_POINTER] * 5 + [_I64] * 2 + [_F32, _I64],
    "silu_and_mul_f32": [_POINTER] * 2 + [_I64] * 3,
    "argmax_rows_f32": [_POINTER] * 2 + [_I64] * 4,
    "moe_f32": [_POINTER] * 5 + [_I64] + [_POINTER] * 7 + [_I64] * 3,
    "moe_quantized_f32": [_POINTER] * 5 + [_I64] + [_POINTER] * 14 + [_I64] * 3,
    "moe_q8_workspace": [_I64] * 7,  # only where the CPU has VNNI
    "moe_mxfp4_f32": [_POINTER] * 5 + [_I64] + [_POINTER] * 9 + [_I64] * 3,
    "moe_workspace": [_I64] * 9,
    "mxfp4_dequantize_f32": [_POINTER] * 3 + [_I64] * 2,
    "gated_delta_rule_f32": [_POINTER] * 9 + [_I64] * 10,
    "causal_conv1d_f32": [_POINTER] * 7 + [_I64] * 6,
    "gdn_gating_f32": [_POINTER] * 6 + [_I64] * 4,
    "rms_norm_gated_f32": [_POINTER] * 4 + [_I64] * 5 + [_F32, _I64],
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
    "quantized_q8_supported": _I64,
    "quantized_q8_workspace": _I64,
    "quantized_batch_workspace": _I64,
    "moe_workspace": _I64,
    "moe_q8_workspace": _I64,
    "moe_f32": ctypes.c_int,
    "moe_quantized_f32": ctypes.c_int,
    "moe_mxfp4_f32": ctypes.c_int,
}


@dataclass
class Settings:
    """The switches `pagoda.kernels.ops.configure` sets. One object, read by the op modules at each call, so a
    change takes effect from the next call on."""

    # Where the libraries are built: a directory per user under the system's temporary directory by default.
    build_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / f"pagoda-kernels-{os.getuid()}")
    # The quantized linear's "int8" path (quantized_matmul.py): off for direct kernel users; the engine turns
    # it on (EngineConfig.int8_activations).
    int8_activations: bool = False
    # The panel linear's bulk rows may use AMX (panel_matmul.py).
    amx: bool = True


settings = Settings()
_lib: dict[str, Callable[..., None]] = {}  # C function name -> the ctypes function
_failed = False
_failure = ""  # why the libraries could not be built (the warning's cause), for `failure()`


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc on PATH (None: none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(name: str) -> Path:
    source_path = _DIR / f"{name}.c"
    flags = _COMMON_FLAGS + _LIBRARIES[name]
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found: CC is not set, and neither cc nor gcc is on PATH")
    key = hashlib.sha256(  # (another compiler, or CC set to one with other flags, builds its own copy)
        source_path.read_bytes()
        + b"".join(header.read_bytes() for header in sorted(_DIR.glob("*.h")))  # (what the sources include)
        + " ".join([cc, *flags]).encode()
        + platform.machine().encode()
        + _cpu_signature()
    ).hexdigest()[:16]
    target = settings.build_dir / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([cc, *flags, str(source_path), "-o", str(built), "-lm"], check=True, capture_output=True)
            built.rename(target)  # atomic: concurrent builders never load a half-written library
    return target


def _cpu_signature() -> bytes:
    try:
        return next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).encode()
    except OSError:
        return b""


def load() -> dict[str, Callable[..., None]] | None:
    """Every C function by name, or None (after one warning) if the libraries cannot be built."""
    global _failed, _failure
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
            _failed, _failure = True, _why(exc)
            # One line, once per process (`_failed`): a server without a compiler works, only slower, and
            # its operator needs the cause and the fix, not a line per library or per call.
            logger.warning(
                "C kernels unavailable (%s): running on the torch reference kernels, which are slower. To fix: "
                "install a C compiler (gcc; on Debian or Ubuntu `apt-get install build-essential`) or set CC to one",
                _failure,
            )
    return _lib or None


def _why(exc: Exception) -> str:
    """The cause in a few words: for a failed compile, the compiler's last line of errors rather than its
    whole command line."""
    if isinstance(exc, subprocess.CalledProcessError):
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        lines = [line for line in stderr.splitlines() if line.strip()]
        return f"{exc.cmd[0]} failed{': ' + lines[-1] if lines else ''}"
    return str(exc)


def available() -> bool:
    return load() is not None


def failure() -> str:
    """Why the C kernels are unavailable ("" while they load or have not been tried)."""
    return _failure
