"""HF transformers on a quantized checkpoint: the reference the compressed-tensors / FP8 tests compare with
(run by .venv-llmcompressor's python: it has compressed-tensors, which transformers needs to read them).

    hf_reference.py --model DIR --prompts prompts.json --max-tokens N --out DIR [--quantize-activations]

Writes DIR/tokens.json (greedy tokens per prompt, EOS not stopping) and DIR/logits.safetensors (the
first step's logits, [prompts, vocab] float32). The weights are decompressed at load. Pagoda serves
W8A8 checkpoints weight-only, so by default compressed-tensors' fake quantization of the activations
is switched off; --quantize-activations keeps it (what the checkpoint's recipe means on a W8A8 kernel).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file


def load(model_dir: str, quantize_activations: bool):
    config = json.loads((Path(model_dir) / "config.json").read_text())
    method = config["quantization_config"]["quant_method"]
    if method == "compressed-tensors":
        qconfig = transformers.CompressedTensorsConfig(dequantize=True)
    elif method == "fp8":
        fp8 = config["quantization_config"]
        qconfig = transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=fp8.get("weight_block_size"), scale_fmt=fp8.get("scale_fmt", "float")
        )
    else:
        raise SystemExit(f"no HF reference for {method}")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=qconfig
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


if __name__ == "__main__":
    main()
