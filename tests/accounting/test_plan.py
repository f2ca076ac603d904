"""The memory planner on the paper's configurations, by-hand parts, and its errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_scale.errors import UserError
from moe_scale.accounting.plan import Cluster, plan, smallest_fitting

K40 = 12.0


def k40s(gpus: int, optimizer: str = "factored", zero: int = 2) -> Cluster:
    return Cluster(1, gpus, K40, zero, optimizer)


def test_the_two_largest_100b_models_need_64_and_128_k40s_with_the_factored_optimizer():
    # MoE-131072-h: 1024 experts (1.07B parameters) per GPU on 128 K40s fits; on 64 it cannot
    assert plan("news100b-moe-131072-h", k40s(128))["fits"]
    assert not plan("news100b-moe-131072-h", k40s(64))["fits"]
    assert smallest_fitting("news100b-moe-131072-h", k40s(1))["world"] == 128
    # MoE-65536-h: on 64 K40s as the paper trained it (its secondary gates sharded with their groups' experts;
    # replicated, their 0.25 GiB per GPU put it over 12 GiB); not on the 32 GPUs the smaller models used
    assert smallest_fitting("news100b-moe-65536-h", k40s(1))["world"] == 64
    assert not plan("news100b-moe-65536-h", k40s(32))["fits"]
    assert smallest_fitting("news100b-moe-16384-h", k40s(1))["world"] == 32


def test_hierarchical_secondary_gates_are_counted_with_the_experts():
    """a·2·d·b secondary parameters split over the expert-parallel ranks, the rest of the gate replicated."""
    one, many = plan("news100b-moe-65536-h", k40s(64, zero=0)), plan("news100b-moe-65536-h", k40s(128, zero=0))
    secondary = 256 * 2 * 512 * 256
    experts = 65536 * 2 * 512 * 1024
    dense = one["params_per_gpu"] - (experts + secondary) // 64
    assert many["params_per_gpu"] == dense + (experts + secondary) // 128


def test_adam_instead_of_the_factored_optimizer_does_not_fit_the_largest():
    assert not plan("news100b-moe-131072-h", k40s(128, "adam"))["fits"]


def test_expert_state_by_hand():
    result = plan("news100b-moe-131072-h", k40s(128, zero=0))
    experts_per_gpu = 131072 // 128
    expert_params = experts_per_gpu * 2 * 512 * 1024
    assert result["experts_per_gpu"] == experts_per_gpu
    dense = result["params_per_gpu"] - expert_params
    assert result["bytes"]["parameters"] == 4 * (dense + expert_params)
    assert result["bytes"]["gradients"] == 4 * (dense + expert_params)
    # factored: a row and a column vector per expert matrix; Adam (m, v) on the dense parameters
    assert result["bytes"]["optimizer_state"] == 8 * dense + experts_per_gpu * 2 * (512 + 1024) * 4


def test_zero_partitions_dense_state_over_the_world():
    z0, z2 = plan("lm1b-moe-32", k40s(16, "adam", 0)), plan("lm1b-moe-32", k40s(16, "adam", 2))
    experts_here = 2 * 2 * 512 * 1024              # 32 experts over 16 GPUs: each expert on one GPU only
    dense = z0["params_per_gpu"] - experts_here
    assert z0["bytes"]["optimizer_state"] == 8 * (dense + experts_here)
    assert z2["bytes"]["optimizer_state"] == pytest.approx(8 * dense / 16 + 8 * experts_here)
    assert z2["bytes"]["parameters"] == z0["bytes"]["parameters"]


def test_activations_shrink_with_the_cluster_at_a_fixed_batch():
    small, large = plan("lm1b-moe-256", k40s(16)), plan("lm1b-moe-256", k40s(32))
    assert large["bytes"]["activations"] == pytest.approx(small["bytes"]["activations"] / 2)


@pytest.mark.parametrize("cluster,message", [
    (Cluster(0, 8, 80.0), "at least 1"),
    (Cluster(1, 8, -1.0), "--gpu-mem"),
    (Cluster(1, 8, 80.0, 3), "ZeRO stage 3"),
    (Cluster(1, 8, 80.0, 5), "ZeRO stages"),
    (Cluster(3, 8, 80.0), "does not divide the 256 experts"),
    (Cluster(4, 8, 80.0), "16 expert groups"),           # lm1b-moe-256-h: 16 groups, 32 GPUs
])
def test_impossible_clusters_are_clear_errors(cluster, message):
    with pytest.raises(UserError, match=message):
        plan("lm1b-moe-256-h" if "groups" in message else "lm1b-moe-256", cluster)


def test_plan_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moe_scale", "plan", "--preset", "news100b-moe-131072-h",
                           "--nodes", "16", "--gpus-per-node", "4", "--gpu-mem", "12", "--zero", "2",
                           "--optimizer", "factored"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "does NOT fit" in proc.stdout and "smallest that fits: 32 node(s) x 4 = 128 GPUs" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "moe_scale", "plan", "--preset", "lm1b-moe-256", "--nodes", "3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("moe-scale: error:") and "divide" in bad.stderr
