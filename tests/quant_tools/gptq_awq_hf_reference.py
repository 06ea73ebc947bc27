"""What HF transformers makes of a GPTQ or AWQ checkpoint (run by the tests in .venv-gptq: transformers
loads both formats through GPTQModel's kernels, and its CPU kernels need GPTQModel and optimum).

    gptq_awq_hf_reference.py MODEL PROMPTS.json OUT.pt --max-tokens 32 [--dequantize name,name,...]

Writes a torch file with `tokens` (greedy continuations, EOS not stopping them), `first_logprobs`
(float32 [prompts, vocab], log-softmax of the first step's logits) and, for GPTQ, `dequantized`:
GPTQModel's own `dequantize_weight()` of the named linears, [out, in] float32.

Kernels: GPTQModel's plain torch kernels ("torch" for GPTQ, "torch_awq" for AWQ), chosen explicitly:
its default CPU kernels run the matmul in bfloat16. The GPTQ torch kernel computes scale * (q - zero)
in the scales' dtype and multiplies in the activations' (float32): with the checkpoint's float16 scales
that rounds every weight to float16, so the scales are upcast (exactly) to float32 after loading, and
the weights are then exact, as Pagoda's are. The AWQ torch kernel casts the activations to float16
whatever the scales; it is left as it is (the tests compare it loosely, and strictly against the
float32 weights of AutoAWQ's own dequantization).
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
from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dequantize", default="")
    args = parser.parse_args()
    qcfg = json.loads((Path(args.model) / "config.json").read_text())["quantization_config"]
    if qcfg["quant_method"] == "gptq":
        loading = GPTQConfig(bits=qcfg["bits"], backend="torch")
    else:
        loading = AwqConfig(bits=qcfg["bits"], backend="torch_awq")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, device_map="cpu", quantization_config=loading
    ).eval()
    if qcfg["quant_method"] == "gptq":
        for module in model.modules():
            if hasattr(module, "qweight") and hasattr(module, "dequantize_weight"):
                module.scales = module.scales.float()
    prompts = json.loads(Path(args.prompts).read_text())
    tokens, first = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        first.append(torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1))
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_tokens,
            do_sample=False,
            repetition_penalty=1.0,
            eos_token_id=None,
            pad_token_id=None,
        )
        tokens.append(out[0, len(prompt) :].tolist())
    dequantized = {}
    for name in filter(None, args.dequantize.split(",")):
        module = model.get_submodule(name)  # its scales in float32 (above): scale * (q - zero) is exact
        dequantized[name] = module.dequantize_weight().float().t().contiguous()
    torch.save({"tokens": tokens, "first_logprobs": torch.stack(first), "dequantized": dequantized}, args.out)


if __name__ == "__main__":
    main()
