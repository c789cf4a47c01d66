"""Point-to-point: header codec, paired batches with tuples, shape changes, out-of-order timeouts."""

from __future__ import annotations

import pytest
import torch

from pipeengine.p2p import HEADER_LEN, P2P, P2PTimeout, RecvOp, SendOp, TensorMeta, decode_header, encode_header
from tests.harness import run_distributed


def test_header_round_trip() -> None:
    metas = (TensorMeta((4, 16, 8), torch.float32, True), TensorMeta((4, 16), torch.int64, False),
             TensorMeta((), torch.bfloat16, False))
    h = encode_header(metas)
    assert h.shape == (HEADER_LEN,) and h.dtype == torch.int64
    assert decode_header(h) == metas


def test_header_errors() -> None:
    with pytest.raises(ValueError, match="at most 15 tensors"):
        encode_header([TensorMeta((1,), torch.float32)] * 16)
    with pytest.raises(ValueError, match="header, more than 64"):
        encode_header([TensorMeta((1,) * 30, torch.float32)] * 3)
    with pytest.raises(TypeError, match="cannot send dtype torch.complex64"):
        encode_header([TensorMeta((1,), torch.complex64)])


def exchange(rank: int, world: int, ordered: bool) -> list[str]:
    p2p = P2P(torch.device("cpu"), timeout=20, ordered=ordered)
    assert p2p.ordered is ordered
    checks = []
    g = torch.Generator().manual_seed(0)
    act = (torch.randn(4, 16, 8, generator=g), torch.randint(0, 5, (4, 16), generator=g))
    grad = torch.randn(4, 16, 8, generator=g)
    meta = (TensorMeta((4, 16, 8), torch.float32),)
    if rank == 0:   # send the activation and receive its gradient in ONE batch
        batch = p2p.post([SendOp(1, 5, act, True, "sendF0>1"), RecvOp(1, 6, meta, False, "recvB0<1")])
        got = batch.recvs[0].wait()
        batch.wait_sends()
        checks.append(str(torch.equal(got[0], grad)))
    else:
        batch = p2p.post([RecvOp(0, 5, None, True, "recvF0<0"), SendOp(0, 6, (grad,), False, "sendB0>0")])
        x, mask = batch.recvs[0].wait()
        batch.wait_sends()
        checks.append(str(torch.equal(x, act[0]) and torch.equal(mask, act[1]) and mask.dtype == torch.int64))
    for seq in (16, 23):   # shapes change between transfers: each carries a header
        t = torch.arange(2 * seq, dtype=torch.float64).view(2, seq)
        if rank == 0:
            p2p.post([SendOp(1, 7 + seq, (t,), True, "s")]).wait_sends()
        else:
            (r,) = p2p.post([RecvOp(0, 7 + seq, None, True, "r")]).recvs[0].wait()
            checks.append(str(torch.equal(r, t)))
    # out of order: rank 1 waits for "microbatch 1", rank 0 only ever sends "microbatch 0"
    p2p.timeout = 2
    try:
        if rank == 0:
            p2p.post([SendOp(1, 100, (grad,), False, "sendF0>1")])   # not waited: must not hang
        else:
            p2p.post([RecvOp(0, 101, meta, False, "recvF1<0 on rank 1")]).recvs[0].wait()
        checks.append("no timeout")
    except P2PTimeout as exc:
        checks.append(str(exc))
    return checks   # no collective after a Gloo timeout: the pair is closed by then


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ordered", [False, True], ids=["per-op (Gloo)", "coalesced in per-peer order (NCCL)"])
def test_paired_batch_tuple_shape_change_and_timeout(ordered: bool) -> None:
    r0, r1 = run_distributed(exchange, 2, ordered, timeout=80)
    assert r0[0] == "True" and r1[:3] == ["True", "True", "True"]
    assert r1[3].startswith("recvF1<0 on rank 1: no completion after 2 s with peer rank 0"), r1[3]
    assert "did not post the matching op" in r1[3]
