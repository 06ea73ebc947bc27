"""Write a quantized test checkpoint with the real tools (run by .venv-llmcompressor's python, not .venv's).

    make_checkpoint.py --source DIR --scheme NAME --out DIR

compressed-tensors schemes go through llmcompressor's `oneshot` with a round-to-nearest
`QuantizationModifier` (no calibration data), lm_head left out (`ignore`), as its examples do. SmolLM2's
576 / 1536 columns are not multiples of 128, so the groups are 64 columns (the preset W4A16 would refuse).
`fp8-block` is a `quant_method: fp8` checkpoint (DeepSeek-V3 / Qwen-FP8 style): E4M3 `weight` plus a
float32 `weight_scale_inv` per 64x64 block (32x32 where a dimension is not a multiple of 64);
`fp8-block-ue8m0` stores those scales as powers of two in one byte (DeepSeek-V4 style). transformers
quantizes to FP8 only on a GPU, so its own `Fp8Quantize` conversion op (what `save_pretrained` of an
FP8 model runs) makes these tensors.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch
import transformers

_INT4_GROUP = dict(num_bits=4, type="int", strategy="group", group_size=64)
_DYNAMIC_TOKEN_INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
_DYNAMIC_TOKEN_FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)

# scheme -> compressed-tensors QuantizationScheme fields (llmcompressor picks the format from them:
# int weights alone -> pack-quantized, with int activations -> int-quantized, float -> float-quantized)
SCHEMES = {
    "w4a16": dict(weights=dict(_INT4_GROUP, symmetric=True)),
    "w4a16-asym": dict(weights=dict(_INT4_GROUP, symmetric=False)),
    "w8a16": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "w8a16-asym": dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="channel")),
    "w8a8": dict(
        weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"), input_activations=_DYNAMIC_TOKEN_INT8
    ),
    "fp8-channel": dict(
        weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        input_activations=_DYNAMIC_TOKEN_FP8,
    ),
    "fp8-tensor": dict(
        weights=dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), input_activations=_DYNAMIC_TOKEN_FP8
    ),
    # llmcompressor's FP8_BLOCK preset: 128x128 weight blocks (partial ones at SmolLM2's 576 edges), and
    # activations per group of 128
    "fp8-ct-block": dict(
        weights=dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
        input_activations=dict(
            num_bits=8, type="float", symmetric=True, strategy="group", group_size=128, dynamic=True
        ),
    ),
}
FP8_BLOCKS = (64, 32)  # square blocks: the largest that tiles every projection (transformers' op needs that)
FP8_BLOCK_SCALES = {"fp8-block": "float", "fp8-block-ue8m0": "ue8m0"}  # scheme -> scale_fmt


def load_source(source: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    has_tokenizer = (Path(source) / "tokenizer_config.json").exists()
    return model, transformers.AutoTokenizer.from_pretrained(source) if has_tokenizer else None


def write_compressed_tensors(model, scheme: str, out: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    group = dict(targets=["Linear"], **SCHEMES[scheme])
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"]))
    if SCHEMES[scheme]["weights"]["type"] == "int":
        # Integer weights' scales as float16 values (still float32 tensors): what a checkpoint of a half-
        # precision model holds, and what Pagoda's packed layout stores (kernels/quantized.py), so that HF
        # and Pagoda multiply by the same weights. (The model here is float32, so llmcompressor's scales are.)
        for module in model.modules():
            scale = getattr(module, "weight_scale", None)
            if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32:
                scale.data.copy_(scale.data.half().float())
    model.save_pretrained(out, save_compressed=True)


def write_fp8_block(model, out: Path, scale_fmt: str) -> None:
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    projections = {n: t for n, t in model.state_dict().items() if ".layers." in n and n.endswith("_proj.weight")}
    side = next(b for b in FP8_BLOCKS if all(d % b == 0 for t in projections.values() for d in t.shape))
    block = [side, side]
    config = transformers.FineGrainedFP8Config(
        weight_block_size=block, modules_to_not_convert=["lm_head"], scale_fmt=scale_fmt
    )
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    model.save_pretrained(out)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in projections:
            pair = quantize.convert({name: tensor})
            assert pair[name].dtype == torch.float8_e4m3fn, name
            tensors.update(pair)
        elif name != "lm_head.weight" or not model.config.tie_word_embeddings:
            tensors[name] = tensor.contiguous()
    for old in out.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_path = out / "config.json"
    data = json.loads(config_path.read_text())
    data["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
        "modules_to_not_convert": ["lm_head"],
        "scale_fmt": scale_fmt,
    }
    config_path.write_text(json.dumps(data, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, help="a model directory (in full precision)")
    parser.add_argument("--scheme", required=True, choices=[*SCHEMES, *FP8_BLOCK_SCALES])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    model, tokenizer = load_source(args.source)
    write(model, tokenizer, args.scheme, args.out)


def write(model, tokenizer, scheme: str, out: Path) -> None:
    if scheme in FP8_BLOCK_SCALES:
        write_fp8_block(model, out, FP8_BLOCK_SCALES[scheme])
    else:
        write_compressed_tensors(model, scheme, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
