"""GGUF files for the tests, written with the `gguf` package (its quantizers and writer) from the
default model's own Q4_1 file: the same metadata (tokenizer, chat template), its weights dequantized
and quantized again to other types. Files the slow tests share are kept in the model cache."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagoda.engine_core.default_model import convert_gguf_to_hf, ensure_default_gguf
from pagoda.engine_core.environment import cache_root

TEST_MODELS = "test-models-gguf"  # under cache_root()


def write_gguf(
    path: Path,
    source: GGUFReader | None,
    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]],
    overrides: dict[str, tuple[object, GGUFValueType]] | None = None,
) -> None:
    """A GGUF file at `path` with `source`'s metadata (some keys replaced by `overrides`; no source: the
    overrides alone, general.architecture among them) and `tensors` (name, array rows first, type to store it as)."""
    overrides = dict(overrides or {})
    fields = source.fields if source is not None else {}
    arch = overrides.pop("general.architecture")[0] if source is None else fields["general.architecture"].contents()
    writer = GGUFWriter(str(path), str(arch))
    for name, field in fields.items():
        if name.startswith("GGUF."):
            continue  # the header's own counts, written by the writer
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        if name in overrides:
            value, value_type = overrides.pop(name)
            sub_type = None
        else:
            value = field.contents()
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for name, (value, value_type) in overrides.items():
        writer.add_key_value(name, value, value_type)
    for name, array, ggml_type in tensors:
        # uint8: blocks already in `ggml_type` (e.g. a type the gguf package cannot quantize to)
        data = array if array.dtype == np.uint8 else quantize(np.ascontiguousarray(array, np.float32), ggml_type)
        raw_dtype = None if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else ggml_type
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def requantized(source_path: Path, choose: Callable[[str], GGMLQuantizationType]) -> list:
    """The tensors of `source_path`, dequantized and quantized again as `choose(name)` says (1-D
    tensors stay F32)."""
    reader = GGUFReader(str(source_path))
    out = []
    for t in reader.tensors:
        dense = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        out.append((t.name, dense, GGMLQuantizationType.F32 if dense.ndim == 1 else choose(t.name)))
    return out


def smollm2_as(name: str, choose: Callable[[str], GGMLQuantizationType]) -> Path:
    """SmolLM2 (the default model's Q4_1 weights) written as another GGUF, kept in the cache."""
    target = cache_root() / TEST_MODELS / f"SmolLM2-135M-Instruct.{name}.gguf"
    if target.exists():
        return target
    source = ensure_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write_gguf(staging / target.name, GGUFReader(str(source)), requantized(source, choose))
        (staging / target.name).rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def float32_dir(gguf_path: Path) -> Path:
    """The float32 Hugging Face directory of a test GGUF (its exact dequantization), kept in the cache."""
    target = gguf_path.with_name(gguf_path.stem + "-float32")
    if target.exists():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


TINY_VOCAB = 512  # (tiny_models' vocabulary: a file's own tokenizer with as many tokens)


def tiny_tokenizer_metadata() -> dict:
    """A byte-level BPE tokenizer of TINY_VOCAB tokens, as llama.cpp's keys hold one: the 256 bytes (in GPT-2's
    spelling), then the merges of 16 x 16 pairs of them. (SmolLM2's 49,152 tokens would take the file's
    tokenizer seconds to read at every new file.)"""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    letters = alphabet[ord("a") : ord("a") + 16]
    pairs = [(a, b) for a in letters for b in letters]
    tokens = alphabet + [a + b for a, b in pairs]
    assert len(tokens) == TINY_VOCAB
    array = GGUFValueType.ARRAY
    return {
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING),
        "tokenizer.ggml.tokens": (tokens, array),
        "tokenizer.ggml.token_type": ([1] * TINY_VOCAB, array),
        "tokenizer.ggml.merges": ([f"{a} {b}" for a, b in pairs], array),
        "tokenizer.ggml.bos_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (1, GGUFValueType.UINT32),
    }
