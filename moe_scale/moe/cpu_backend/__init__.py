"""The optional native CPU backend: C kernels for the experts' products (cpu_kernels.c), the noisy gate
(cpu_gating.c) and its normal noise (cpu_noise.c), built on first use by kernels.py. Without a C compiler, or
with MOE_SCALE_NATIVE_KERNELS=0, everything runs on torch's ops instead."""
