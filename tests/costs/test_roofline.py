"""The roofline model: hand-checked bounds, the ridge point, monotone tables, current shipped files."""

from dataclasses import replace
from itertools import pairwise

import pytest

from specpipe.costs.profile import CostProfile
from specpipe.costs.roofline import (
    DEVICES,
    H100_80GB,
    LINKS,
    LLAMA_31_70B,
    LLAMA_32_1B,
    PROFILES_DIR,
    SHIPPED,
    build,
    head_ms,
    layer_ms,
    layer_work,
    profile_filename,
    roofline_profile,
)


def test_parameter_counts_match_the_published_sizes():
    # Meta publishes 70.6B and 1.24B parameters.
    assert LLAMA_31_70B.params / 1e9 == pytest.approx(70.55, abs=0.01)
    assert LLAMA_32_1B.params / 1e9 == pytest.approx(1.236, abs=0.001)


def test_one_row_70b_layer_on_h100_is_weight_bandwidth_bound():
    h, i, q, kv = 8192, 28672, 64 * 128, 8 * 128
    weights = 2 * (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h)  # bf16 bytes
    by_hand = weights / (3350e9 * 0.80) * 1e3 + 10 * 0.004  # + 10 kernels of 4 us
    work = layer_work(LLAMA_31_70B, 1, 256)
    assert H100_80GB.memory_ms(work.bytes) > 50 * H100_80GB.compute_ms(work.flops)
    assert layer_ms(H100_80GB, LLAMA_31_70B, 1, 256) == pytest.approx(by_hand, rel=0.002)
    assert by_hand == pytest.approx(0.679, abs=0.001)


def test_doubling_bandwidth_halves_the_memory_bound_time():
    fast = replace(H100_80GB, bandwidth_gbs=2 * H100_80GB.bandwidth_gbs)
    overhead = 10 * H100_80GB.kernel_us / 1e3
    for n in (1, 8, 32):
        slow_ms = layer_ms(H100_80GB, LLAMA_31_70B, n, 1024) - overhead
        fast_ms = layer_ms(fast, LLAMA_31_70B, n, 1024) - overhead
        assert fast_ms == pytest.approx(slow_ms / 2, rel=1e-9)


@pytest.mark.parametrize("device", list(DEVICES))
def test_compute_becomes_the_bound_near_the_flops_to_bandwidth_ratio(device):
    d = DEVICES[device]
    # In bf16 a weight is 2 bytes and 2 flops per row: weights alone cross over at n = ratio rows;
    # activations, KV and attention add a little to both sides, moving it up by under 15%.
    ratio = (d.bf16_tflops * d.flops_eff * 1e12) / (d.bandwidth_gbs * d.bandwidth_eff * 1e9)

    def compute_bound(n):
        w = layer_work(LLAMA_31_70B, n, 1024)
        return d.compute_ms(w.flops) >= d.memory_ms(w.bytes)

    crossover = next(n for n in range(1, 2048) if compute_bound(n))
    assert ratio <= crossover <= 1.15 * ratio
    assert all(compute_bound(n) for n in range(crossover, 1024, 37))


def test_a100_at_256_rows_is_compute_bound_and_h100_is_not_yet():
    assert DEVICES["a100-80gb"].bf16_tflops < H100_80GB.bf16_tflops
    for device, bound in (("a100-80gb", True), ("h100-80gb", False)):
        d, w = DEVICES[device], layer_work(LLAMA_31_70B, 256, 1024)
        assert (d.compute_ms(w.flops) > d.memory_ms(w.bytes)) is bound


def _non_decreasing(xs):
    return all(a <= b for a, b in pairwise(xs))


@pytest.mark.parametrize("device", list(DEVICES))
def test_costs_never_fall_with_more_rows_or_context(device):
    p = build(device, "llama-3.1-70b", "llama-3.2-1b", rows=[1, 2, 3, 5, 8, 64, 100, 256, 512],
              contexts=[1, 256, 1000, 8192, 32768])
    assert _non_decreasing(p.head_ms)
    for table in (p.layer_ms, p.draft_ms):
        assert all(_non_decreasing(by_rows) for by_rows in table)
        assert all(_non_decreasing([by_rows[i] for by_rows in table]) for i in range(len(p.rows)))


def test_draft_is_a_small_share_of_the_target():
    for d in DEVICES.values():
        target = 80 * layer_ms(d, LLAMA_31_70B, 1, 1024) + head_ms(d, LLAMA_31_70B, 1)
        assert build(d.key, "llama-3.1-70b", "llama-3.2-1b").draft_forward(1, 1024) < 0.05 * target


@pytest.mark.parametrize("device, model, draft, stages", SHIPPED)
def test_shipped_profiles_equal_what_build_gives_now(device, model, draft, stages):
    path = PROFILES_DIR / profile_filename(device, model, draft, stages)
    shipped = CostProfile.load(path)
    assert shipped == build(device, model, draft, stages=stages), \
        "stale profile: run python -m specpipe.costs.roofline"
    assert shipped.method == "roofline" and shipped.row_bytes == 8192 * 2
    assert shipped.num_layers == 80 and shipped.draft["name"] == draft


def test_bad_names_list_the_known_ones():
    with pytest.raises(ValueError, match="a100-80gb, h100-80gb"):
        build("tpu-v5", "llama-3.1-70b", None)
    with pytest.raises(ValueError, match="llama-3.1-70b, llama-3.2-1b"):
        build("h100-80gb", "llama-2-7b", None)
    with pytest.raises(ValueError, match="unknown draft 'tiny'"):
        build("h100-80gb", "llama-3.1-70b", "tiny")


def test_70b_on_one_device_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        build("h100-80gb", "llama-3.1-70b", None, stages=1)
    assert build("h100-80gb", "llama-3.1-70b", None, stages=2).draft_ms == []


def test_link_transfer_of_one_70b_row():
    row = 8192 * 2  # one bf16 hidden state
    assert LINKS["10gbe"].transfer_ms(row) == pytest.approx(0.05 + 16384 / 1.25e6)  # 0.063 ms
    assert LINKS["nvlink4"].transfer_ms(64 * row) < LINKS["ib-100g"].transfer_ms(64 * row) < \
        LINKS["10gbe"].transfer_ms(64 * row)


def test_profile_interpolates_between_its_rows():
    p = roofline_profile(H100_80GB, LLAMA_31_70B, rows=[1, 256], contexts=[1024])
    assert p.layer(1, 1024) < p.layer(100, 1024) < p.layer(256, 1024)


def test_profile_never_extrapolates_downwards():
    # Noise can make the last two measured points fall; past them the cost stays at the last one.
    p = CostProfile("t", [1, 8], [[2.0, 3.0], [2.5, 2.8]], [1.0, 1.0], contexts=[256, 512])
    assert p.layer(8, 1024) == pytest.approx(2.8)  # context: 3.0 -> 2.8 falls, so it stays at 2.8
    assert p.layer(1, 1024) == pytest.approx(3.5)  # 2.0 -> 2.5 rises: extrapolated
    assert p.layer(16, 256) == pytest.approx(3.0 + 8 / 7)  # rows: 2 -> 3 over 1 -> 8, extrapolated
