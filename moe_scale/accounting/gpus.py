"""The GPUs the planner knows: memory, dense peaks, memory and link bandwidths, and the stated compute efficiency.

Every number is a vendor figure or a stated assumption; docs/scale.md gives each one's source (most are
collected, with their sources, in the project's GPU research notes; the rest cite NVIDIA's datasheets by name).
Conventions:

- `memory_gib`: what CUDA reports as the device's total (nvidia-smi), not the marketing GB.
- `bf16_tflops`: dense tensor-core peak (no 2:4 sparsity); None where the GPU has no bf16 (K40, V100).
- `fp32_tflops`: the rate fp32 training runs at. `moe-scale train` sets `float32_matmul_precision("high")` on
  CUDA, so on GPUs with TF32 tensor cores (A100 and later) that is the dense TF32 peak; else the FP32 peak.
- `hbm_gbs`: memory bandwidth (GB/s) — the optimizer step is bound by it.
- `intra_gbs`: GPU-to-GPU bandwidth inside a node, per GPU and direction (half the bidirectional NVLink figure;
  PCIe where there is no NVLink). `inter_gbs`: the default network bandwidth per GPU and direction between
  nodes (one NIC per GPU of the usual server of that GPU; `--inter-node-gbs` overrides it).
- `efficiency`: the share of the peak the model's FLOPs are assumed to run at (docs/scale.md says why); a narrow
  matrix product runs at less (`small_gemm`: accounting/kernels.py's curve, from the peak and `hbm_gbs`).
- `launch_s`: what one kernel launch costs (the floor under a step of many small kernels: accounting/kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_scale.errors import UserError

# All-to-all and all-reduce reach this share of a link's bandwidth: NCCL's all-to-all moves ~38–46 GB/s per GPU
# over 50 GB/s NICs, and ~370 of NVLink 4's 450 GB/s per direction (GPU research notes §3).
LINK_EFFICIENCY = 0.8
# Latency of one collective: ~11 µs inside an NVLink node, ~100 µs across nodes (torch all_to_all_single, one
# token per GPU: 96–132 µs at EP16–128), and what each further peer adds (GPU research notes §3c).
INTRA_LATENCY_S, INTER_LATENCY_S, PER_PEER_LATENCY_S = 11e-6, 90e-6, 0.3e-6
# The optimizer step streams its state at this share of the memory bandwidth (STREAM-like kernels).
HBM_EFFICIENCY = 0.8
# Tensor-core GPUs: fine-grained MoE models reach 15–35% of the bf16 peak on NVIDIA's tuned stack, coarse experts
# ~47% (GPU research notes §1b); moe_scale has no GPU measurement yet, so the planner takes the top of the first.
TENSOR_CORE_EFFICIENCY = 0.35
# GPUs without tensor cores (fp32 SIMT): large SGEMMs run at 60-80% of the peak; the model as a whole lower.
SIMT_EFFICIENCY = 0.6
# One kernel launch from the host, one after another: ~3 µs of bare cuLaunchKernel (GB200, meta-pytorch/tritonbench
# #1017), 5.6 µs for a trivial elementwise kernel launched in a loop and ~11 µs for a small GEMM (H20,
# flagos-ai/FlagGems#5291), 9.4 µs of host time per kernel in eager PyTorch and 6.8 under torch.compile (DGX H100,
# NVIDIA/Fuser#3507), and at least 7 µs per operator in a cost model fitted on H100 (meta-pytorch/autoparallel#146).
# The planner takes 5 µs: above the driver's bare cost, below eager PyTorch's (a floor, not an estimate of the host
# time), the same on every GPU of the table (the cost is the host's and the driver's, not the chip's).
LAUNCH_S = 5e-6


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float | None
    fp32_tflops: float
    hbm_gbs: float
    intra_gbs: float
    inter_gbs: float
    efficiency: float
    gpus_per_node: int = 8          # the usual server
    nvls: bool = False              # NVLink SHARP (NVSwitch, H100 and later): NCCL reserves more per communicator
    cuda: bool = True               # False: a CPU "device" (the calibration's), without CUDA context or NCCL
    intra_latency_s: float = INTRA_LATENCY_S
    inter_latency_s: float = INTER_LATENCY_S
    per_peer_latency_s: float = PER_PEER_LATENCY_S
    link_efficiency: float = LINK_EFFICIENCY
    hbm_efficiency: float = HBM_EFFICIENCY
    step_overhead_s: float = 0.0    # a fixed cost per step at this device's rate (CPU: measured; GPU: none assumed)
    reduce_gbs: float | None = None         # a measured all-reduce (the CPU calibration's gloo); None: the links'
    straggler: float = 0.0          # the wait for the slowest rank, a share of the compute (GPU: none assumed)
    reduce_latency_s: float | None = None
    launch_s: float = LAUNCH_S      # one kernel launch (0: no launch floor, as on the CPU calibration's device)
    small_gemm: bool = True         # narrow products run below `efficiency` (False: the CPU calibration's device,
    #                                 whose efficiency is measured with the model's own products)

    def peak_tflops(self, precision: str) -> float:
        if precision == "bf16":
            if self.bf16_tflops is None:
                raise UserError(f"--precision bf16: the {self.name} has no bf16 units; plan it with --precision "
                                f"fp32")
            return self.bf16_tflops
        return self.fp32_tflops

    def with_memory(self, gib: float | None) -> "GPU":
        return self if gib is None else replace(self, memory_gib=gib)


GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in [
    GPU("k40", 11.17, None, 4.29, 288, 10.0, 1.25, SIMT_EFFICIENCY, gpus_per_node=4),
    GPU("v100", 32.0, None, 15.7, 900, 150.0, 6.25, SIMT_EFFICIENCY),
    GPU("a100-40", 40.0, 312.0, 156.0, 1555, 300.0, 25.0, TENSOR_CORE_EFFICIENCY),
    GPU("a100-80", 80.0, 312.0, 156.0, 2039, 300.0, 25.0, TENSOR_CORE_EFFICIENCY),
    GPU("h100-sxm", 79.65, 989.4, 494.7, 3350, 450.0, 50.0, TENSOR_CORE_EFFICIENCY, nvls=True),
    GPU("h100-pcie", 79.65, 756.0, 378.0, 2000, 64.0, 25.0, TENSOR_CORE_EFFICIENCY),
    GPU("h200", 140.40, 989.4, 494.7, 4800, 450.0, 50.0, TENSOR_CORE_EFFICIENCY, nvls=True),
    GPU("b200", 179.06, 2250.0, 1100.0, 7700, 900.0, 50.0, TENSOR_CORE_EFFICIENCY, nvls=True),
    GPU("gh200", 95.58, 989.4, 494.7, 4000, 450.0, 50.0, TENSOR_CORE_EFFICIENCY, gpus_per_node=4),
    GPU("l40s", 44.99, 362.0, 183.0, 864, 32.0, 12.5, TENSOR_CORE_EFFICIENCY),
]}


def get_gpu(name: str) -> GPU:
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise UserError(f"--gpu {name}: unknown GPU; the table has {', '.join(GPUS)} (docs/scale.md gives their "
                        f"numbers and sources)")
    return gpu
