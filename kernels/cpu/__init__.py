"""Compiled CPU kernels: C sources built once with the system C compiler and loaded with ctypes (loader.py),
each op's Python side in the module of its kind:

- attention.py: paged decode attention, whole-sequence (varlen) attention, paged prefill attention;
- elementwise.py: rotary embedding and the KV-cache write;
- layer_ops.py: RMSNorm (alone and fused with the residual add) and SiLU-and-mul;
- quantized_matmul.py: linears with quantized weights;
- panel_matmul.py: float32 linears with weights in panels, on AMX where there is one;
- moe.py: the fused mixture-of-experts (float32 experts in panels, or quantized);
- argmax.py: the greedy pick;
- mxfp4.py: MXFP4 expert weights to float32 (gpt-oss);
- gated_delta.py: Gated DeltaNet's conv1d, delta rule, gating and gated norm (Qwen3.5's linear attention);
- decoder.py: a decode step's decoder layers as one C call.

`pagoda.kernels.ops` dispatches to the ops by name from here and sets `settings`.
"""

from pagoda.kernels.cpu.argmax import argmax_rows as argmax_rows
from pagoda.kernels.cpu.attention import paged_decode_attention as paged_decode_attention
from pagoda.kernels.cpu.attention import paged_prefill_attention as paged_prefill_attention
from pagoda.kernels.cpu.attention import varlen_attention as varlen_attention
from pagoda.kernels.cpu.elementwise import reshape_and_cache as reshape_and_cache
from pagoda.kernels.cpu.elementwise import rotary_embedding as rotary_embedding
from pagoda.kernels.cpu.gated_delta import causal_conv1d as causal_conv1d
from pagoda.kernels.cpu.gated_delta import gated_delta_rule as gated_delta_rule
from pagoda.kernels.cpu.gated_delta import gdn_gating as gdn_gating
from pagoda.kernels.cpu.gated_delta import rms_norm_gated as rms_norm_gated
from pagoda.kernels.cpu.layer_ops import fused_add_rms_norm as fused_add_rms_norm
from pagoda.kernels.cpu.layer_ops import rms_norm as rms_norm
from pagoda.kernels.cpu.layer_ops import silu_and_mul as silu_and_mul
from pagoda.kernels.cpu.loader import available as available
from pagoda.kernels.cpu.loader import failure as failure
from pagoda.kernels.cpu.loader import load as load
from pagoda.kernels.cpu.loader import settings as settings
from pagoda.kernels.cpu.moe import fused_moe as fused_moe
from pagoda.kernels.cpu.mxfp4 import mxfp4_dequantize as mxfp4_dequantize
from pagoda.kernels.cpu.panel_matmul import amx_used as amx_used
from pagoda.kernels.cpu.panel_matmul import panel_linear as panel_linear
from pagoda.kernels.cpu.quantized_matmul import path as path
from pagoda.kernels.cpu.quantized_matmul import quantized_linear as quantized_linear
