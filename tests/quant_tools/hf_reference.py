"""HF transformers on a quantized checkpoint: the reference the quantized formats' tests compare Pagoda with.
Run by the tool venv whose transformers reads the format: .venv-llmcompressor for compressed-tensors and FP8
(it has compressed-tensors), .venv-gptq for GPTQ and AWQ (transformers reads them through GPTQModel's
kernels, which need GPTQModel and optimum).

    hf_reference.py --model DIR --prompts prompts.json --max-tokens N --out DIR
                    [--quantize-activations] [--dequantize name,name,...]

Writes DIR/tokens.json (greedy tokens per prompt, EOS not stopping) and DIR/logits.safetensors (the first
step's logits, [prompts, vocab] float32); with --dequantize (GPTQ), DIR/dequantized.safetensors: GPTQModel's
own `dequantize_weight()` of the named linears, [out, in] float32.

compressed-tensors / FP8: the weights are decompressed at load. Pagoda serves W8A8 checkpoints weight-only,
so by default compressed-tensors' fake quantization of the activations is switched off;
--quantize-activations keeps it (what the checkpoint's recipe means on a W8A8 kernel).

GPTQ / AWQ: GPTQModel's plain torch kernels ("torch" for GPTQ, "torch_awq" for AWQ), chosen explicitly: its
default CPU kernels run the matmul in bfloat16. The GPTQ torch kernel computes scale * (q - zero) in the
scales' dtype and multiplies in the activations' (float32): with the checkpoint's float16 scales that rounds
every weight to float16, so the scales are upcast (exactly) to float32 after loading, and the weights are
then exact, as Pagoda's are. The AWQ torch kernel casts the activations to float16 whatever the scales; it
is left as it is (the tests compare it loosely, and strictly against the float32 weights of AutoAWQ's own
dequantization).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # see make_gptq.py
# GPTQModel wraps its torch kernels in torch.compile, which recompiles for every new sequence length
# (minutes on this CPU for a few prompts); eager mode runs the same code.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import transformers
from safetensors.torch import save_file


def load(model_dir: str, quantize_activations: bool):
    qcfg = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    method = qcfg["quant_method"]
    if method in ("gptq", "awq"):
        loading = (
            transformers.GPTQConfig(bits=qcfg["bits"], backend="torch")
            if method == "gptq"
            else transformers.AwqConfig(bits=qcfg["bits"], backend="torch_awq")
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, device_map="cpu", quantization_config=loading
        ).eval()
        if method == "gptq":
            for module in model.modules():
                if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
                    module.scales = module.scales.float()
        return model
    if method == "compressed-tensors":
        loading = transformers.CompressedTensorsConfig(dequantize=True)
    elif method == "fp8":
        loading = transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=qcfg.get("weight_block_size"), scale_fmt=qcfg.get("scale_fmt", "float")
        )
    else:
        raise SystemExit(f"no HF reference for {method}")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=loading
    ).eval()
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = quantize_activations
    return model


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quantize-activations", action="store_true")
    parser.add_argument("--dequantize", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load(args.model, args.quantize_activations)
    prompts = json.loads(args.prompts.read_text())
    tokens, logits = [], []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        logits.append(model(input_ids).logits[0, -1].float())
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.max_tokens,
            do_sample=False,
            repetition_penalty=1.0,
            eos_token_id=None,
            pad_token_id=None,
        )
        tokens.append(out[0, len(prompt) :].tolist())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokens.json").write_text(json.dumps(tokens))
    save_file({"logits": torch.stack(logits).contiguous()}, str(args.out / "logits.safetensors"))
    if args.dequantize:
        # the scales in float32 (load): scale * (q - zero) is exact
        dequantized = {
            name: model.get_submodule(name).dequantize_weight().float().t().contiguous()
            for name in args.dequantize.split(",")
        }
        save_file(dequantized, str(args.out / "dequantized.safetensors"))


if __name__ == "__main__":
    main()
