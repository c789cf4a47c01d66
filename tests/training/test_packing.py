"""Packing: a step's variable-length sequences as padded, packed or ragged microbatches, every token where it was,
every padded position ignored, and the layouts as the modes promise (first-fit decreasing; ragged: one row a
microbatch at about equal costs, or one sequence a row at the least costly cut)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from pipeengine.training.packing import IGNORE, MODES, Packing

# (sequences, microbatches, context): n == count, count == 1, contexts of one position and many
CASES = [(1, 1, 1), (1, 1, 8), (5, 5, 16), (7, 1, 16), (13, 4, 32), (40, 8, 64), (64, 3, 128), (100, 7, 50),
         (257, 16, 512)]
KINDS = ("random", "full", "ones", "long tail")


def lengths_of(rng: random.Random, kind: str, n: int, context: int) -> list[int]:
    if kind == "full":
        return [context] * n
    if kind == "ones":
        return [1] * n
    if kind == "long tail":
        return [min(context, max(1, round(rng.lognormvariate(math.log(max(1, context / 8)), 1.0)))) for _ in range(n)]
    return [rng.randint(1, context) for _ in range(n)]


def examples_of(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, (n,), generator=g), torch.randint(0, 50, (n,), generator=g)) for n in lengths]


def numel(x: Any) -> int:
    return x[0].numel() if isinstance(x, tuple) else int(x.numel())


def padding(p: Packing, lengths: list[int], count: int) -> float:
    return 1 - sum(lengths) / p.positions(lengths, count)


def check_row(p: Packing, row: list[int], tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
              segments: torch.Tensor, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One row's sequences rebuilt from its tensors alone (what is not IGNORE, cut by segment) are the examples
    the layout puts there, in order, packed from the row's start; the rest is padding."""
    real = labels != IGNORE
    assert torch.equal(real, segments >= 0)
    assert torch.equal(tokens[~real], torch.full_like(tokens[~real], p.pad_id))
    assert not positions[~real].any()
    start = 0
    for slot, i in enumerate(row):
        where = (segments == slot).nonzero().flatten()
        x, y = examples[i]
        assert torch.equal(where, torch.arange(start, start + len(x)))   # contiguous, after the previous one
        assert torch.equal(positions[where], torch.arange(len(x)))      # positions restart at each sequence
        assert torch.equal(tokens[where], x) and torch.equal(labels[where], y)
        start += len(x)
    assert int(real.sum()) == start


def check_build(p: Packing, lengths: list[int], count: int, seed: int) -> None:
    layout = p.layout(lengths, count)
    assert len(layout) == count and all(rows for rows in layout)
    assert sorted(i for rows in layout for row in rows for i in row) == list(range(len(lengths)))
    examples = examples_of(lengths, seed)
    built = p.build(examples, count, weight=0.375)
    assert len(built) == count
    rows_of_several = p.segmented
    assert [tuple(x[0].shape if rows_of_several else x.shape) for x, _ in built] == p.shapes(lengths, count)
    assert sum(numel(x) for x, _ in built) == p.positions(lengths, count)
    for rows, (x, (labels, w)) in zip(layout, built):
        assert w.dim() == 0 and w.dtype == torch.float32 and w.item() == 0.375
        assert labels.dtype == torch.int64 and labels.shape == (x[0] if rows_of_several else x).shape
        if rows_of_several:
            tokens, positions, segments = x
            assert all(t.dtype == torch.int64 for t in x)
            if p.mode == "pack":
                assert all(sum(lengths[i] for i in row) <= p.context for row in rows)
            else:   # one row, its sequences end to end: no padding
                assert len(rows) == 1 and tokens.shape[1] == sum(lengths[i] for i in rows[0])
        else:
            assert all(len(row) == 1 for row in rows) and x.dtype == torch.int64
            tokens, positions, segments = x, torch.zeros_like(x), torch.where(labels != IGNORE, 0, -1)
            positions[labels != IGNORE] = torch.cat([torch.arange(lengths[row[0]]) for row in rows])
        for r, row in enumerate(rows):
            check_row(p, row, tokens[r], labels[r], positions[r], segments[r], examples)


@pytest.mark.parametrize("mode,one_row", [(m, False) for m in MODES] + [("ragged", True)])
def test_every_token_is_where_it_was_and_every_pad_is_ignored(mode: str, one_row: bool) -> None:
    rng = random.Random(f"packing {mode} {one_row}")
    for n, count, context in CASES:
        for kind in KINDS:
            lengths = lengths_of(rng, kind, n, context)
            p = Packing(mode, context, pad_id=rng.choice([0, 3]), linear_cost=rng.choice([0.0, 2.5, 64.0]),
                        one_row=one_row)
            check_build(p, lengths, count, seed=rng.randrange(1 << 30))


def test_pad_keeps_the_order_in_chunks_of_one_size_the_larger_first() -> None:
    p = Packing("pad", 8)
    assert p.layout([3, 5, 2, 5, 4], 2) == [[[0], [1], [2]], [[3], [4]]]
    assert p.shapes([1] * 12, 4) == [(3, 8)] * 4
    assert [len(rows) for rows in p.layout([1] * 10, 4)] == [3, 3, 2, 2]


def test_pack_is_first_fit_decreasing_split_until_every_microbatch_has_a_row() -> None:
    p = Packing("pack", 8)
    lengths = [3, 5, 2, 5, 4]   # longest first: 1, 3, 4, 0, 2; 0 fits beside 1, 2 beside 3
    assert p.layout(lengths, 1) == [[[1, 0], [3, 2], [4]]]
    assert p.layout(lengths, 2) == [[[1, 0], [3, 2]], [[4]]]
    assert p.layout(lengths, 4) == [[[1]], [[0]], [[3, 2]], [[4]]]   # the first of the fullest rows split
    assert p.layout([1] * 7, 3) == [[[0, 1]], [[2, 3]], [[4, 5, 6]]]   # 7 -> 4 + 3 -> 2 + 2 + 3
    assert p.layout([4, 4, 4, 4], 4) == [[[0]], [[1]], [[2]], [[3]]]


def test_pack_wastes_far_less_than_pad_on_short_sequences() -> None:
    rng = random.Random(7)
    lengths = [rng.randint(1, 64) for _ in range(256)]
    pad, pack = Packing("pad", 1024), Packing("pack", 1024)
    pad_rows = sum(rows for rows, _ in pad.shapes(lengths, 4))
    pack_rows = sum(rows for rows, _ in pack.shapes(lengths, 4))
    assert pad_rows == 256 and pack_rows <= math.ceil(sum(lengths) / 1024) + 1
    assert padding(pack, lengths, 4) < 0.1 < 0.9 < padding(pad, lengths, 4)


def best_cost(lengths: list[int], count: int, linear_cost: float) -> float:
    """The least largest cost over every cut of the sorted lengths into ``count`` contiguous groups (a DP)."""
    ls = sorted(lengths, reverse=True)
    n = len(ls)

    def cost(i: int, j: int) -> float:
        return (j - i) * ls[i] * (ls[i] + linear_cost)

    best = [[math.inf] * (n + 1) for _ in range(count + 1)]   # best[k][j]: the first j in k groups
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], cost(i, j)) for i in range(k - 1, j))
    return best[count][n]


def random_ragged(most: int, one_row: bool) -> list[tuple[list[int], int, Packing]]:
    """300 random cases of up to ``most`` sequences: (lengths, microbatches, a ragged Packing)."""
    rng, cases = random.Random(11), []
    for _ in range(300):
        n = rng.randint(1, most)
        count, context = rng.randint(1, n), rng.choice([4, 16, 100])
        lengths = [rng.randint(1, context) for _ in range(n)]
        cases.append((lengths, count, Packing("ragged", context, linear_cost=rng.choice([0.0, 1.0, 0.3, 37.5]),
                                              one_row=one_row)))
    return cases


def test_ragged_one_sequence_a_row_finds_the_least_costly_cut() -> None:
    p = Packing("ragged", 8)
    assert p.layout([2, 8, 3, 8, 1], 2) == [[[1], [3]], [[2], [0], [4]]]   # max(2 x 64, 3 x 9) = 128
    assert p.shapes([2, 8, 3, 8, 1], 2) == [(2, 8), (3, 3)]
    for lengths, count, p in random_ragged(12, one_row=False):
        shapes = p.shapes(lengths, count)
        assert [w for _, w in shapes] == sorted((w for _, w in shapes), reverse=True)   # longest first
        worst = max(rows * w * (w + p.linear_cost) for rows, w in shapes)
        assert worst == pytest.approx(best_cost(lengths, count, p.linear_cost), rel=1e-9, abs=0)


def test_ragged_one_row_a_microbatch_is_longest_processing_time_first_at_about_equal_cost() -> None:
    """Costliest first, each sequence to the microbatch that costs least so far: the costliest microbatch exceeds
    the least by one sequence's cost at most (and the mean by as much), and no position is padding."""
    p = Packing("ragged", 8, one_row=True)
    # costs n²: 64, 64, 9, 4, 1 -> 64 to 0, 64 to 1, 9 to 0 (the first of equals), 4 to 1, 1 to 1
    assert p.layout([2, 8, 3, 8, 1], 2) == [[[1, 2]], [[3, 0, 4]]]
    assert p.shapes([2, 8, 3, 8, 1], 2) == [(1, 11), (1, 11)]
    for lengths, count, p in random_ragged(40, one_row=True):
        cost = [x * (x + p.linear_cost) for x in lengths]
        loads = [sum(cost[i] for i in rows[0]) for rows in p.layout(lengths, count)]
        assert max(loads) - min(loads) <= max(cost) * (1 + 1e-12)
        assert max(loads) <= sum(cost) / count + max(cost) * (1 + 1e-12)
        assert p.positions(lengths, count) == sum(lengths)
        widths = [w for _, w in p.shapes(lengths, count)]
        assert widths == sorted(widths, reverse=True)   # the widest first: the profile times it


def test_ragged_wastes_far_less_than_pad_on_a_long_tail() -> None:
    rng = random.Random(5)
    lengths = [min(1024, max(1, round(rng.lognormvariate(math.log(120), 1.0)))) for _ in range(256)]
    pad, rows = padding(Packing("pad", 1024), lengths, 8), padding(Packing("ragged", 1024), lengths, 8)
    one_row = padding(Packing("ragged", 1024, one_row=True), lengths, 8)
    print(f"padding on a long tail (median {sorted(lengths)[128]}, 256 sequences, 8 microbatches, context 1024): "
          f"pad {pad:.3f}, ragged one a row {rows:.3f}, ragged one row {one_row:.3f}")
    assert one_row == 0 and rows < pad / 2 and pad > 0.7


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="choose one of pad, pack, ragged"):
        Packing("packed", 8)
    with pytest.raises(ValueError, match="context is 0"):
        Packing("pad", 0)
    with pytest.raises(ValueError, match="linear_cost"):
        Packing("ragged", 8, linear_cost=-1.0)
    for mode in MODES:
        p = Packing(mode, 8)
        with pytest.raises(ValueError, match="at least one sequence per microbatch.*3 sequences for 0"):
            p.layout([1, 2, 3], 0)
        with pytest.raises(ValueError, match="at least one sequence per microbatch.*3 sequences for 4"):
            p.build(examples_of([1, 2, 3], 0), 4, 1.0)
        with pytest.raises(ValueError, match="sequence 1 is 9 tokens long, longer than the context of 8"):
            p.layout([8, 9, 3], 2)
        with pytest.raises(ValueError, match="sequence 2 is 0 tokens long"):
            p.layout([8, 1, 0], 2)
        with pytest.raises(ValueError, match=r"example 0: input \(3,\) and target \(2,\)"):
            p.build([(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))], 1, 1.0)


def test_the_gpt_loss_and_gradients_are_the_same_padded_packed_or_ragged() -> None:
    """The README's claim: on the same sequences the three layouts give one loss (the mean over real tokens) and
    one gradient: padding never reaches a real token (causal after it, or another segment) and counts for nothing."""
    from pipeengine.models import gpt
    cfg = gpt.Config(block_size=16, n_layer=2, n_head=2, n_embd=16)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (int(n) + 1,), generator=g) for n in torch.randint(1, 17, (11,), generator=g)]
    examples = [(s[:-1], s[1:]) for s in seqs]
    real = sum(len(x) for x, _ in examples)
    results = {}
    for mode in (*MODES, "ragged, one a row"):
        torch.set_default_dtype(torch.float64)
        try:
            layers = gpt.build(cfg, seed=0)
            total = torch.zeros(())
            packing = Packing(mode.split(",")[0], cfg.block_size, linear_cost=192.0, one_row=mode == "ragged")
            for x, y in packing.build(examples, 3, 3 / real):
                for layer in layers:
                    x = layer(x)
                total = total + gpt.loss_fn(x, y) / 3
            total.backward()
        finally:
            torch.set_default_dtype(torch.float32)
        results[mode] = (total.detach(), [p.grad for layer in layers for p in layer.parameters()])
    for mode in ("pack", "ragged", "ragged, one a row"):
        torch.testing.assert_close(results[mode][0], results["pad"][0], rtol=1e-12, atol=0)
        for got, want in zip(results[mode][1], results["pad"][1]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_packed_attention_document_by_document_equals_the_masked_kernel() -> None:
    """On CPU a packed row attends document by document (no mask); that equals the boolean mask the GPT uses on
    CUDA, outputs and gradients, the padding after the last document included; so does the automatic choice, which
    here sends the row of one document through the causal kernel and the others through the mask."""
    from pipeengine.models import gpt
    cfg = gpt.Config(block_size=16, n_layer=1, n_head=2, n_embd=8)
    block = gpt.build(cfg, seed=0)[1]
    segments = torch.tensor([[0] * 5 + [1] * 9 + [-1] * 2, [0] * 16, [0] * 1 + [1] * 1 + [2] * 14])
    outs = []
    for per_document in (True, False, None):
        q, k, v = (torch.randn(3, 2, 16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                   .requires_grad_() for i in range(3))
        y = block._attend(q, k, v, segments, per_document)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y))
        outs.append([y, q.grad, k.grad, v.grad])
    for other in outs[1:]:
        for got, want in zip(outs[0], other):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and it is causal inside a document: the second row's first output is its first value
    torch.testing.assert_close(outs[0][0][1, :, 0], v.detach()[1, :, 0])


def test_a_torch_dataset_with_lengths_is_packed_by_the_feed() -> None:
    """``Model.packing`` with a map-style Dataset that says its lengths: each step's sequences become the replica's
    microbatches by the packing, targets weighted by the global batch's real tokens; a stream is refused."""
    from pipeengine.training.batch import Batch
    from pipeengine.training.feed import Feed

    class Seqs(torch.utils.data.Dataset):   # type: ignore[type-arg]
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            lengths = torch.randint(1, 9, (40,), generator=g)
            self.seqs = [torch.randint(0, 50, (int(n) + 1,), generator=g) for n in lengths]

        def __len__(self) -> int:
            return len(self.seqs)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.seqs[i][:-1], self.seqs[i][1:]

        def lengths(self) -> list[int]:
            return [len(s) - 1 for s in self.seqs]

    packing = Packing("ragged", 8, one_row=True)
    feed = Feed(Seqs(), None, 0, Batch(12, 2, 3), 2, 1, 3, 0, False, packing)
    mbs = list(feed.train(0)[0])
    assert len(mbs) == 2 and all(isinstance(x, tuple) and x[0].shape[0] == 1 for x, _ in mbs)   # one row each
    real, positions, squares = feed.tokens(0)
    weight = mbs[0][1][1]
    assert float(weight) == pytest.approx(4 / real) and positions >= real   # 2 replicas x 2 microbatches
    assert real < squares <= 8 * real   # the sum of n² over sequences of 1 to 8 tokens, some longer than 1
    assert sum(int((y != IGNORE).sum()) for _, (y, _) in mbs) < real        # this replica's share only
    sizes = feed.sizes()   # replica 0's first microbatches, relative to the first (the profile's sample)
    assert sizes is not None and len(sizes) == 2 and sizes[0] == 1.0 and sizes[1] <= 1.0   # ragged: widest first
    with pytest.raises(ValueError, match="a stream cannot be packed ahead"):
        Feed(iter(Seqs().seqs), None, 0, Batch(12, 2, 3), 2, 1, 3, 0, False, packing)


def test_the_gpt_takes_one_row_a_microbatch_where_padding_a_row_costs_more_than_its_kernel_calls() -> None:
    """Ragged one row a microbatch (on CPU: the trainer turns it off on an accelerator) at long contexts, where padding
    costs more than a kernel call per document; one document a row at short ones (the README's main job: 23.1k
    against 17.7k tokens/s one a row)."""
    from pipeengine.models import gpt
    assert gpt.model("tiny-1k").packing.one_row and gpt.model("small", context=1024).packing.one_row
    assert not gpt.model("tiny").packing.one_row and not gpt.model("small").packing.one_row
