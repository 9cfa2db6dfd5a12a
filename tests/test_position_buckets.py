"""Quality and key clipping by position bucket (0-1K, 1K-2K, 2K-4K, ...): the report shows where
in a long window a format starts to lose quality."""
import math

import pytest
import torch

from conftest import fitted_book
from kvcompress.eval.metrics import BUCKET_EDGES, QualityAccumulator, position_bucket
from kvcompress.stages.validate import evaluate_quality


def test_position_bucket_edges():
    assert position_bucket(torch.tensor([0, 1023, 1024, 2047, 2048, 4095, 4096, 8191, 8192])).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert BUCKET_EDGES[:5] == (0, 1024, 2048, 4096, 8192)


def test_buckets_partition_the_tokens_and_match_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 2500, 11
    lb = torch.log_softmax(torch.randn(B, T - 1, V, generator=g), -1)
    lc = torch.log_softmax(torch.randn(B, T - 1, V, generator=g), -1)
    ids = torch.randint(0, V, (B, T), generator=g)
    acc = QualityAccumulator()
    acc.update_logprobs(lb, lc, ids)
    r = acc.result()
    bs = r["by_position"]
    assert [(b["start"], b["end"]) for b in bs] == [(0, 1024), (1024, 2048), (2048, 4096)]
    assert sum(b["tokens"] for b in bs) == r["tokens"] == B * (T - 1)
    kl = (lb.exp() * (lb - lc)).sum(-1).clamp(min=0)  # [B, T-1]; column t predicts position t + 1
    sel = slice(1023, 2047)  # predicted positions 1024..2047
    assert math.isclose(bs[1]["kl_mean"], float(kl[:, sel].double().mean()), rel_tol=1e-9)
    nll_b = -lb.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, sel].double().mean()
    assert math.isclose(bs[1]["ppl_baseline"], math.exp(float(nll_b)), rel_tol=1e-9)
    assert math.isclose(sum(b["kl_mean"] * b["tokens"] for b in bs) / r["tokens"], r["kl_mean"], rel_tol=1e-6)


def test_key_clip_rate_by_position_adds_up(tiny_llama):
    book = fitted_book(tiny_llama, name="k4", key={"bits": 4}, window=16, sink_tokens=0)
    windows = torch.randint(0, 256, (1, 1300), generator=torch.Generator().manual_seed(1))
    (q, errors), = evaluate_quality(tiny_llama, {"k4": book}, windows, 1, progress=False)[0].values()
    by = errors.clip_rate_by_bucket()
    assert set(by) == {0, 1}  # keys stored at 0..1023 and 1024..1299
    total = float(errors.clipped_by_bucket.sum() / errors.quantized_by_bucket.sum())
    assert math.isclose(total, errors.clip_rate(), rel_tol=1e-9) and errors.clip_rate() > 0
    assert [b["start"] for b in q["by_position"]] == [0, 1024]


def test_scoring_a_block_of_positions_at_a_time_gives_the_whole_window_numbers(monkeypatch):
    """validate and export's re-measurement form both log-probabilities from hidden states a block of positions at a
    time (score_hidden: no [B, T, V] tensor is whole; at 8K context a 262K vocabulary held three and ran out of memory);
    blocks of 7 positions across the 64-token KL bins and the 1K buckets give the numbers of whole windows, and
    next_token_logprobs is log_softmax to the bit. The heads see every position but the last, each once."""
    import kvcompress.eval.metrics as m

    g = torch.Generator().manual_seed(1)
    B, T, V = 2, 1100, 13
    logits_b, logits_c = torch.randn(B, T, V, generator=g), torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    whole = QualityAccumulator()
    whole.update_logprobs(torch.log_softmax(logits_b[:, :-1], -1), torch.log_softmax(logits_c[:, :-1], -1), ids)
    monkeypatch.setattr(m, "LOGPROB_BLOCK_BYTES", 7 * 4 * B * V)
    assert m.position_block(B, V) == 7
    lb = m.next_token_logprobs(logits_b)
    assert torch.equal(lb, torch.log_softmax(logits_b[:, :-1], -1))
    blocks, seen = QualityAccumulator(), []
    head = lambda x: (seen.append(x.shape[1]), x)[1]  # noqa: E731  (the "hidden states" are the logits themselves)
    m.score_hidden(logits_b, head, [(blocks, logits_c, head)], ids, V)
    assert seen[0::2] == seen[1::2] and max(seen) == 8 and sum(seen[0::2]) - len(seen[0::2]) == T - 1
    want, got = whole.result(), blocks.result()
    assert got.keys() == want.keys() and len(got["kl_by_position"]) == 18 and len(got["by_position"]) == 2
    for k in want:
        if isinstance(want[k], list):
            for a, b in zip(want[k], got[k], strict=True):
                assert a.keys() == b.keys() and all(math.isclose(a[f], b[f], rel_tol=1e-12) for f in a), (k, a, b)
        else:
            assert math.isclose(want[k], got[k], rel_tol=1e-9, abs_tol=1e-15), (k, want[k], got[k])


def test_kl_mean_in_blocks_of_positions_equals_the_whole_tensor(monkeypatch):
    """validate's self-check scores [T, vocabulary] logits a block of positions at a time (no double copy of the whole
    tensors: 17 GB each at 8K for Gemma 3); blocks that do not divide the positions give the whole-tensor mean."""
    from kvcompress.eval import metrics

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 37, 300, generator=g) * 3, torch.randn(2, 37, 300, generator=g) * 3
    want = float(metrics.kl_per_position(torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)).mean())
    monkeypatch.setattr(metrics, "LOGPROB_BLOCK_BYTES", 4 * 300 * 14)  # 7 positions per double block: 74 rows in 11 blocks
    assert metrics.position_block(1, 300) // 2 == 7
    assert metrics.kl_mean(a, b) == pytest.approx(want, rel=1e-12) and want > 0


class _RowsHead:
    """A head that reads its weight rows again on every application (as a streamed lm_head not kept), counting reads."""

    rereads, device = True, "cpu"

    def __init__(self, w: torch.Tensor, chunk: int):
        self.w, self.chunk, self.reads = w, chunk, []

    def __call__(self, x):
        self.reads.append((0, self.w.shape[0]))
        return x @ self.w.T

    def rows(self, lo, hi):
        self.reads.append((lo, hi))
        w = self.w[lo:hi]
        return lambda x: x @ w.T


def test_scoring_a_vocabulary_range_at_a_time_matches_float64_and_reads_each_head_twice(monkeypatch):
    """A head that re-reads its weights on every application (a streamed lm_head too large to keep) is applied a
    vocabulary range at a time to every position, in two passes (vocab_stats: online log-sum-exp, top-1 and target
    logit, then the KL terms): each distinct head's ranges are read twice per batch, however many positions and sides,
    and shared by the sides that use it. Ranges of 29 that do not divide 100 rows, targets on every range, ties in the
    top-1 (the first index, as argmax) and two different heads (export re-measures another checkpoint's): the
    numbers are float64 log_softmax's to float32 precision, and the report is that of update_logprobs."""
    import kvcompress.eval.metrics as m

    g = torch.Generator().manual_seed(3)
    B, T, V, H = 2, 1100, 100, 16
    # multiples of 1/4 and 1/8 with small numerators: every logit is exact in float32 whatever the GEMM's summation order
    # (a range's product and the whole head's give the same bits on any CPU), so ties are real ties on both paths
    q = lambda *shape, lo=-4, hi=5, step=0.25: torch.randint(lo, hi, shape, generator=g) * step  # noqa: E731
    w_base = q(V, H)
    w_base[57] = w_base[12]  # a tie: rows 12 and 57 give equal logits; top-1 is 12 where they lead
    w_other = w_base + q(V, H, lo=-1, hi=2, step=0.125)
    hb = q(B, T, H)
    hb[0, 5] = w_base[12] * 4  # position 5 of window 0: 12 (and 57) lead
    hc = hb + q(B, T, H, lo=-1, hi=2, step=0.25)
    ids = torch.randint(0, V, (B, T), generator=g)
    monkeypatch.setattr(m, "LOGPROB_BLOCK_BYTES", 4 * B * 29 * 300)  # 300 positions per block of a range
    base, same, other = _RowsHead(w_base, 29), _RowsHead(w_base, 29), _RowsHead(w_other, 29)
    acc_same, acc_other = QualityAccumulator(), QualityAccumulator()
    m.score_hidden(hb, base, [(acc_same, hc, base), (acc_other, hc, other)], ids, V)
    ranges = [(0, 29), (29, 58), (58, 87), (87, 100)]
    assert base.reads == ranges * 2 and other.reads == ranges * 2 and not same.reads

    def whole(w_c):
        lb = torch.log_softmax((hb[:, :-1] @ w_base.T).double(), -1)
        lc = torch.log_softmax((hc[:, :-1] @ w_c.T).double(), -1)
        acc = QualityAccumulator()
        acc.update_logprobs(lb, lc, ids)
        return acc.result()

    for acc, w_c in ((acc_same, w_base), (acc_other, w_other)):
        want, got = whole(w_c), acc.result()
        assert got.keys() == want.keys() and got["tokens"] == want["tokens"] == B * (T - 1)
        assert got["top1_agree"] == want["top1_agree"] and 0.3 < want["top1_agree"] < 1
        for k in ("ppl_baseline", "ppl_compressed"):
            assert got[k] == pytest.approx(want[k], rel=1e-6), k
        for k in ("kl_mean", "kl_p99", "kl_max"):
            assert got[k] == pytest.approx(want[k], rel=1e-5), k
        for a, b in zip(want["by_position"], got["by_position"], strict=True):
            assert a["tokens"] == b["tokens"] and a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-5)
    stats = m.vocab_stats([(hb[:, :-1], base)], ids[:, 1:], V)[0]
    assert torch.equal(stats["top1"], (hb[:, :-1] @ w_base.T).argmax(-1)) and int(stats["top1"][0, 5]) == 12
    # the cheaper path in reads: one block of positions and one side sharing the base head read it twice either way,
    # so the block path (the in-memory numbers to the bit) is kept; a head without ranges is never split
    monkeypatch.setattr(m, "LOGPROB_BLOCK_BYTES", 1 << 30)
    base.reads.clear()
    m.score_hidden(hb, base, [(QualityAccumulator(), hc, base)], ids, V)
    assert base.reads == [(0, V)] * 2
    assert m.by_vocabulary([base] * 3, 1) and not m.by_vocabulary([base, other], 1) and m.by_vocabulary([base, other], 3)
    assert not m.by_vocabulary([base, lambda x: x @ w_base.T], 9)
