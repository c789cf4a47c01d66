"""The wire: header codec, explicit header steps, tuples stay tuples, shape changes, the first payload with its
header, tag space, timeouts."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from pipeengine.runtime.faults import watch
from pipeengine.runtime.header import HEADER_LEN, TensorMeta, decode_header, describe, encode_header, header_length
from pipeengine.runtime.transfer import P2PTimeout, receives_ahead
from pipeengine.runtime.wire import Wire
from pipeengine.schedule import Action, Kind
from tests.harness import WorldPool, run_distributed


def test_header_round_trip() -> None:
    metas = (TensorMeta((4, 16, 8), torch.float32), TensorMeta((4, 16), torch.int64), TensorMeta((), torch.bfloat16))
    for packed in (True, False):
        h = encode_header(packed, metas, microbatches=4)
        assert h.shape == (header_length(4),) == (HEADER_LEN + 1 + 4 * 4,) and h.dtype == torch.int64
        assert decode_header(h) == (packed, metas, None)   # no shape table: every microbatch one shape
    assert describe(metas) == "float32[4, 16, 8], int64[4, 16], bfloat16[]"


def test_header_errors() -> None:
    with pytest.raises(ValueError, match="at most 15 tensors"):
        encode_header(True, [TensorMeta((1,), torch.float32)] * 16)
    with pytest.raises(ValueError, match="header, more than 64"):
        encode_header(True, [TensorMeta((1,) * 30, torch.float32)] * 3)
    with pytest.raises(TypeError, match="cannot send dtype torch.complex64"):
        encode_header(False, [TensorMeta((1,), torch.complex64)])
    with pytest.raises(ValueError, match="corrupt header"):
        decode_header(torch.full((HEADER_LEN,), 7, dtype=torch.int64))


def test_tag_space_overflow_is_an_error_not_a_wrap() -> None:
    with pytest.raises(ValueError, match=r"need tags up to .* beyond Gloo's 16777216; .* 'strict' wire mode"):
        Wire(torch.device("cpu"), lambda p: p, lambda c: c, 64, 6000, mode="tags", coalesce=False)
    Wire(torch.device("cpu"), lambda p: p, lambda c: c, 64, 6000, mode="strict", coalesce=False)  # one tag


def test_a_gloo_step_that_sends_hands_the_core_over_and_one_that_only_receives_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a send hands its core over] in device.py: after the sends of a comm step are started, the sender yields
    (once per step); a step of receives alone keeps the core."""
    import pipeengine.runtime.wire as wire_module

    class Group:   # the process group's send and recv, started and recorded
        def __init__(self) -> None:
            self.ops: list[str] = []

        def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
            self.ops.append("send")

        def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
            self.ops.append("recv")
    yields: list[list[str]] = []
    group = Group()
    monkeypatch.setattr(wire_module, "hand_over", lambda: yields.append(list(group.ops)))

    class Watch:   # every wait already complete
        def wait(self, *args: Any, **kwargs: Any) -> None:
            pass
    wire = Wire(torch.device("cpu"), lambda p: p, lambda c: 0, 2, 4, mode="tags", coalesce=False,
                watcher=Watch())  # type: ignore[arg-type]
    wire._pg, wire._group_rank = group, {1: 1}
    wire.put(Kind.F, 0, 0, torch.zeros(2))
    wire.post((A("sendH0>1"),))
    wire.post((A("sendF0>1"), A("recvB0<1")))
    wire.post((A("recvB1<1"),))
    assert group.ops == ["send", "send", "recv", "recv"]
    assert yields == [["send"], ["send", "send", "recv"]]   # after each step's sends started, not after receives


@pytest.mark.parametrize("mode", ["tags", "strict", "coalesced"])
def test_settle_waits_for_gloo_sends_only_after_a_compute_and_for_strict_modes_last_step_always(mode: str) -> None:
    """Sends of comm steps with no compute between them are held together, as one batch would hold them."""
    wire = Wire(torch.device("cpu"), lambda p: p, lambda c: 0, 2, 4, mode="strict" if mode == "coalesced" else mode,
                coalesce=mode == "coalesced")
    waited: list[str] = []

    def complete(tr: Any) -> None:   # as Wire._complete, without a process group
        if not tr.done:
            waited.append(str(tr.action))
            tr.done = True
    wire._complete = complete   # type: ignore[method-assign]
    for after_compute in (False, True):
        send, recv = wire_transfer("sendF0>1"), wire_transfer("recvB0<1")
        wire._sends = [send]   # what post() leaves: every send; the whole last step only in strict mode
        wire._last_step = [send, recv] if mode == "strict" else []
        waited.clear()
        had_to_wait = wire.settle(after_compute)
        want = {"strict": ["sendF0>1", "recvB0<1"], "tags": ["sendF0>1"] if after_compute else [], "coalesced": []}
        assert (waited, had_to_wait) == (want[mode], bool(want[mode])), after_compute


def wire_transfer(text: str) -> Any:
    from pipeengine.runtime.transfer import Transfer
    return Transfer(A(text), 1, (torch.zeros(1),))


def A(text: str) -> Action:
    return Action.parse(text)


def exchange(rank: int, world: int, mode: str) -> list[str]:
    wire = Wire(torch.device("cpu"), lambda p: p, lambda c: rank, 2, 4,
                mode="strict" if mode == "coalesced" else mode, coalesce=mode == "coalesced")
    wire.log = []
    checks = []
    g = torch.Generator().manual_seed(0)
    act = (torch.randn(4, 16, 8, generator=g), torch.randint(0, 5, (4, 16), generator=g))
    grad = torch.randn(4, 16, 8, generator=g)
    if rank == 0:   # send the activation (a tuple) and receive its gradient in ONE step
        wire.put(Kind.F, 0, 0, act)
        wire.post((A("sendH0>1"),))
        wire.post((A("sendF0>1"), A("recvB0<1")))
        (got,) = wire.take(Kind.RECV_B, 0, 0)
        wire.finish()
        checks.append(str(torch.equal(got, grad)))
    else:
        wire.post((A("recvH0<0"),))
        wire.post((A("recvF0<0"),))
        x = wire.take(Kind.RECV_F, 0, 0)
        checks.append(str(isinstance(x, tuple) and torch.equal(x[0], act[0]) and torch.equal(x[1], act[1])
                          and x[1].dtype == torch.int64))
        wire.put(Kind.B, 0, 0, (grad,))
        wire.post((A("sendB0>0"),))
        wire.finish()
    for seq in (16, 23):   # shapes change between steps: each step's stream starts with a header
        wire.begin_step()
        t = torch.arange(2 * seq, dtype=torch.float64).view(2, seq)
        if rank == 0:
            wire.put(Kind.F, 1, 0, t)
            wire.post((A("sendH1>1"),))
            wire.post((A("sendF1>1"),))
            wire.finish()
        else:
            wire.post((A("recvH1<0"),))
            wire.post((A("recvF1<0"),))
            r = wire.take(Kind.RECV_F, 1, 0)
            checks.append(str(isinstance(r, torch.Tensor) and torch.equal(r, t)))   # a lone tensor stays one
            wire.finish()
    checks.append(repr(wire.log))
    if mode == "tags":   # out of order: rank 1 waits for microbatch 2, rank 0 only ever sends microbatch 3
        wire.begin_step()
        watch().timeout = 1
        try:
            if rank == 0:
                wire.put(Kind.F, 3, 0, grad)
                wire.post((A("sendH3>1"),))
                wire.post((A("sendF3>1"),))   # not waited: must not hang
                time.sleep(3.5)                 # stay alive until rank 1 has timed out
            else:
                wire.post((A("recvH3<0"),))
                wire.post((A("recvF2<0"),))   # posting never waits; taking does
                wire.take(Kind.RECV_F, 2, 0)
            checks.append("no timeout")
        except P2PTimeout as exc:
            checks.append(str(exc))
    return checks   # no collective after a Gloo timeout: the pair is closed by then


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [pytest.param("tags", marks=pytest.mark.slow), "strict", "coalesced"])
def test_header_steps_tuples_shape_change_and_posted_ops(mode: str, request: pytest.FixtureRequest) -> None:
    if mode == "tags":   # it times out on purpose at the end: fresh ranks
        r0, r1 = run_distributed(exchange, 2, mode, timeout=80)
    else:
        r0, r1 = request.getfixturevalue("world2").run(exchange, mode, timeout=80)
    assert r0[0] == "True" and r1[:3] == ["True", "True", "True"], (r0, r1)
    log0 = eval(r0[1])   # noqa: S307 - our own repr of (action, send|recv, peer, tag, bytes) tuples
    # exactly the posted actions, in program order, one op per tensor; tags per transfer only in tags mode
    assert [(a, d) for a, d, _, _, _ in log0] == [
        ("sendH0>1", "send"), ("sendF0>1", "send"), ("sendF0>1", "send"), ("recvB0<1", "recv"),
        ("sendH1>1", "send"), ("sendF1>1", "send"), ("sendH1>1", "send"), ("sendF1>1", "send")]
    tags = {t for _, _, _, t, _ in log0}
    assert [n for a, _, _, _, n in log0 if a == "sendF0>1"] == [4 * 16 * 8 * 4, 4 * 16 * 8]
    assert (tags == {0}) == (mode != "tags"), tags
    if mode == "tags":
        assert r1[4].startswith("rank 1: waits 1.0 s in recvF2<0 for rank(s) 0: no completion after 1 s"), r1[4]
        # the wait-for report: rank 0 was alive and said so
        assert "\n  rank 0: runs outside the engine" in r1[4], r1[4]


SHAPES = [(4, 8), (4, 8), (4, 8), (2, 8), (2, 8), (2, 8), (4, 8), (4, 8), (4, 8)]   # the first payload's, per step


def guessing(rank: int, world: int, train_flags: list[bool]) -> list[tuple[bool, list[int], bool]]:
    """Steps whose stream's shapes change now and then; per step on the receiving rank: whether the first payload's
    receive went with the header's, the tags its data came on, and whether it arrived intact."""
    program = [(A("sendH0>1"),), (A("sendF0>1"),)] if rank == 0 else [(A("recvH0<0"),), (A("recvF0<0"),)]
    wire = Wire(torch.device("cpu"), lambda p: p, lambda c: rank, 2, 1, mode="tags")
    out = []
    for step, (shape, train) in enumerate(zip(SHAPES, train_flags)):
        wire.begin_step(None, receives_ahead(program), train)
        wire.log = []
        x = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape) + step
        if rank == 0:
            wire.put(Kind.F, 0, 0, x)
            for st in program:
                wire.post(st)
        else:
            wire.post(program[0])
            with_header = any(a.startswith("recvF") for a, *_ in wire.log)
            wire.post(program[1])
            got = wire.take(Kind.RECV_F, 0, 0)
            out.append((with_header, sorted({tag for a, way, _, tag, n in wire.log if a.startswith("recvF")}),
                        torch.equal(got, x)))
        wire.finish()
        assert not wire.live_tensors()
    return out


@pytest.mark.timeout(60)
def test_the_first_payload_goes_with_its_header_once_two_steps_agreed(world2: WorldPool) -> None:
    """[Note: the first payload with its header]: no guess until two steps of a kind had the same header; then the
    payload's receive goes with the header's; a changed shape sends a void message where the payload was expected and
    the payload on the header's block of tags (16 x 2 + 1 on), and stops the guessing until two steps agree again;
    train and eval steps guess apart. Every payload arrives intact."""
    _, got = world2.run(guessing, [True] * len(SHAPES), timeout=50)
    normal, moved = [0], [33]
    assert got == [(False, normal, True), (False, normal, True), (True, normal, True),   # two agreed: a guess
                   (True, normal + moved, True), (False, normal, True), (True, normal, True),   # a miss, then agreed
                   (True, normal + moved, True), (False, normal, True), (True, normal, True)], got
    _, got = world2.run(guessing, [True, False] * 5, timeout=50)   # each kind sees its own history
    # train: A A B A A (two agreed, a miss, then no guess); eval: A B B A (a miss after two Bs)
    assert [g for g, _, _ in got] == [False, False, False, False, True, False, False, True, False], got
    assert all(ok for _, _, ok in got), got


class _SlowOnce(torch.nn.Module):
    """A linear layer whose first forward of a step sleeps ``pause`` seconds (a long stage 0 before the fill)."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.lin, self.pause = torch.nn.Linear(4, 4), pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
            self.pause = 0.0
        return self.lin(x)


def _header_wait(rank: int, world: int) -> list[tuple[str, float]]:
    from pipeengine.runtime.engine import PipelineEngine
    engine = PipelineEngine([_SlowOnce(0.5 if rank == 0 else 0.0), torch.nn.Linear(4, 4)],
                            lambda out, y: (out - y).pow(2).mean(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                            microbatches=2, partition=[0, 1, 2])
    x = torch.randn(4, 4)
    result = engine.train_batch(iter([(x, x)] * 2))
    engine.close()
    return [(r.kind, r.end - r.start) for r in result.records]


@pytest.mark.timeout(60)
def test_a_header_steps_wait_for_its_header_is_timed_as_waiting_not_as_posting(world2: Any) -> None:
    """The last stage's first comm step waits for stage 0's (slow) first forward to send its header: that wait is
    a WAIT record (the bubble, as the simulator counts it), the posting beside it a short COMM one."""
    _, last = world2.run(_header_wait)
    assert last[0][0] == "COMM" and last[1][0] == "WAIT" and last[1][1] >= 0.4, last[:3]
    assert sum(d for kind, d in last if kind == "COMM") < last[1][1] / 4, last
