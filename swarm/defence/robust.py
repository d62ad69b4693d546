"""Robust aggregation: what a reducer does with its groupmates' parts, so that one liar moves little.

A reducer holds every sender's copy of its part (not a running sum), and when all
have arrived it computes, in sender order (so the result is a function of the
inputs alone):

1. **checks**: a part of the wrong size, or with a NaN or an infinity, is refused (its
   sender is dropped from the round); a weight that is not a finite number >= 0 is
   refused the same way;
2. **capped weights**: each sender's sample weight is capped at the samples a round can hold
   (by the all-reduce, before this: ``ExactAllReduceRunner.max_weight``, and an auditor refuses a
   receipt that lists more), then at the group's median, so claiming a huge sample count buys
   nothing, in a group of two too;
3. **norm clipping**: each part is scaled down to at most the median of the parts'
   norms, so a scaled pseudo-gradient counts as an ordinary one;
4. **against the grain**: a part with no positive cosine with any other part (a sign-flipped or
   negated pseudo-gradient) is left out, when a majority of parts remains;
5. **CenteredClip** (Karimireddy et al. 2021; BTARD, arXiv 2106.11257): starting from
   the coordinate-wise median, ``v += sum_i w_i * clip(x_i - v, tau) / sum_i w_i`` a
   few times, with ``tau`` the median distance to the start, so a part far from the
   group's consensus pulls with the force of at most ``tau``;
6. **inner range**: each coordinate is clamped between the second-lowest and the
   second-highest of the norm-clipped parts, so one liar cannot drag any coordinate outside what
   the others sent (with three senders this is the coordinate-wise median). Without it a
   sign-flipped pseudo-gradient still pulled like one honest peer every round (the byzantine
   benchmark's current figures: docs/benchmarks.md, section 7).

With honest parts all within ``tau`` of their mean, CenteredClip is the plain
weighted mean (step 6 then moves only the coordinates where the mean lies outside the
inner range). The reducer encodes its result once and every groupmate decodes the
same bytes, so groupmates stay bitwise equal whatever is computed here.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from swarm.manifest import Aggregation

logger = logging.getLogger(__name__)

CENTERED_CLIP_ITERATIONS = 5
# norms are clipped to CLIP_FACTOR x the median norm, deviations to CLIP_FACTOR x the median distance; a liar
# then pulls about as hard as CLIP_FACTOR honest peers (1.0: as one; a larger factor costs honest runs less)
CLIP_FACTOR = 1.0
# more rows than this are sorted by torch (a transposition network costs k^2 row operations)
SORTING_NETWORK_MAX_ROWS = 16
# a pairwise cosine this close to 0 may come out on either side of it on another machine: its float64 Gram entry is
# summed in an order the BLAS picks, off by up to about n * 2**-52 of the norms' product (n values: 1e-9 at 2**22),
# and senders that share a plan can craft parts on that edge. An auditor, or a reader of a proof, recomputes such a
# part every way the parts on the edge could have been kept or left out (``keep_choices``) and finds a reducer wrong
# only if it matches none
COSINE_EDGE = 1e-8
MAX_EDGE_ROWS = 3  # parts on that edge tried every way (2**3 recomputations at most); more: the part is not judged


class RefusedPart(AllreduceException):
    """A sender's part or weight that cannot be averaged: its sender is dropped from the round."""


def check_part(values: torch.Tensor, numel: int, weight: float) -> torch.Tensor:
    """The part as a flat float32 tensor, or RefusedPart saying what is wrong with it."""
    if not (isinstance(weight, float | int) and math.isfinite(weight) and weight >= 0):
        raise RefusedPart(f"a sender's weight is {weight!r}")
    if values.numel() != numel:
        raise RefusedPart(f"a sender's part has {values.numel()} values, not {numel}")
    flat = values.reshape(-1).to(torch.float32)
    if not math.isfinite(float(flat.sum(dtype=torch.float64))):  # one pass; no float32 values overflow it
        raise RefusedPart("a sender's part holds NaN or infinite values")
    return flat


def capped_weights(weights: Sequence[float]) -> torch.Tensor:
    """Each weight capped at the median weight; the upper median for an even count, so that in a group of two
    a slow peer's few samples do not pull the fast peer's weight down to its own."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    return torch.minimum(w, w.sort().values[len(w) // 2])


def robust_mean(
    parts: Sequence[torch.Tensor] | torch.Tensor,
    weights: Sequence[float],
    aggregation: Aggregation,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reducer's result for one part from each sender's checked values (same length, finite): a list, or one
    tensor with a part per row, which is then the work space (its rows change) rather than a copy. ``keep``: which
    parts point along the others (``_against_the_grain_left_out``), as a check decides it (``keep_choices``); None:
    from their cosines, as a reducer does.

    Few part-sized buffers are allocated, and none in a loop: in the averager every block of 1 MiB or more is
    mapped from the system on its own and returned when freed (swarm/averager/heap.py), so each costs page faults.
    Beside the parts, the peak is the three order statistics' rows and a row or two: a reader's check of a run's
    largest part from 8 senders raises its peak RSS by 61.8 MiB, and did by 112.9 with a copy of the parts sorted
    whole (benchmarks/results/check-memory).
    Whatever depends on a sum over a whole part (norms, cosines, CenteredClip's distances) comes from float64
    Gram matrices, and the values are combined elementwise, one row after another, not by float32 BLAS: an
    auditor on another CPU recomputes this, and float32 reductions ordered by the CPU's vector width would
    differ from the reducer's in the last bit of many values."""
    w = capped_weights(weights) if aggregation == Aggregation.centered_clip else torch.tensor(weights).double()
    if float(w.sum()) <= 0:  # everyone sent weight 0 (all auxiliary, say): the plain mean of nothing is zero
        return torch.zeros_like(parts[0])
    if aggregation == Aggregation.mean or len(parts) == 1:  # in float64, one sender after the other
        total = torch.zeros(parts[0].shape, dtype=torch.float64)
        for part, share in zip(parts, (w / w.sum()).tolist()):
            total.add_(part, alpha=share)
        return total.float()
    stacked = parts if isinstance(parts, torch.Tensor) else torch.stack(list(parts))
    w = (w / w.sum()).float()
    gram = _gram64(stacked)
    norms = gram.diagonal().clamp_min(0).sqrt()
    stacked.mul_(torch.clamp(CLIP_FACTOR * norms.median() / norms.clamp_min(1e-30), max=1.0).float()[:, None])
    if len(parts) > 2:  # cosines do not change with the clipping's positive factors
        stacked, w = _against_the_grain_left_out(stacked, w, gram, keep)
    if len(stacked) <= 2:
        return _centered_clip(stacked, w, _combination(torch.zeros_like(stacked[0]), stacked, w))
    low, median, high = order_rows(stacked, (1, (len(stacked) - 1) // 2, len(stacked) - 2))
    center = _centered_clip(stacked, w, median)  # from the (lower) median
    # the inner range (6.), of the norm-clipped parts: against raw parts, a liar sending x1000 would pick, for
    # every coordinate, the honest extreme on its side, and the step would grow
    return center.clamp_(min=low, max=high)


def _centered_clip(stacked: torch.Tensor, w: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """CenteredClip from ``start``: ``v += sum_i w_i * clip(x_i - v, tau)``, CENTERED_CLIP_ITERATIONS times.

    Every centre it visits is ``start + sum_j b_j d_j`` with ``d_j = x_j - start``, so the iterations run on
    the k coefficients ``b`` and the k x k Gram matrix of the ``d_j`` (summed in float64), and the data is
    read three times rather than once per iteration (benchmarks/reduce.py). ``stacked`` becomes the ``d_j``."""
    d = stacked.sub_(start)
    gram = _gram64(d)
    tau = CLIP_FACTOR * gram.diagonal().clamp_min(0).sqrt().median()
    if float(tau) == 0.0:  # at least half the parts are ``start`` itself
        return start.clone()
    k = len(d)
    b = torch.zeros(k, dtype=torch.float64)
    eye, wd = torch.eye(k, dtype=torch.float64), w.double()
    for _ in range(CENTERED_CLIP_ITERATIONS):
        coeff = eye - b  # row i: x_i - centre, in the coefficients of the d_j
        distance = ((coeff @ gram) * coeff).sum(1).clamp_min(0).sqrt()
        b = b + (wd * torch.clamp(tau / distance.clamp_min(1e-30), max=1.0)) @ coeff
    return _combination(start.clone(), d, b.float())


def _combination(out: torch.Tensor, rows: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``out += sum_j coefficients[j] * rows[j]``, in place, one row after another."""
    for row, coefficient in zip(rows, coefficients.tolist()):
        out.add_(row, alpha=coefficient)
    return out


def _gram64(rows: torch.Tensor | Sequence[torch.Tensor], chunk: int = 1 << 15) -> torch.Tensor:
    """``rows @ rows.T`` summed in float64, through one small float64 buffer: the distances CenteredClip
    compares with ``tau`` come from differences of its entries. ``rows``: a tensor, or a list of equal rows."""
    k, n = len(rows), rows[0].numel()
    gram = torch.zeros(k, k, dtype=torch.float64)
    buffer = torch.empty(k, min(chunk, n), dtype=torch.float64)
    for begin in range(0, n, chunk):
        piece = buffer[:, : min(chunk, n - begin)]
        if isinstance(rows, torch.Tensor):
            piece.copy_(rows[:, begin : begin + chunk])
        else:
            for target, row in zip(piece, rows):
                target.copy_(row[begin : begin + chunk])
        gram.addmm_(piece, piece.T)
    return gram


def sorted_rows(stacked: torch.Tensor, spare: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The rows' coordinate-wise order statistics, lowest first: ``stacked.sort(dim=0).values`` as rows.

    For a group's few rows, by odd-even transposition (elementwise min and max of whole rows, in a copy and
    one spare row; in ``stacked``'s own rows when ``spare``, one more row's room, is given): torch's sort along the
    short axis strides across memory and took 20 ms for three rows of 262,144 values, this about 1 ms; the values
    are the same, each taken from the rows, never computed."""
    if len(stacked) > SORTING_NETWORK_MAX_ROWS:
        return list(stacked.sort(dim=0).values)
    if spare is None:
        stacked, spare = stacked.clone(), torch.empty_like(stacked[0])
    rows = list(stacked)
    for sweep in range(len(rows)):
        for i in range(sweep % 2, len(rows) - 1, 2):
            low, high = rows[i], rows[i + 1]
            torch.minimum(low, high, out=spare)
            torch.maximum(low, high, out=high)
            rows[i], spare = spare, low
    return rows


def order_rows(stacked: torch.Tensor, ranks: Sequence[int], chunk: int = 1 << 18) -> list[torch.Tensor]:
    """Rows ``ranks`` of ``sorted_rows(stacked)``, the same values, sorted a block of columns at a time in one
    reused buffer rather than in a copy of every row. A part of one block or less gives its sorted rows as they are:
    copied out, the three rows' fresh pages doubled a reducer's time for parts of 262,144 values."""
    k, n = stacked.shape
    if n <= chunk:
        rows = sorted_rows(stacked)
        return [rows[rank] for rank in ranks]
    out = torch.empty(len(ranks), n, dtype=stacked.dtype)
    block = torch.empty(k, min(chunk, n), dtype=stacked.dtype)
    spare = torch.empty(min(chunk, n), dtype=stacked.dtype)
    for begin in range(0, n, chunk):
        piece = block[:, : min(chunk, n - begin)]
        piece.copy_(stacked[:, begin : begin + chunk])
        rows = sorted_rows(piece, spare[: piece.shape[1]])
        for target, rank in zip(out, ranks):
            target[begin : begin + chunk].copy_(rows[rank])
    return list(out)


def _against_the_grain_left_out(
    stacked: torch.Tensor, w: torch.Tensor, gram: torch.Tensor | None = None, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts that point away from every other part (no positive cosine with any) are left out, if a majority
    remains: a sign-flipped or negated pseudo-gradient then counts for nothing rather than shrinking the step.
    Pairwise, not against the coordinate-wise median: with three senders whose honest pseudo-gradients agree
    only weakly (cosine ~0.1, as two peers' H-step updates on different data do), the median follows the liar
    in every coordinate where the honest two differ in sign, and a -4x liar had a positive cosine with it."""
    if keep is None:
        cosine = _cosines(_gram64(stacked) if gram is None else gram)
        keep = (cosine > 0).any(dim=1)
        if logger.isEnabledFor(logging.DEBUG):
            cosines = [round(float(c), 3) for c in cosine.flatten()]
            logger.debug("pairwise cosines %s: keeping %s", cosines, keep.tolist())
    kept = int(keep.sum())
    if kept == len(stacked) or 2 * kept <= len(stacked):
        return stacked, w
    for target, row in enumerate(keep.nonzero().flatten().tolist()):  # moved up in place: no copy of the rows kept
        if target != row:
            stacked[target].copy_(stacked[row])
    return stacked[:kept], w[keep] / w[keep].sum()


def _cosines(gram: torch.Tensor) -> torch.Tensor:
    """The pairwise cosines of a Gram matrix's rows, 0 on the diagonal."""
    norms = gram.diagonal().clamp_min(0).sqrt()
    return (gram / (norms[:, None] * norms[None, :]).clamp_min(1e-30)).fill_diagonal_(0.0)


def keep_choices(parts: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Every ``keep`` a reducer on some machine may have come to for these parts: the parts whose best cosine with
    another is within ``COSINE_EDGE`` of 0 kept or left out in every combination, the rest as their cosines say; None
    when more than ``MAX_EDGE_ROWS`` parts are on that edge."""
    cosine = _cosines(_gram64(parts))
    sure = (cosine > COSINE_EDGE).any(dim=1)
    edge = ((cosine > -COSINE_EDGE).any(dim=1) & ~sure).nonzero().flatten().tolist()
    if len(edge) > MAX_EDGE_ROWS:
        return None
    choices = []
    for bits in range(2 ** len(edge)):
        keep = sure.clone()
        for bit, row in enumerate(edge):
            keep[row] = bool(bits >> bit & 1)
        choices.append(keep)
    return choices


class RobustPartReducer(TensorPartReducer):
    """hivemind's TensorPartReducer, holding each sender's part and combining them with ``robust_mean``.

    ``straggler_timeout`` (the all-reduce's ``sender_timeout``): a part whose senders have not all sent it that long
    after a sender began waiting for it goes on without the ones missing. hivemind drops a silent sender when its
    stream times out or fails, in the stream's handler; but a handler whose stream ended while it was sending an
    average back is cancelled there, at its ``yield``, and what drops its sender then runs only when the abandoned
    generator is collected (a survivor's own slice waited 128 s for a groupmate killed mid all-reduce)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        aggregation: Aggregation,
        straggler_timeout: float | None = None,
    ):
        self.aggregation, self.straggler_timeout = aggregation, straggler_timeout
        self.received: list[tuple[torch.Tensor, float] | None] = [None] * num_senders
        super().__init__(part_shapes, num_senders)

    def on_sender_failed(self, sender_index: int) -> None:
        if self.sender_failed_after[sender_index] == float("inf"):  # once: a straggler's handler may end later
            super().on_sender_failed(sender_index)

    def _drop_stragglers(self, part_index: int) -> None:
        """The senders that have not sent part ``part_index`` yet are failed from it on (it then completes)."""
        for sender in range(self.num_senders):
            if self.finished.is_set() or part_index != self.current_part_index:
                return
            if self.received[sender] is None and self.sender_failed_after[sender] == float("inf"):
                logger.debug("part %d: sender %d sent nothing for %.0f s, left out", part_index, sender,
                             self.straggler_timeout)  # fmt: skip
                self.on_sender_failed(sender)

    def reset_accumulators(self) -> None:
        self.received = [None] * self.num_senders
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        while part_index > self.current_part_index and not self.finished.is_set():
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
        if self.finished.is_set():
            raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.current_part_index:
            raise RefusedPart(f"a sender sent part {part_index} twice")
        future = self.current_part_future
        # refused (the caller drops this sender): not counted, so nobody waits for it
        flat = check_part(tensor_part, math.prod(self.part_shapes[part_index]), weight)
        # counted only once it is in: a sender that fails while it waits for its turn above is not waited for
        # (``on_sender_failed`` reads this count)
        self.num_parts_received[sender_index] += 1
        self.received[sender_index] = (flat, float(weight))
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        # not ``await future``: hivemind's p2p cancels a sender's handler task when its stream ends (the sender
        # died), and cancelling a task cancels the future it awaits, here the one future every sender of this part
        # and our own slice await: our slice never came back (a survivor waited out its hard timeout, 128 s) and the
        # next sender's part failed on the cancelled future ("invalid state"), so its groupmates dropped our slice
        # too. ``asyncio.wait`` never cancels what it waits for.
        while not future.done():
            await asyncio.wait({future}, timeout=self.straggler_timeout)
            if not future.done():
                self._drop_stragglers(part_index)
        return future.result()

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        # a sender that failed before this part is not in ``received``; one that failed after it still counts
        held = [r for r in self.received if r is not None]
        shape = self.part_shapes[self.current_part_index]
        if held:
            result = robust_mean([p for p, _ in held], [w for _, w in held], self.aggregation).reshape(shape)
        else:
            result = torch.zeros(shape)
        self.current_part_future.set_result(result)
        self.reset_accumulators()
