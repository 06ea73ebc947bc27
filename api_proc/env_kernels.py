"""`pagoda env`'s view of the kernels: which implementation of each op the engine would pick in this
process, on the CPU and (where there is one) on CUDA, and why.

The kernels are configured exactly as the engine configures them (`configure_kernels`: the PAGODA_DISABLE_*
switches and the build directory under PAGODA_CACHE), so the C kernels are built here, on first use, where
the engine would build them, and a report made after a switch was set shows what the engine would run.
"""

from __future__ import annotations

from typing import Any

from pagoda.api_proc.env_machine import probe
from pagoda.engine_core import environment

REFERENCE = "torch reference"


def kernels_section() -> dict[str, Any]:
    import torch

    from pagoda.kernels import cpu, ops

    environment.configure_kernels()
    cpu_device = torch.device("cpu")
    switches = _disabled_switches()
    section: dict[str, Any] = {
        "c_kernels": probe(lambda: _c_kernels(cpu, switches)),
        "build_dir": str(environment.cache_root() / "kernels"),
        "amx_for_panel_linear": probe(lambda: _amx(switches)),
        "disabled_by_environment": ", ".join(f"{name}={value}" for name, value in switches.items()) or "none",
        "cpu_ops": {name: probe(lambda name=name: pick(name, cpu_device)) for name in ops.op_names()},
    }
    if torch.cuda.is_available():
        cuda_device = torch.device("cuda")
        section["cuda_ops"] = {name: probe(lambda name=name: pick(name, cuda_device)) for name in ops.op_names()}
    else:
        section["cuda_ops"] = "none (no GPU)"
    return section


def pick(name: str, device) -> str:
    """What runs op `name` on `device`: "C", "Triton", "torch (CUDA native)" or the torch reference, and
    the function's qualified name."""
    from pagoda.kernels import ops

    function = ops.implementation(name, device)
    qualified = f"{function.__module__}.{function.__qualname__}"
    if not ops.compiled(name, device):
        kind = REFERENCE
    elif function.__module__.startswith("pagoda.kernels.cpu"):
        kind = "C"
    elif function.__module__.startswith("pagoda.kernels.triton"):
        kind = "Triton"
    else:
        kind = "torch (CUDA native)"
    return f"{kind} ({qualified})"


def _c_kernels(cpu, switches: dict[str, str]) -> str:
    """Whether the C kernels build and load here, and if not, the loader's reason (the caller's `probe`
    reports an exception)."""
    if not cpu.available():
        return f"not available: {cpu.failure() or 'the loader gave no reason'}"
    if switches.get("PAGODA_DISABLE_CPU_KERNELS") == "1":
        return "built and loaded, but not used (PAGODA_DISABLE_CPU_KERNELS=1)"
    return "built and loaded"


def _amx(switches: dict[str, str]) -> str:
    """Whether the float32 panel linear's bulk rows (long prompts' projections) run on Intel's AMX, and if
    not, why not."""
    import torch

    from pagoda.kernels import ops

    cpu_device = torch.device("cpu")
    if ops.bulk_rows_differ(cpu_device):
        return "yes"
    if switches.get("PAGODA_DISABLE_AMX") == "1":
        return "no (PAGODA_DISABLE_AMX=1)"
    if not ops.compiled("panel_linear", cpu_device):
        return "no (the panel linear runs the torch reference here)"
    return "no (this CPU has no AMX, or Linux does not let this process use it)"


def _disabled_switches() -> dict[str, str]:
    """The PAGODA_DISABLE_* variables set in this process, by name."""
    return {
        name: value
        for name, value in sorted(environment.pagoda_environment().items())
        if name.startswith("PAGODA_DISABLE_")
    }
