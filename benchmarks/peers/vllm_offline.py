"""vLLM's offline `LLM.generate` on a workload from benchmarks/throughput.py, in vLLM's own venv.

Run by `python benchmarks/throughput.py --vllm VENV` (which writes the workload to a JSON file and
sets the environment benchmarks/peers/vllm_cpu.sh uses). Not a Pagoda module: it imports nothing of
ours but benchmarks/offline_timing.py (by its path), and vLLM. Its result is the stdout line that
starts with RESULT.

    VENV/bin/python benchmarks/peers/vllm_offline.py --model DIR --workload work.json
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
from pathlib import Path

# vllm-cpu's platform detection reads the version of a distribution named "vllm" and needs "+cpu" in
# it (see benchmarks/peers/vllm_cpu.sh).
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def _offline_timing():
    """benchmarks/offline_timing.py, loaded by its path: this runs in vLLM's venv, without our packages."""
    path = Path(__file__).resolve().parents[1] / "offline_timing.py"
    spec = importlib.util.spec_from_file_location("offline_timing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON: [[prompt token ids, output length], ...]")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workload) as f:
        work = json.load(f)
    llm = LLM(args.model, dtype="float32", max_model_len=2048, enable_prefix_caching=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    result = _offline_timing().timed_generate(llm, prompts, params, SamplingParams(temperature=0.0, max_tokens=4), work)
    print("RESULT " + json.dumps(result), flush=True)  # (vLLM logs to stdout too)


if __name__ == "__main__":
    main()
