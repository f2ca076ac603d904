"""moe_scale: sparsely-gated mixture-of-experts language models on DeepSpeed."""

import os

# Expert gradients are fresh multi-GB tensors every step; with 4 KiB pages the first write to each page
# faults. Transparent huge pages for torch's large CPU allocations cut that cost several-fold (read by
# torch at its first allocation, so it must be set before torch allocates; a user's setting wins).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# Freed activations stay with the process for the next step rather than coming back as fresh, zero-filled
# pages (moe_scale/host_memory.py says why and when not).
from moe_scale.host_memory import keep_freed_memory  # noqa: E402

keep_freed_memory()

__version__ = "0.1.0"
