"""AutoAWQ's own dequantization of an AWQ (GEMM) checkpoint (run by the tests in .venv-awq).

    awq_dequantize.py MODEL OUT name,name,...

Writes OUT/dequantized.pt ({name: float32 [out, in]} for the named linears) and OUT/float32: the same
model with every quantized linear replaced by its float32 weight, a plain checkpoint without
`quantization_config`. Both come from `awq.utils.packing_utils.dequantize_gemm`, with the scales upcast
from float16 (exactly) so that scale * (q - zero) is computed in float32: exact, comparable bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from awq.utils.packing_utils import dequantize_gemm
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("names")
    args = parser.parse_args()
    model, out = Path(args.model), Path(args.out)
    config = json.loads((model / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                tensors[key] = f.get_tensor(key)
    linears = sorted({key.rpartition(".")[0] for key in tensors if key.endswith(".qweight")})
    weights = {}
    for name in linears:
        qweight, qzeros = tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.qzeros")
        scales = tensors.pop(f"{name}.scales").float()
        weights[name] = dequantize_gemm(qweight, qzeros, scales, qcfg["bits"], qcfg["group_size"]).float().t()
    out.mkdir(parents=True, exist_ok=True)
    torch.save({name: weights[name].contiguous() for name in args.names.split(",")}, out / "dequantized.pt")
    float_dir = out / "float32"
    float_dir.mkdir()
    plain = {key: tensor.float() for key, tensor in tensors.items()}
    plain.update({f"{name}.weight": weight.contiguous() for name, weight in weights.items()})
    save_file(plain, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    (float_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in model.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json" and extra.name[0] != ".":
            shutil.copy(extra, float_dir / extra.name)


if __name__ == "__main__":
    main()
