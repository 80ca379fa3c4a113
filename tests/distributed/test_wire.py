"""The driver/stage wire format: every message round-trips exactly, and anything malformed is a
WireError (never an IndexError, a ValueError from a constructor, or a silently wrong message)."""

from __future__ import annotations

import math

import pytest
import torch

from specpipe.distributed.wire import (
    RowLimits,
    RowsMalformed,
    WireError,
    check_rows,
    decode_control,
    decode_floats,
    decode_results,
    decode_report,
    decode_rows_header,
    encode_control,
    encode_floats,
    encode_report,
    encode_results,
    encode_rows,
)
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Results, Rows, Share, StageStats
from specpipe.sampling import SamplingParams


def roundtrip_control(c: Control) -> Control:
    values = encode_control(c)
    assert all(isinstance(v, int) and -2**63 <= v < 2**63 for v in values)  # fits an int64 tensor
    # Through a tensor, as the transport sends it.
    return decode_control(torch.tensor(values, dtype=torch.long).tolist())


def roundtrip_rows(batch: list[Rows]) -> list[Rows]:
    header, tensors = encode_rows(batch)
    assert len(tensors) == sum(not r.failed for r in batch)  # a failure marker carries no tensor
    decoded = decode_rows_header(torch.tensor(header, dtype=torch.long).tolist())
    out, sent_tensors = [], iter(tensors)
    for rows, shape, dtype in decoded:
        if shape is None:
            assert rows.failed and dtype is None
        else:
            sent = next(sent_tensors)
            assert tuple(sent.shape) == shape and sent.dtype == dtype
            received = torch.empty(shape, dtype=dtype)
            received.copy_(sent)  # what recv_tensor fills in
            rows.data = received
        out.append(rows)
    return out


def assert_rows_equal(a: Rows, b: Rows) -> None:
    assert (a.request_id, a.node_ids, a.parent_ids, a.positions, a.head_rows, a.failed) == \
        (b.request_id, b.node_ids, b.parent_ids, b.positions, b.head_rows, b.failed)
    if not a.failed:
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert torch.equal(a.data, b.data)


# -- Control ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [
    SamplingParams(),  # greedy, seed None
    SamplingParams(temperature=0.8, top_p=0.9, top_k=0, seed=None, max_tokens=7),
    SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=0, max_tokens=1),
    SamplingParams(temperature=1.3, top_p=1.0, top_k=1, seed=2**63 - 1, max_tokens=4096),  # largest seed
    SamplingParams(temperature=1e-3, top_p=5e-324, top_k=2**40, seed=2**62 + 12345, max_tokens=2**31),
])
def test_control_admit_roundtrip(sampling):
    c = Control(admit=[Admit(7, sampling), Admit(2**40, SamplingParams(temperature=0.5, seed=3))])
    back = roundtrip_control(c)
    assert back == c
    # Floats travel as their IEEE bits: exact, not approximately equal.
    assert back.admit[0].sampling.temperature.hex() == sampling.temperature.hex()
    assert back.admit[0].sampling.top_p.hex() == sampling.top_p.hex()
    assert back.admit[0].sampling.seed == sampling.seed


@pytest.mark.parametrize("control", [
    Control(),
    Control(prune=[Prune(1, commit=[5, 6, 7], drop=[8, 9])]),
    Control(prune=[Prune(1, commit=[], drop=[]), Prune(2, commit=list(range(300)), drop=[])]),
    Control(prune=[Prune(3, commit=[], drop=[2**50])]),
    Control(release=[4]),
    Control(release=[1, 2, 3], prune=[Prune(9, commit=[1], drop=[2])]),
    Control(report=True),
    Control(shutdown=True),
    Control(report=True, shutdown=True),
    # prefix caching: admits naming cached blocks, blocks joining the cache, evictions
    Control(admit=[Admit(5, SamplingParams(), cached=[0, 3, 2**40])], release=[4],
            share=[Share(4, blocks=[0, 1, 7], ids=[9, 10, 11]), Share(6, blocks=[], ids=[])], evict=[1, 2]),
    Control(admit=[Admit(0, SamplingParams(seed=None))], prune=[Prune(0, commit=[0, 1, 2])],
            release=[5], report=True),
])
def test_control_roundtrip(control):
    back = roundtrip_control(control)
    assert back == control
    assert empty(back) == empty(control)


def empty(c: Control) -> bool:
    return not (c.admit or c.prune or c.release or c.report or c.shutdown)


# -- Rows ------------------------------------------------------------------------------------------

def test_rows_tokens_roundtrip():
    tokens = torch.tensor([0, 5, 2**31 + 7, 2**40, 49151], dtype=torch.long)
    rows = Rows(3, node_ids=[0, 1, 2, 3, 4], parent_ids=[NO_PARENT, 0, 1, 2, 3], positions=[0, 1, 2, 3, 4],
                data=tokens)
    [back] = roundtrip_rows([rows])
    assert_rows_equal(back, rows)
    assert back.head_rows is None


@pytest.mark.parametrize("head_rows", [None, [], [0], [0, 2], [1, 2, 3]])
def test_rows_hidden_roundtrip(head_rows):
    hidden = torch.randn(4, 64, dtype=torch.float32)
    hidden[0, 0] = float("inf")
    hidden[1, 1] = -0.0
    hidden[2, 2] = 1e-42  # subnormal
    rows = Rows(11, node_ids=[10, 11, 12, 13], parent_ids=[9, 10, 10, 11], positions=[20, 21, 21, 22],
                data=hidden, head_rows=head_rows)
    [back] = roundtrip_rows([rows])
    assert_rows_equal(back, rows)
    assert back.head_rows == head_rows
    assert math.copysign(1.0, float(back.data[1, 1])) == -1.0  # bit-exact, sign of zero included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_dtypes_and_batches(dtype):
    a = Rows(1, [1, 2], [0, 1], [5, 6], torch.randn(2, 8).to(dtype), head_rows=[1])
    b = Rows(2, [7], [NO_PARENT], [0], torch.randn(1, 8).to(dtype))
    empty_rows = Rows(3, [], [], [], torch.empty(0, 8, dtype=dtype), head_rows=[])
    back = roundtrip_rows([a, b, empty_rows])
    for x, y in zip(back, [a, b, empty_rows]):
        assert_rows_equal(x, y)


def test_rows_failure_markers_roundtrip():
    a = Rows(1, [1, 2], [0, 1], [5, 6], torch.randn(2, 8), head_rows=[1])
    batch = [Rows.failure(7), a, Rows.failure(2**40)]
    back = roundtrip_rows(batch)
    for x, y in zip(back, batch):
        assert_rows_equal(x, y)
    assert [r.failed for r in back] == [True, False, True] and len(back[0]) == 0


def test_rows_empty_batch():
    header, tensors = encode_rows([])
    assert tensors == [] and decode_rows_header(header) == []


def test_rows_non_contiguous_data_is_sent_contiguous():
    base = torch.randn(8, 3)
    rows = Rows(1, [1, 2, 3], [0, 1, 2], [1, 2, 3], base.t())  # (3, 8) view, not contiguous
    [back] = roundtrip_rows([rows])
    assert torch.equal(back.data, base.t())


# -- Results and floats ----------------------------------------------------------------------------

@pytest.mark.parametrize("results", [
    [],
    [Results(1, [], [])],
    [Results(1, [4], [17])],
    [Results(1, [4, 5, 6], [17, 0, 49151]), Results(2**33, [2**45], [299])],
    [Results(3, [], [], failed=True)],
    [Results(1, [4], [17]), Results(2, [], [], failed=True), Results(5, [], [])],
])
def test_results_roundtrip(results):
    assert decode_results(encode_results(results)) == results


def test_failed_result_with_tokens_is_refused():
    with pytest.raises(ValueError):
        encode_results([Results(1, [4], [17], failed=True)])


def test_report_roundtrip():
    stats = StageStats(steps=12, compute_s=0.25, wait_s=1e-6, bytes_sent=2**40, rows_computed=30,
                       rows_committed=20, requests_failed=1, peak_slots=64, blocks_in_use=3, num_blocks=8,
                       rss_bytes=2**31, peak_rss_bytes=2**32)
    back = decode_report(encode_report(stats))
    assert back.pop("spans") == [] and back == stats.as_dict() and back["occupancy"] == 20 / 30
    assert all(isinstance(back[k], int) for k in ("steps", "bytes_sent", "num_blocks", "blocks_in_use"))
    assert isinstance(back["compute_s"], float)
    assert set(StageStats.CUMULATIVE) <= set(back)
    with pytest.raises(WireError, match="ended early"):
        decode_report(encode_report(stats)[:-1])
    spans = [(3, 10**18, 10**18 + 5), (4, 2**62, 2**62 + 1)]
    assert decode_report(encode_report(stats, spans))["spans"] == spans
    with pytest.raises(WireError, match="ended early"):  # a span cut short
        decode_report(encode_report(stats, spans)[:-1])


def test_floats_roundtrip():
    values = [0.0, -0.0, 1.5, 1e-300, 3.0e38, float("inf"), 123456789.123]
    back = decode_floats(encode_floats(values))
    assert [v.hex() for v in back] == [v.hex() for v in values]
    assert math.isnan(decode_floats(encode_floats([float("nan")]))[0])


# -- malformed messages ----------------------------------------------------------------------------

def _control_values() -> list[int]:
    return encode_control(Control(admit=[Admit(1, SamplingParams(temperature=0.5, seed=9))],
                                  prune=[Prune(1, commit=[2, 3], drop=[4])], release=[5]))


@pytest.mark.parametrize("cut", [0, 1, 2, 5, 9, -1])
def test_control_truncated(cut):
    values = _control_values()
    with pytest.raises(WireError):
        decode_control(values[:cut])


def test_control_malformed():
    values = _control_values()
    with pytest.raises(WireError, match="trailing"):
        decode_control(values + [0])
    with pytest.raises(WireError):
        decode_control([])
    with pytest.raises(WireError, match="flags"):
        decode_control([8, 0, 0, 0])
    with pytest.raises(WireError, match="negative"):
        decode_control([0, -1, 0, 0])  # negative admit count
    with pytest.raises(WireError, match="negative"):
        decode_control([0, 0, 1, 7, -2, 0, 0])  # negative commit length
    with pytest.raises(WireError, match="negative"):
        decode_control([0, 0, 0, -3])  # negative release count
    with pytest.raises(WireError):
        decode_control([0, 0, 0, 5, 1, 2])  # release announces 5 ids, carries 2


def test_control_bad_sampling_is_a_wire_error():
    good = encode_control(Control(admit=[Admit(1, SamplingParams(temperature=0.5, top_p=0.9, top_k=3,
                                                                   seed=4, max_tokens=8))]))
    # layout: flags, n_admit, rid, temperature bits, top_p bits, top_k, seed, max_tokens, ...
    for index, bad in [(3, encode_floats([-1.0])[0]), (4, encode_floats([1.5])[0]), (5, -1),
                       (6, -5), (7, 0)]:
        values = list(good)
        values[index] = bad
        with pytest.raises(WireError, match="sampling"):
            decode_control(values)


def _rows_header() -> list[int]:
    header, _ = encode_rows([Rows(1, [1, 2], [0, 1], [3, 4], torch.zeros(2, 8), head_rows=[1])])
    return header


@pytest.mark.parametrize("cut", [0, 1, 3, 6, 10, -1])
def test_rows_truncated(cut):
    with pytest.raises(WireError):
        decode_rows_header(_rows_header()[:cut])


def test_rows_malformed():
    h = _rows_header()
    # layout: n, rid, flags, t, n_heads, heads..., node_ids(t), parent_ids(t), positions(t), dtype, ndim,
    # shape
    with pytest.raises(WireError, match="trailing"):
        decode_rows_header(h + [1])
    bad_dtype = list(h)
    bad_dtype[-4] = 99
    with pytest.raises(WireError, match="descriptor"):
        decode_rows_header(bad_dtype)
    bad_ndim = list(h)
    bad_ndim[-3] = 3
    with pytest.raises(WireError):
        decode_rows_header(bad_ndim)
    wrong_rows = list(h)
    wrong_rows[-2] = 3  # activation has 3 rows for 2 nodes
    with pytest.raises(WireError, match="rows"):
        decode_rows_header(wrong_rows)
    negative_width = list(h)
    negative_width[-1] = -8
    with pytest.raises(WireError, match="shape"):
        decode_rows_header(negative_width)
    bad_head = list(h)
    bad_head[5] = 2  # head row 2 of 2 rows
    with pytest.raises(WireError, match="head"):
        decode_rows_header(bad_head)
    with pytest.raises(WireError):
        decode_rows_header([1, 1, 0, -2, -1])  # negative row count
    with pytest.raises(WireError):
        decode_rows_header([1, 1, 0, 0, -5])  # head-row count below -1
    with pytest.raises(WireError, match="flags"):
        decode_rows_header([1, 1, 16])  # unknown flag (2 MASKED: token masks follow, 4 PENALIZED, 8 SCORED)
    masked = list(h)
    masked[2] = 2  # MASKED, but no mask shape after the activation's
    with pytest.raises(WireError, match="early"):
        decode_rows_header(masked)
    with pytest.raises(WireError, match="masks"):
        decode_rows_header(masked + [2, 4])  # two masks for its one head row
    with pytest.raises(WireError, match="masks"):
        decode_rows_header(masked + [1, 0])  # zero-width mask rows
    (rows, _, _), = decode_rows_header(masked + [1, 4])
    assert rows.masks.shape == (1, 4)  # the tensor to receive next
    with pytest.raises(WireError, match="flags"):
        decode_rows_header([1, 1, -1])
    with pytest.raises(WireError, match="trailing"):
        decode_rows_header([1, 1, 1, 0])  # a failure marker carries nothing more
    with pytest.raises(WireError, match="negative"):
        decode_rows_header([-1])


def test_results_malformed():
    values = encode_results([Results(1, [4, 5], [6, 7])])
    for cut in range(len(values)):
        with pytest.raises(WireError):
            decode_results(values[:cut])
    with pytest.raises(WireError, match="trailing"):
        decode_results(values + [0])
    with pytest.raises(WireError, match="negative"):
        decode_results([1, 1, 0, -1])
    with pytest.raises(WireError, match="flags"):
        decode_results([1, 1, 4, 0])
    with pytest.raises(WireError, match="failed"):
        decode_results([1, 1, 1, 1, 4, 17])  # a failed result carrying a token
    with pytest.raises(WireError, match="negative"):
        decode_results([-2])


def test_a_readiness_report_from_another_version_is_a_named_stage_failure():
    # Before: a stage restarted from upgraded code sent one more field and the driver died with
    # "too many values to unpack", which the restart logic did not catch.
    import pytest

    from specpipe.distributed.ranks import READY_FIELDS, _ready_report

    assert _ready_report(2, " ".join(str(i) for i in range(len(READY_FIELDS))))["window_blocks"] == 6
    for text in ("1 2 3", "1 2 3 4 5 6 7 8", "1 2 3 4 5 6 x"):
        with pytest.raises(RuntimeError, match="stage 2 sent a readiness report this driver cannot read"):
            _ready_report(2, text)


def test_wait_ready_reports_each_stage_in_a_line():
    from specpipe.distributed.ranks import wait_ready

    class Store:
        data = {f"ready/{r}": f"{r << 20} 0 {3 << 20} {2 << 20} 64 16 0".encode() for r in (1, 2)}

        def check(self, keys):
            return all(k in self.data for k in keys)

        def get(self, key):
            return self.data[key]

    lines = []
    ready = wait_ready(Store(), 2, dict, 5.0, lines.append)
    assert [r["num_blocks"] for r in ready] == [64, 64]
    assert lines == ["stage 1/2 ready: weights 3 MiB, KV 2 MiB, resident 1 MiB",
                     "stage 2/2 ready: weights 3 MiB, KV 2 MiB, resident 2 MiB"]


# -- what a stage accepts (RowLimits): refused before anything is allocated -----------------------

LIMITS = dict(hidden=8, dtype=torch.float32, vocab_size=49152, mask_words=768, max_rows=64)


def _header(rows: Rows) -> list[int]:
    return torch.tensor(encode_rows([rows])[0], dtype=torch.long).tolist()


def test_masks_must_be_the_vocabulary_width():
    """Issue 57 finding 6: 65,536 words a mask row were accepted where the vocabulary takes 768;
    512 such rows took a stage past 3 GB. Now any other width is refused at the header."""
    later = RowLimits(first=False, **LIMITS)
    rows = Rows(1, [0, 1], [NO_PARENT, 0], [0, 1], torch.zeros(2, 8), masks=torch.zeros(2, 1 << 16, dtype=torch.long))
    with pytest.raises(RowsMalformed, match="65536 words a row, the vocabulary of 49152 tokens takes 768"):
        decode_rows_header(_header(rows), limits=later)
    rows.masks = torch.zeros(2, 769, dtype=torch.long)
    with pytest.raises(RowsMalformed, match="769 words"):
        decode_rows_header(_header(rows), limits=later)
    rows.masks = torch.zeros(2, 768, dtype=torch.long)
    (decoded, shape, dtype), = decode_rows_header(_header(rows), limits=later)
    assert decoded.masks.shape == (2, 768) and shape == (2, 8) and dtype == torch.float32


def test_token_ids_past_stage_one_and_activations_into_it_are_refused():
    """Issue 57 finding 8: 1-D token ids sent to stage 2 became 'RuntimeError' inside the model."""
    ids = Rows(1, [0, 1], [NO_PARENT, 0], [0, 1], torch.tensor([3, 4]))
    hidden = Rows(1, [0, 1], [NO_PARENT, 0], [0, 1], torch.zeros(2, 8))
    with pytest.raises(RowsMalformed, match="token ids go to stage 1 only"):
        decode_rows_header(_header(ids), limits=RowLimits(first=False, **LIMITS))
    with pytest.raises(RowsMalformed, match="stage 1 takes token ids"):
        decode_rows_header(_header(hidden), limits=RowLimits(first=True, **LIMITS))
    with pytest.raises(RowsMalformed, match="bfloat16"):
        decode_rows_header(_header(Rows(1, [0], [NO_PARENT], [0], torch.zeros(1, 8, dtype=torch.bfloat16))),
                           limits=RowLimits(first=False, **LIMITS))
    decode_rows_header(_header(ids), limits=RowLimits(first=True, **LIMITS))
    decode_rows_header(_header(hidden), limits=RowLimits(first=False, **LIMITS))
    check_rows(ids, RowLimits(first=True, **LIMITS))
    with pytest.raises(RowsMalformed, match="outside the vocabulary"):
        check_rows(Rows(1, [0], [NO_PARENT], [0], torch.tensor([49152])), RowLimits(first=True, **LIMITS))
    with pytest.raises(RowsMalformed, match="token ids go to stage 1 only"):
        check_rows(ids, RowLimits(first=False, **LIMITS))


def test_more_rows_than_the_pool_holds_and_repeated_head_rows_are_refused():
    limits = RowLimits(first=False, **{**LIMITS, "max_rows": 3})
    two = Rows(1, [0, 1], [NO_PARENT, 0], [0, 1], torch.zeros(2, 8))
    header, _ = encode_rows([two, Rows(2, [0, 1], [NO_PARENT, 0], [0, 1], torch.zeros(2, 8))])
    with pytest.raises(RowsMalformed, match="4 rows in one step, at most 3"):
        decode_rows_header(header, limits=limits)
    with pytest.raises(RowsMalformed, match="head rows"):
        decode_rows_header(_header(Rows(1, [0, 1], [NO_PARENT, 0], [0, 1], torch.zeros(2, 8), head_rows=[1, 1])),
                           limits=limits)
