"""The MoE layer's GPU path, counted on CPU (tools/count_ops.py): the operations of a step do not grow with the
number of experts or tokens; the forward reads the device once where rows are exchanged (the counts the all-to-all
needs), never on one rank, and the backward never (structure, not time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from op_count import OpCounter, blocks_host
from moe_scale.moe.kernel_policy import KernelPolicy
from tests.paths import TOOLS

TOOL = TOOLS / "count_ops.py"
MAX_OPS = 400
MAX_KERNEL_OPS = {"flat": 120, "hierarchical": 230}


@pytest.fixture(scope="module")
def count_ops(load_tool):
    return load_tool("count_ops")


@pytest.mark.parametrize("gate", ["flat", "hierarchical"])
def test_ops_do_not_grow_with_experts_or_tokens(count_ops, gate):
    counts = {(e, n, k): count_ops.count_step(gate, e, n, k, 1, 0, 8, 16)
              for e in (16, 64, 512) for n in (256, 1024) for k in (1, 2)}
    for (e, n, k), c in counts.items():
        assert c["host_syncs_forward"] == 0 and c["host_syncs_backward"] == 0, (e, n, k, c["syncs"])   # one rank
        # experts: 2 forward, 4 backward, for every expert at once; the hierarchical gate's secondary logits and
        # noise scales of the picked groups: 2 forward, 4 backward, for every group at once
        assert c["grouped_gemm_calls"] == (6 if gate == "flat" else 12), (e, n, k)
    for k in (1, 2):   # up to 16 experts the gate's two products are one (a few operations more): no growth
        ops = [c["ops"] for (e, n, kk), c in counts.items() if kk == k]
        assert max(ops) - min(ops) <= 6, (gate, k, ops)
    # what launches work on a GPU: 115 (flat) and 223 (hierarchical) kernels per layer step when last measured
    assert max(c["kernel_ops"] for c in counts.values()) <= MAX_KERNEL_OPS[gate]
    if gate == "flat":   # the hierarchical gate runs two gates: about 160 operations more, ~120 of them kernels
        assert max(c["ops"] for c in counts.values()) <= MAX_OPS


def test_more_experts_than_one_grouped_call_takes_add_calls_not_loops(count_ops):
    """Beyond the grouped GEMM's group limit (1,023 on a GPU; 16 here) each further block of experts adds one
    call per product and a few slices: ops grow with E / limit, never with E. Placing the calls' row boundaries
    takes the one read of the counts (on one rank, where no exchange reads them, only then)."""
    split = KernelPolicy(native_cpu=False, gate_chunk_rows=None, max_groups=16)
    base = count_ops.count_step("flat", 16, 512, 2, 1, 0, 8, 16, split)
    for experts, calls in ((64, 4), (256, 16)):
        c = count_ops.count_step("flat", experts, 512, 2, 1, 0, 8, 16, split)
        assert c["grouped_gemm_calls"] == 6 * calls
        assert c["ops"] - base["ops"] <= 25 * calls, (experts, c["ops"], base["ops"])
        assert c["host_syncs_forward"] == 1 and c["host_syncs_backward"] == 0
    assert base["host_syncs_forward"] == 0   # within the limit: none
    # the hierarchical gate's experts (8 groups of 8 here) split at group edges: still one read in the forward
    c = count_ops.count_step("hierarchical", 64, 512, 2, 1, 0, 8, 16, split)
    assert c["grouped_gemm_calls"] == 6 + 6 * 4 and c["host_syncs_forward"] == 1 and c["host_syncs_backward"] == 0


# Size: 8 experts, 256 tokens on 2 ranks, the tool's own processes: the counts do not depend on the size.
@pytest.mark.multiprocess
def test_two_ranks_through_the_tool(tmp_path):
    out = tmp_path / "ops.jsonl"
    proc = subprocess.run([sys.executable, str(TOOL), "--experts", "8", "--tokens", "256", "--k", "2", "--gates",
                           "flat", "--ranks", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"experts", "tokens", "k", "gate", "ranks", "ops", "host_syncs_forward", "host_syncs_backward"} <= set(row)
    assert (row["experts"], row["ranks"], row["gate"]) == (8, 2, "flat")
    assert row["host_syncs_forward"] == 1 and row["host_syncs_backward"] == 0 and row["ops"] <= MAX_OPS
    assert row["kernel_ops"] < row["ops"]


@pytest.mark.parametrize("flags, fragment", [(["--experts", "0"], "--experts"), (["--gates", "tree"], "--gates"),
                                             (["--k", "9", "--experts", "8"], "--k 9"),
                                             (["--out", "/nonexistent/x.jsonl"], "--out")])
def test_bad_flags_are_one_line(count_ops, flags, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        count_ops.parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.tensor([3, 0, 2])
    with OpCounter() as counter:
        x.nonzero(), x.tolist(), int(x[0]), torch.repeat_interleave(x), x[x > 0], torch.bincount(x, minlength=4)
        torch.repeat_interleave(x, output_size=5), torch.arange(3).repeat_interleave(2), x.sort()   # none of these
    assert counter.syncs == {"nonzero": 1, "Tensor.tolist": 1, "_local_scalar_dense": 1, "repeat_interleave": 1,
                             "index": 1, "bincount": 1}
    assert torch.Tensor.tolist is not None and x.tolist() == [3, 0, 2]   # patched back
    assert blocks_host("histc", "default", (x.float(), 10, 0, 0), {}) and \
        not blocks_host("histc", "default", (x.float(), 10, 0, 5), {})


def test_cases_too_big_for_this_machine_are_reported_as_skipped(count_ops, monkeypatch, capsys):
    monkeypatch.setattr(count_ops, "_available_memory", lambda: 2**30)
    assert count_ops.main(["--experts", "4096", "--tokens", "32768", "--k", "2", "--gates", "flat",
                           "--ranks", "1"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "ops" not in row and "host memory" in row["skipped"] and row["experts"] == 4096


def test_the_hierarchical_gate_needs_no_tokens_by_experts_memory(count_ops):
    """Its widest gate tensors are [N, A] and [N*Kp, G]: the 4,096 x 2 ranks x 32,768 case runs here."""
    flat = count_ops.memory_needed("flat", 32768, 4096, 2)
    hierarchical = count_ops.memory_needed("hierarchical", 32768, 4096, 2)
    assert flat > 20 * 2**30 and hierarchical * 20 < flat
