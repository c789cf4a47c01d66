"""The wire between positions: a step's comm actions as paired isend/irecv, shape headers, tags, buffers.

[Note: the wire is the program]
Every transfer is one comm action of the rank's validated program, posted in program order, one step at a time (in
``tags`` mode a step's receives may go with the step before, [Note: receives one step early]); nothing else goes on
the wire (but one void message after a shape changed, [Note: the first payload with its header]). A forward stream
(what one stage sends the next in one train or eval step) starts with an explicit header action ``sendH``/``recvH``
that the lowering puts in a step of its own before the stream's first payload (schedule/lower.py). A header step
completes before the rank goes on, as the validator's rendezvous semantics assume of every step, so a payload receive
is posted with known (or expected, then checked) shapes and no receive is deferred (the header is the one transfer
the host reads: once per stream and step). Gradients need no header: they have the shapes of what this rank sent.
The header's format, and how it carries each microbatch's shapes: header.py.

[Note: boundary dtype]
With ``boundary`` (``--boundary-dtype bf16``) every fp32 tensor crosses the wire as bf16, activations and their
gradients alike, and is fp32 again on the other side: half the traffic of an fp32 residual stream. The header still
announces fp32 (both sides agree on the setting), so nothing else changes; the rounding at the boundary is the
price: results then depend on where the model is split.

[Note: modes]
``tags`` (Gloo default): tensor ``i`` of transfer ``t = 3 * (microbatch * stages + producer) + direction`` has tag
``16 t + i``; Gloo matches by (peer, tag), so a step's receives are left running. ``strict`` (NCCL semantics on
Gloo, used by the tests): one tag between a pair, so Gloo matches by per-peer order as NCCL does, and a comm step's
ops complete before the next comm step is posted, as on NCCL's one in-order stream. On NCCL (``coalesce``) a step is
one ``batch_isend_irecv``; waits make the compute stream wait, not the host (NCCL's watchdog times out).

[Note: receives one step early]
In ``tags`` mode on Gloo a comm step also posts the receives of the program's next comm step (those whose shapes are
known: not a header, nor a payload whose header has not come unless expected, [Note: the first payload with its
header]). Gloo moves a message only once its receive is posted (a rendezvous: about 0.1 ms here between two
processes), so a receive posted with the step before is usually complete when the compute that takes it starts,
where posted with its own step the rank would wait that long every time (1F1B's last stage after each B, its first
after each F). Each receive keeps its own tag and its program order number, so nothing can match it but its own
send, no wait comes sooner than in the program, and a send still completes no later; strict mode and NCCL post
exactly the program (their per-peer order is the proof's). The price: one comm step's receive buffers held longer.

[Note: the first payload with its header]
A stream's header and its first payload would be two rendezvous in a row on the step's critical path (the fill: each
hop of 1F1B's first microbatch). In tags mode, where a stream's header (its tensors' shapes and dtypes) was the same
in the last two steps of the same kind (train or eval), both ends take it to be the same again: the receiver posts
the first payload's receive with its header's, and the two messages travel together. Both ends decide from what both
saw, so they always agree; the header still comes and is checked. When it differs (shapes changed between steps) the
sender sends a void message of the expected size where the payload was expected, and the payload on tags of its own
(the header's block, after the header), which the receiver posts on reading the header: no wait comes sooner and no
send later than in the program, and the void buffer is released at the step's end. A stream whose shapes keep
changing (ragged batches) stops guessing after a miss, until two steps agree again.

[Note: static training shapes]
With ``static`` (``--static-shapes``) training steps keep the first training step's shapes: after it no header goes
on the wire in a training step (both ends skip the header steps and take the stream as it was), so the host no
longer waits for each stream's header before it queues the stage's F (on CUDA: one host sync per stream and step).
The sender refuses an output that changed, and the first stage microbatches of shapes of their own, with an error
(every rank ends the step: faults.py). Eval steps keep their headers. Off by default: shapes may change otherwise.

[Note: buffer lifetimes]
A received buffer is handed over by ``take()`` and lives as long as the stage needs it. A sent tensor (the stage
kept only its autograd node, see stage.py) is held until its send completed. Gloo's works report completion only
once waited on, so on Gloo a comm step's sends are waited on when the next one is posted (``settle()``): the program
was proven under rendezvous semantics, where every step completes before the rank goes on, so this closes no cycle,
and a stage holds one step's sends whatever the schedule (comm steps with no compute between them count as one: they
are posted back to back, as one batch would be, and the next compute comes after all of them). Sooner, when
``take()`` gets a transfer from a peer, the earlier sends to it in the link's order were received (it posted those
receives before sending this): they are waited on there without blocking. On NCCL ``poll()`` releases them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule import Action, Kind, Step
from .device import hand_over, nccl
from .faults import Watch, watch
from .header import Table, TensorMeta, Tensors, decode_header, describe, encode_header, flatten, follow, header_length
from .transfer import Ahead, P2PTimeout, Transfer, posts_early

__all__ = ["Wire", "MAX_TAG"]

MAX_TAG = 2**24
_HEADERS = (Kind.SEND_H, Kind.RECV_H)


class Wire:
    """Posts a rank's comm steps and hands over what arrives (see the module notes).

    Args:
        device: where buffers live (CUDA for NCCL, CPU for Gloo).
        global_rank: pipeline position -> global rank of this replica's peer.
        stage_of: chunk -> the stage this rank runs as that chunk.
        num_stages, microbatches: sizes of the schedule (they bound the tag space).
        mode: ``tags`` or ``strict`` (Gloo); ignored with ``coalesce`` (NCCL is strict by nature).
        coalesce: post each step as one ``batch_isend_irecv`` (default: when the backend is NCCL).
        watcher: the :class:`~pipeengine.faults.Watch` that times every wait (default: the group's).
    """

    def __init__(self, device: torch.device, global_rank: Callable[[int], int], stage_of: Callable[[int], int],
                 num_stages: int, microbatches: int, *, mode: str = "tags", coalesce: bool | None = None,
                 group: Any = None, watcher: Watch | None = None, boundary: torch.dtype | None = None,
                 static: bool = False) -> None:
        if mode not in ("tags", "strict"):
            raise ValueError(f"wire mode must be 'tags' or 'strict' (got {mode!r})")
        coalesce = nccl(group) if coalesce is None else coalesce
        top = (3 * microbatches * num_stages) * 16
        if mode == "tags" and not coalesce and top > MAX_TAG:
            raise ValueError(f"{microbatches} microbatches x {num_stages} stages need tags up to {top}, beyond "
                             f"Gloo's {MAX_TAG}; use fewer microbatches (a memory budget's pieces count) or the "
                             f"'strict' wire mode (one tag per pair)")
        self.device, self.global_rank, self.stage_of, self.num_stages = device, global_rank, stage_of, num_stages
        self.microbatches = microbatches
        self.mode, self.coalesce, self.group = mode, coalesce, group
        self.early = posts_early(mode, coalesce)   # [Note: receives one step early]
        self.boundary = boundary   # fp32 tensors travel as this dtype (and come back fp32): [Note: boundary dtype]
        self.static = static       # training steps keep the first one's shapes: [Note: static training shapes]
        self.watch = watcher   # times every wait (faults.py); default: the process group's
        self.log: list[tuple[str, str, int, int, int]] | None = None   # (action, send|recv, peer, tag, bytes)
        self._pg: Any = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self._group_rank: dict[int, int] = {}
        # (train, producer stage) -> (its last header's packed and metas, whether the one before was the same)
        self._heard: dict[tuple[bool, int], tuple[tuple[bool, tuple[TensorMeta, ...]], bool]] = {}
        self.begin_step()

    # ------------------------------------------------------------------ per-step state

    def begin_step(self, table: Table | None = None, ahead: Sequence[Ahead] = (), train: bool = True) -> None:
        """Forget the previous step's streams. ``table``: each microbatch's input shape when they differ (known where
        the data is read; elsewhere a header brings it, see [Note: ragged microbatches]); ``ahead``: the step's
        program's :func:`receives_ahead` (in tags mode they go one comm step early, see [Note: receives one step
        early]); ``train``: which kind of step, for [Note: the first payload with its header]."""
        if self.static and train and table is not None:
            raise ValueError(f"static training shapes (--static-shapes): the microbatches of this step have shapes of "
                             f"their own ({', '.join(str(list(t)) for t in table)}); pad them to one shape or leave "
                             f"static shapes off")
        self._table, self._train = table, train
        self._ahead = ahead if self.early else ()
        self._guessed: dict[int, tuple[bool, tuple[TensorMeta, ...]]] = {}   # producer stage -> the header expected
        self._missed: dict[int, tuple[bool, tuple[TensorMeta, ...]]] = {}    # stage -> what its receiver expected
        self._void: list[Transfer] = []                                      # receives a miss left unused
        self.headers_due: list[Transfer] = []                                # headers post() left to read_headers()
        self._outgoing: dict[tuple[Kind, int, int], tuple[bool, Tensors]] = {}   # (F|B, mb, chunk)
        self._incoming: dict[tuple[Kind, int, int], Transfer] = {}              # (recvF|recvB, mb, chunk)
        self._sent: dict[int, tuple[int, bool, tuple[TensorMeta, ...]]] = {}    # stage -> (mb, packed, metas)
        self._streams: dict[int, tuple[int, bool, tuple[TensorMeta, ...]]] = {}  # producer stage -> the same
        self._sends: list[Transfer] = []
        self._last_step: list[Transfer] = []
        self._posted = 0                                                         # transfers posted so far
        self._steps = 0                                                          # comm steps posted so far

    def put(self, kind: Kind, mb: int, chunk: int, value: Any) -> None:
        """Hand over what the stage at ``chunk`` produced for microbatch ``mb``: F output or B input gradients."""
        self._outgoing[(kind, mb, chunk)] = (False, tuple(value)) if kind is Kind.B else flatten(value)

    # ------------------------------------------------------------------ posting

    def _tag(self, a: Action) -> int | None:
        """The first wire tag of a transfer in tags mode (its tensors take the next ones); None: one tag per pair."""
        if self.mode == "strict" or self.coalesce:
            return None
        stage = self.stage_of(a.chunk)
        producer = stage - 1 if a.kind in (Kind.RECV_F, Kind.RECV_H) else stage + (a.kind is Kind.RECV_B)
        return 16 * (3 * (a.microbatch * self.num_stages + producer) + "FBH".index(a.kind.value[-1]))

    def _on_wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels as."""
        return self.boundary if self.boundary is not None and dtype == torch.float32 else dtype

    def _narrow(self, tensors: Tensors) -> Tensors:
        return tuple(t.to(self._on_wire(t.dtype)) for t in tensors) if self.boundary is not None else tensors

    def _widen(self, tensors: Tensors, dtypes: Sequence[torch.dtype]) -> Tensors:
        return tuple(t.to(d) for t, d in zip(tensors, dtypes))

    def _send_tensors(self, a: Action) -> Tensors:
        stage = self.stage_of(a.chunk)
        if a.kind is Kind.SEND_B:
            return self._narrow(self._outgoing.pop((Kind.B, a.microbatch, a.chunk))[1])
        packed, tensors = self._outgoing[(Kind.F, a.microbatch, a.chunk)]
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors)
        if a.kind is Kind.SEND_H:
            self._sent[stage] = (a.microbatch, packed, metas)
            guess = self._guess(stage)
            self._remember(stage, (packed, metas))
            if guess is not None and guess != (packed, metas):
                self._missed[stage] = guess
            return (encode_header(packed, metas, self.device, self._table, self.microbatches),)
        del self._outgoing[(Kind.F, a.microbatch, a.chunk)]
        first, first_packed, first_metas = self._sent[stage]
        expected = follow(first_metas, self._table, first, a.microbatch)
        if (packed, metas) != (first_packed, expected):
            if self.static and self._train:   # (no table then: begin_step refused it)
                raise ValueError(f"static training shapes (--static-shapes): stage {stage}'s output is "
                                 f"({describe(metas)}), in the first training step ({describe(first_metas)}); give "
                                 f"every training step's microbatches one shape (pad them) or leave static shapes off")
            if self._table is None:
                raise ValueError(f"stage {stage} output for microbatch {a.microbatch} is ({describe(metas)}) but for "
                                 f"microbatch {first} of this step it was ({describe(first_metas)}): with inputs of "
                                 f"one shape, all microbatches of one step must share shapes and dtypes (pad them); "
                                 f"they may change between steps")
            raise ValueError(f"stage {stage} output for microbatch {a.microbatch} is ({describe(metas)}), but its "
                             f"input shape {list(self._table[a.microbatch])} makes it ({describe(expected)}): with "
                             f"shapes that change per microbatch a tensor between stages either starts with the "
                             f"microbatch's input shape or keeps one shape (microbatch {first}: "
                             f"{describe(first_metas)}, input {list(self._table[first])})")
        return self._narrow(tensors)

    def _recv_buffers(self, a: Action) -> Tensors:
        stage = self.stage_of(a.chunk)
        if a.kind is Kind.RECV_H:
            return (torch.zeros(header_length(self.microbatches), dtype=torch.int64, device=self.device),)
        first, _, metas = self._streams[stage - 1] if a.kind is Kind.RECV_F else self._sent[stage]
        metas = follow(metas, self._table, first, a.microbatch)
        if a.kind is Kind.RECV_B:   # gradients of the floating-point activations this stage sent
            metas = tuple(m for m in metas if m.dtype.is_floating_point)
        return self._buffers(metas)

    def _buffers(self, metas: Sequence[TensorMeta]) -> Tensors:
        """Empty tensors for ``metas`` as they travel (see [Note: boundary dtype])."""
        return tuple(torch.empty(m.shape, dtype=self._on_wire(m.dtype), device=self.device) for m in metas)

    def post(self, step: Step, after_compute: bool = True, read_headers: bool = True) -> None:
        """Post one comm step (sends, then receives, in program order) after ``settle(after_compute)``, in tags mode
        with the next step's receives ([Note: receives one step early]); it waits only for a header step's header
        ([Note: the wire is the program]), and not yet with ``read_headers`` False: then :meth:`read_headers` does."""
        self.settle(after_compute)
        transfers: list[Transfer] = []
        ops: list[tuple[Transfer, torch.Tensor, int]] = []
        seqs = {a: self._posted + i for i, a in enumerate(step)}   # program order: each link's order too
        self._posted += len(step)
        for a in sorted(step, key=lambda x: not x.kind.is_send):
            if (a.kind, a.microbatch, a.chunk) in self._incoming:
                continue   # posted with the step before ([Note: receives one step early])
            if a.kind in _HEADERS and (kept := self._first_header(a)) is not None:   # not sent: as in the first step
                (self._sent if a.kind is Kind.SEND_H else self._streams)[kept[0]] = (a.microbatch, *kept[1])
                continue
            tr = self._transfer(a, seqs[a])
            transfers.append(tr)
            miss = self._missed.pop(self.stage_of(a.chunk), None) if a.kind is Kind.SEND_F else None
            if miss is not None:   # [Note: the first payload with its header]
                void = Transfer(a, tr.rank, self._buffers(miss[1]), tr.seq)
                self._sends.append(void)
                ops += self._ops(void)
                tr.moved = True
            ops += self._ops(tr)
            if a.kind is Kind.RECV_H and (guess := self._guess(self.stage_of(a.chunk) - 1)) is not None:
                self._guessed[self.stage_of(a.chunk) - 1] = guess
                self._streams[self.stage_of(a.chunk) - 1] = (a.microbatch, *guess)
        ahead = self._ahead[self._steps] if self._steps < len(self._ahead) else ()
        self._steps += 1
        for i, a in ahead:
            if self._known(a):   # with the place its own step gives it in the link's order
                ops += self._ops(self._transfer(a, self._posted + i))
        self._issue(ops)
        self._last_step = transfers if self.mode == "strict" and not self.coalesce else []
        self.headers_due = [tr for tr in transfers if tr.action.kind is Kind.RECV_H]
        if read_headers:
            self.read_headers()

    def read_headers(self) -> None:
        """Wait for the headers the last :meth:`post` received and read them."""
        due, self.headers_due = self.headers_due, []
        for tr in due:   # the one transfer the host reads (watched on CUDA too)
            self._complete(tr)
            values = self._watch().host_values(tr.tensors[0], (tr.action,), [tr.rank], error=P2PTimeout)
            packed, metas, self._table = decode_header(values)
            producer = self.stage_of(tr.action.chunk) - 1
            self._streams[producer] = (tr.action.microbatch, packed, metas)
            self._remember(producer, (packed, metas))
            guess = self._guessed.pop(producer, None)
            if guess is not None and guess != (packed, metas):   # the first payload comes on tags of its own
                key = (Kind.RECV_F, tr.action.microbatch, tr.action.chunk)
                self._void.append(self._incoming[key])
                self._issue(self._ops(self._transfer(self._void[-1].action, self._void[-1].seq, moved=True)))

    def settle(self, after_compute: bool = True) -> bool:
        """Complete what the proven program completes before the next comm step: Gloo's earlier sends
        ([Note: buffer lifetimes]; not when the step follows another comm step, ``after_compute`` False: the
        sends of comm steps with no compute between them are held together, as if one batch), strict mode's
        last step ([Note: modes]). Whether it had to wait."""
        sends = [] if self.coalesce or not after_compute else self._sends
        pending = [tr for tr in self._last_step + sends if not tr.done]
        for tr in pending:
            self._complete(tr)
        self._last_step = []   # (the completed sends are dropped by the next poll())
        return bool(pending)

    def _issue(self, ops: list[tuple[Transfer, torch.Tensor, int]]) -> None:
        if self.log is not None:
            self.log += [(str(tr.action), "send" if tr.action.kind.is_send else "recv", tr.rank, tag,
                          t.numel() * t.element_size()) for tr, t, tag in ops]
        if not ops:
            return
        if self.coalesce:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if tr.action.kind.is_send else dist.irecv, t,
                                                       tr.rank, self.group, tag) for tr, t, tag in ops])
            for i, (tr, _, _) in enumerate(ops):   # Gloo: a work per op (never wait one twice); NCCL: one for all
                tr.works = tr.works + [works[i]] if len(works) == len(ops) else list(works)
            return
        for tr, t, tag in ops:   # Gloo: each op on its own, started directly on the process group
            if tr.rank not in self._group_rank:
                self._group_rank[tr.rank] = dist.get_group_rank(self._pg, tr.rank)
            fn = self._pg.send if tr.action.kind.is_send else self._pg.recv
            tr.works.append(fn([t], self._group_rank[tr.rank], tag))
        if any(tr.action.kind.is_send for tr, _, _ in ops):
            hand_over()   # to the receiver, woken on this core: [Note: a send hands its core over] in device.py

    def _transfer(self, a: Action, seq: int, moved: bool = False) -> Transfer:
        """The transfer of comm action ``a``, its buffers made (a receive) or taken (a send), and registered."""
        tensors = self._send_tensors(a) if a.kind.is_send else self._recv_buffers(a)
        tr = Transfer(a, self.global_rank(a.peer), tuple(t.detach().contiguous() for t in tensors), seq,
                      done=not tensors, moved=moved)
        if a.kind.is_send:
            self._sends.append(tr)
        elif a.kind is not Kind.RECV_H:
            self._incoming[(a.kind, a.microbatch, a.chunk)] = tr
        return tr

    def _ops(self, tr: Transfer) -> list[tuple[Transfer, torch.Tensor, int]]:
        base = self._tag(tr.action)
        if base is not None and tr.moved:
            base += 2 * 16 + 1   # the header's block (F: 0, H: 2), after the header's one tensor
        return [(tr, t, 0 if base is None else base + i) for i, t in enumerate(tr.tensors)]

    def _first_header(self, a: Action) -> tuple[int, tuple[bool, tuple[TensorMeta, ...]]] | None:
        """For header action ``a`` left out ([Note: static training shapes]): its producer stage and the first training
        step's header, which the stream keeps (the sender checks each output against it); else None."""
        if not (self.static and self._train):
            return None
        producer = self.stage_of(a.chunk) - (a.kind is Kind.RECV_H)
        first = self._heard.get((True, producer))
        return None if first is None else (producer, first[0])

    def _known(self, a: Action) -> bool:
        """Whether receive ``a``'s buffers can be made now: its stream's header came (recvF; or it is the first payload
        of a stream whose header is expected, [Note: the first payload with its header]) or was sent (recvB)."""
        stage = self.stage_of(a.chunk)
        if a.kind is not Kind.RECV_F:
            return stage in self._sent
        stream = self._streams.get(stage - 1)
        return stream is not None and (stage - 1 not in self._guessed or stream[0] == a.microbatch)

    def _guess(self, producer: int) -> tuple[bool, tuple[TensorMeta, ...]] | None:
        """The header both ends expect of ``producer``'s stream this step: the last one where the one before was the
        same, in tags mode (None: no guess), see [Note: the first payload with its header]."""
        last = self._heard.get((self._train, producer))
        return last[0] if last is not None and last[1] and self._ahead else None

    def _remember(self, producer: int, heard: tuple[bool, tuple[TensorMeta, ...]]) -> None:
        last = self._heard.get((self._train, producer))
        self._heard[(self._train, producer)] = (heard, last is not None and last[0] == heard)

    # ------------------------------------------------------------------ completion

    def _watch(self) -> Watch:
        return self.watch or watch()

    def _complete(self, tr: Transfer) -> None:
        if tr.done:
            return
        watcher = self._watch()
        for w in tr.works:   # on CUDA the compute stream waits, not the host (see [Note: modes])
            watcher.wait(w, (tr.action,), [tr.rank], cuda=self.device.type == "cuda", error=P2PTimeout)
        tr.done = True

    def take(self, kind: Kind, mb: int, chunk: int) -> Any:
        """Wait for a posted receive and hand its tensors over (the wire keeps no reference): ``recvF``
        what the producer stage returned (a Tensor or a tuple), ``recvB`` the gradients of its outputs."""
        tr = self._incoming.pop((kind, mb, chunk))
        self._complete(tr)
        for send in self._sends:   # see [Note: buffer lifetimes]
            if send.rank == tr.rank and send.seq < tr.seq:
                self._complete(send)
        self.poll()
        stage = self.stage_of(chunk)
        if kind is Kind.RECV_B:   # the gradients of what this stage sent: its floating-point tensors' dtypes
            return tr.tensors if self.boundary is None else self._widen(
                tr.tensors, [m.dtype for m in self._sent[stage][2] if m.dtype.is_floating_point])
        _, packed, metas = self._streams[stage - 1]
        tensors = tr.tensors if self.boundary is None else self._widen(tr.tensors, [m.dtype for m in metas])
        return tensors if packed else tensors[0]

    def poll(self) -> None:
        """Release sends known to be complete (never waits): waited on, or finished on NCCL (Gloo's works can't say)."""
        self._sends = [tr for tr in self._sends if not (tr.done or (
            self.coalesce and tr.works and all(w.is_completed() for w in tr.works)))]

    def finish(self) -> None:
        """Wait until every send of the step (and every receive a miss left unused) completed and release it."""
        for tr in self._sends + self._void:
            self._complete(tr)
        self._sends, self._void = [], []
        self._last_step = []
        leftover = [str(k) for k in self._incoming] + [str(k) for k in self._outgoing]
        assert not leftover, f"step ended with transfers never used: {leftover}"

    def live_tensors(self) -> list[torch.Tensor]:
        """Every buffer the wire holds right now (sends in flight, receives not yet taken)."""
        return [t for tr in [*self._sends, *self._incoming.values(), *self._void] for t in tr.tensors] + [
            t for _, ts in self._outgoing.values() for t in ts]
