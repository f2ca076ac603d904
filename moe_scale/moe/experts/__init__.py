"""Experts: every local expert's FFN as grouped products.

    ffn.py           GroupedExperts (stacked weights) and their fused FFN autograd function
    swiglu.py        the same function for SwiGLU experts (Mixtral's)
    grouped_gemm.py  the per-expert products and the kernel each device runs (native CPU, grouped GEMM, Triton)
"""

from moe_scale.moe.experts.ffn import GradientBuffers, GroupedExperts, expert_ffn, grouped_matmul, row_dot
from moe_scale.moe.experts.swiglu import swiglu_expert_ffn

__all__ = ["GradientBuffers", "GroupedExperts", "expert_ffn", "grouped_matmul", "row_dot", "swiglu_expert_ffn"]
