"""Quantize a Hugging Face model directory with AutoAWQ, GEMM version (run by the tests in .venv-awq).

    make_awq.py SRC OUT --calibration ids.json --group-size 128

The calibration file is a JSON list of token-id lists (no dataset is downloaded). AutoAWQ drops samples
longer than its sequence length, concatenates the rest and cuts them into blocks of that length.
"""

from __future__ import annotations

import argparse
import json

import torch
from awq import AutoAWQForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    with open(args.calibration) as f:
        calibration = json.load(f)
    # float32: this CPU has no fast float16 matmul, and AWQ's scale search runs the layers many times.
    model = AutoAWQForCausalLM.from_pretrained(args.src, torch_dtype=torch.float32)
    quant_config = {"zero_point": True, "q_group_size": args.group_size, "w_bit": 4, "version": "GEMM"}
    model.quantize(
        None,  # the tokenizer: only needed for text calibration
        quant_config=quant_config,
        calib_data=calibration,
        max_calib_seq_len=args.seq_len,
        n_parallel_calib_samples=None,
    )
    model.save_quantized(args.out)


if __name__ == "__main__":
    main()
