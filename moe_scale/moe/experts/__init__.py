"""Experts: every local expert's FFN as grouped products.

    kinds.py         what one expert computes (ReLU, SwiGLU, GeGLU): width, init, activation, scale, FLOPs
    ffn.py           GroupedExperts (stacked weights) and the one fused FFN autograd function for every kind
    grouped_gemm.py  the per-expert products and the kernel each device runs (native CPU, grouped GEMM, Triton)
"""

from moe_scale.moe.experts.ffn import GradientBuffers, GroupedExperts, expert_ffn, grouped_matmul
from moe_scale.moe.experts.grouped_gemm import row_dot
from moe_scale.moe.experts.kinds import EXPERT_KINDS, ExpertKind, expert_kind

__all__ = ["EXPERT_KINDS", "ExpertKind", "GradientBuffers", "GroupedExperts", "expert_ffn", "expert_kind",
           "grouped_matmul", "row_dot"]
