"""Quantize a Hugging Face model directory with GPTQModel (run by the tests in .venv-gptq, not in Pagoda's venv).

    make_gptq.py SRC OUT --calibration ids.json --bits 4 --group-size 64 [--asym] [--desc-act] [--format gptq_v2]

The calibration file is a JSON list of token-id lists (the tests tokenize a few bundled texts, or draw
random ids for a tiny random model): no dataset is downloaded. OUT is written by GPTQModel's own `save`.
"""

from __future__ import annotations

import argparse
import json
import os

# GPTQModel sizes its CPU thread pools from the core count and refuses a pool of one worker on a
# two-core machine; the loader needs two.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

from gptqmodel import GPTQModel, QuantizeConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--format", default="gptq", choices=["gptq", "gptq_v2"])
    args = parser.parse_args()
    with open(args.calibration) as f:
        calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in json.load(f)]
    config = QuantizeConfig(
        bits=args.bits,
        group_size=args.group_size,
        sym=not args.asym,
        desc_act=args.desc_act,
        format=args.format,
        # GPTQModel's default "act group aware" ordering needs groups; per channel (-1) it is refused.
        act_group_aware=None if args.group_size > 0 else False,
        # Pack in memory with the reference packer (pack_original): the default offloads every module to
        # disk and packs in threads, four times slower on two cores for the same tensors.
        offload_to_disk=False,
        pack_impl="original",
    )
    model = GPTQModel.load(args.src, config, device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(args.out)


if __name__ == "__main__":
    main()
