"""Quantization: which method stores a model's linears, chosen once at load.

`--quantization auto` (the default) takes what the checkpoint says (`quantization_config` in
config.json, or the GGUF file's tensor types); `none` refuses a quantized checkpoint; a checkpoint
format's name must match the checkpoint; `int8` / `int4` / `fp8` quantize a full-precision checkpoint at
load. Each method is a `QuantizationMethod` (base.py) in its own module; the loader and the layers know
only that interface. This module imports no torch (the frontends read CHOICES); methods load lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.engine_core.quantization.base import QuantizationMethod

# Formats a checkpoint declares in `quantization_config.quant_method` -> "module:class" implementing it.
CHECKPOINT_FORMATS: dict[str, str] = {
    "awq": "pagoda.engine_core.quantization.awq:AWQ",
    "gptq": "pagoda.engine_core.quantization.gptq:GPTQ",
    "compressed-tensors": "pagoda.engine_core.quantization.compressed_tensors:CompressedTensors",
    "fp8": "pagoda.engine_core.quantization.fp8:Fp8Checkpoint",
    # A .gguf file's model directory declares it (engine_core/gguf_model.py) when the file has quantized linears.
    "gguf": "pagoda.engine_core.quantization.gguf:GGUFMethod",
}
# Methods that quantize a full-precision checkpoint at load.
AT_LOAD: dict[str, str] = {
    "int8": "pagoda.engine_core.quantization.at_load:Int8AtLoad",
    "int4": "pagoda.engine_core.quantization.at_load:Int4AtLoad",
    "fp8": "pagoda.engine_core.quantization.fp8:Fp8AtLoad",
}
# Formats only a model family's experts use, which that family's model stores itself (no linear is
# quantized): the architectures that read each.
EXPERT_FORMATS: dict[str, tuple[str, ...]] = {"mxfp4": ("GptOssForCausalLM",)}  # engine_core/models/gpt_oss.py
CHOICES = ("auto", "none", *sorted(set(CHECKPOINT_FORMATS) | set(AT_LOAD)))


def checkpoint_method_name(config: dict) -> str | None:
    """The quantization a config.json declares, normalised (None: full precision)."""
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if not qcfg:
        return None
    name = str(qcfg.get("quant_method") or qcfg.get("format") or "unknown").lower()
    return {"compressed_tensors": "compressed-tensors"}.get(name, name)


def resolve_method(flag: str, config: dict) -> QuantizationMethod | None:
    """The method for `--quantization flag` and this checkpoint's config.json (None: full precision),
    or a ValueError naming what is supported."""
    declared = checkpoint_method_name(config)
    if flag not in CHOICES:
        raise ValueError(f"unknown --quantization {flag!r}; choose one of {', '.join(CHOICES)}")
    if declared in EXPERT_FORMATS:
        _check_expert_format(declared, flag, config)
        return None  # (the linears load at full precision; the model stores its experts itself)
    if declared is not None and flag in AT_LOAD and flag != declared:
        raise ValueError(
            f"the checkpoint is already quantized with {declared!r}; --quantization {flag} cannot quantize it "
            "again (use auto)"
        )
    if declared is not None and flag == "none":
        raise ValueError(f"the checkpoint is quantized with {declared!r}: --quantization none cannot load it")
    if declared is not None and declared not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"the checkpoint is quantized with {declared!r}, which Pagoda does not load; "
            f"supported: {', '.join(sorted(CHECKPOINT_FORMATS)) or 'none yet'}"
        )
    if declared is not None and flag not in ("auto", declared):
        raise ValueError(
            f"the checkpoint is already quantized with {declared!r}; --quantization {flag} cannot load it (use auto)"
        )
    if declared is None and flag in CHECKPOINT_FORMATS and flag not in AT_LOAD:
        raise ValueError(
            f"--quantization {flag}: the checkpoint is not quantized with it (its config.json has no "
            f"quantization_config); to quantize at load use one of {', '.join(sorted(AT_LOAD))}"
        )
    name = declared if declared is not None else (flag if flag in AT_LOAD else None)
    if name is None:
        return None
    target = CHECKPOINT_FORMATS.get(name) if declared is not None else AT_LOAD[name]
    assert target is not None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return (
        cls.from_config(config.get("quantization_config") or config.get("compression_config") or {})
        if (declared is not None)
        else cls()
    )


def _check_expert_format(declared: str, flag: str, config: dict) -> None:
    """A checkpoint whose experts alone are quantized (`EXPERT_FORMATS`): anything but `--quantization auto`
    is refused, as is an architecture that does not read the format."""
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in EXPERT_FORMATS[declared]:
        raise ValueError(
            f"the checkpoint is quantized with {declared!r}, which Pagoda loads for "
            f"{', '.join(EXPERT_FORMATS[declared])} only, not {architecture}"
        )
    if flag != "auto":
        raise ValueError(
            f"the checkpoint's experts are quantized with {declared!r}; --quantization {flag} cannot load or "
            "requantize it (use auto)"
        )
