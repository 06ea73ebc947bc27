"""compressed-tensors' own decompression of some linears of a checkpoint (run by .venv-llmcompressor's
python): the independent unpacker our loader's dequantized weights are checked against.

    ct_decompress.py --model DIR --modules model.layers.0.mlp.down_proj,... --out FILE.safetensors

For each module, its checkpoint tensors (`weight_packed`, `weight_scale`, ...) go through the
compressor registered for the checkpoint's format (`pack-quantized`, `int-quantized`, ...), and the float
weight it returns is saved under the module's name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--modules", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    config = QuantizationConfig.model_validate(
        json.loads((args.model / "config.json").read_text())["quantization_config"]
    )
    (group,) = config.config_groups.values()  # the test checkpoints have one scheme
    compressor = BaseCompressor.get_value_from_registry(group.format or config.format)
    weights = {}
    with safe_open(str(args.model / "model.safetensors"), framework="pt") as f:
        for module in args.modules.split(","):
            state = {k.removeprefix(module + "."): f.get_tensor(k) for k in f.keys() if k.startswith(module + ".")}  # noqa: SIM118
            weights[module] = compressor.decompress(state, group)["weight"].contiguous()
    save_file(weights, str(args.out))


if __name__ == "__main__":
    main()
