"""What each pipeline rank holds under torch.distributed.pipelining, the PP torchtitan runs
(`Stack.pipelining == "torch"`), and which rank holds the most.

Read in torch 2.6.0's torch/distributed/pipelining (the release nearest the torch the
torchtitan tables name, 1963fc8 of 2024-12-23, which is not stored here) and torchtitan
9dec370 (torchtitan/parallelisms/pipeline_llama.py, pipelining_utils.py, train.py):

- Layers per stage (`torchtitan_split`): with no `pipeline_parallel_split_points`,
  `generate_split_points` gives the first stage L // S layers, each middle stage one more
  while L % S lasts, and the last stage the rest (126 layers, 8 stages: 15, 16 x 6, 15;
  16 stages: 7, 8 x 14, 7). The first stage also holds the embedding, the last the final
  norm and the output layer (`_build_stage`).
- Order of work (`rank_ops`): Schedule1F1B runs min(m, S - stage) warm-up forwards, then
  one backward and one forward until the forwards run out, then the remaining backwards;
  ScheduleInterleaved1F1B's `_calculate_single_rank_operations`: (v - 1) r + 2 (p - 1 -
  rank) warm-up chunk-forwards (r = m / max(1, m // p) micro-batches a round), capped at
  m v, forwards walking the rank's stages a round at a time, backwards from its last stage
  back.
- What a stage keeps (`rank_peak`): `PipelineStage` (stage.py) allocates, for every one of
  the m micro-batches, a receive buffer for its input (`_prepare_forward_infra`, stages
  after the first) and one for its output's gradient (`_prepare_backward_infra`, stages
  before the last), kept for the whole run; `forward_one_chunk` appends every output to
  `output_chunks`, cleared only by the next step's `clear_runtime_states` (pytorch #153383,
  2025-05, later keeps them on the last stage only: "we should not keep the outputs of each
  stage in memory"), so a stage holds one output per forward it has run, and the last
  stage every micro-batch's logits (bf16, b s V / t under `loss_parallel`; detached after
  its backward, not freed). A forward's saved activations live until its backward; the
  first layer's saved input of a later stage is its receive buffer. The last stage also
  keeps, per micro-batch in flight, the final norm's input and the output layer's input
  (all-gathered over the sequence by `ColwiseParallel(input_layouts=Shard(1))` in
  torchtitan's `apply_tp`) and log_softmax's fp32 output (4 bytes a logit), and at its
  backward the loss's peak (`Stack.logits_bytes`/`tp_logits_bytes`) comes before the
  layers' recomputation (`_maybe_compute_loss` runs the loss after each forward; the
  backward starts from it).
"""

from __future__ import annotations

from dataclasses import dataclass


def torchtitan_split(layers: int, stages: int) -> list[int]:
    """Layers of each pipeline stage as torchtitan's `generate_split_points` (9dec370)."""
    if stages == 1:
        return [layers]
    base, extra = divmod(layers, stages)
    counts = [base]
    for _ in range(stages - 2):
        counts.append(base + (1 if extra > 0 else 0))
        extra -= 1 if extra > 0 else 0
    return counts + [layers - sum(counts)]


def rank_ops(pp: int, vpp: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """(stage, "F" or "B", micro-batch) in the order torch's schedule runs them on `rank`
    (module doc): Schedule1F1B for vpp 1, ScheduleInterleaved1F1B otherwise."""
    if vpp == 1:
        warm = min(m, pp - rank)
        ops = [(rank, "F", i) for i in range(warm)]
        f = warm
        for b in range(m):
            ops.append((rank, "B", b))
            if f < m:
                ops.append((rank, "F", f))
                f += 1
        return ops
    per_round = m // max(1, m // pp)
    warm = min((vpp - 1) * per_round + 2 * (pp - 1 - rank), m * vpp)
    total = m * vpp
    fwd = {s: 0 for s in range(vpp)}
    bwd = {s: 0 for s in range(vpp)}
    ops = []

    def forward(step):
        local = (step // per_round) % vpp
        ops.append((local * pp + rank, "F", fwd[local]))
        fwd[local] += 1

    def backward(step):
        local = vpp - 1 - ((step - warm) // per_round) % vpp
        ops.append((local * pp + rank, "B", bwd[local]))
        bwd[local] += 1

    for step in range(warm):
        forward(step)
    for step in range(warm, total):
        forward(step)
        backward(step)
    for step in range(total, total + warm):
        backward(step)
    return ops


@dataclass(frozen=True)
class StageBytes:
    """Bytes a pipeline stage keeps, on one rank (`rank_peak`): `layer`, one layer's saved
    activations for one micro-batch; `io`, the tensor a stage sends or receives; `head`,
    what the last stage's norm and output layer keep per micro-batch in flight; `logits`,
    one micro-batch's bf16 logits; `loss_saved`, log_softmax's saved output; `loss_peak`,
    the loss's bytes at its backward; `backward`, a layer's transient in backward
    (recomputation, torch's ring-attention buffers)."""

    layer: float
    io: float
    head: float
    logits: float
    loss_saved: float
    loss_peak: float
    backward: float


@dataclass(frozen=True)
class RankPeak:
    """The most one rank holds at once: `activations` (saved activations, receive and
    gradient buffers, outputs kept), `logits` (logits kept, the loss's saved output and, if
    the loss's backward is the moment, its excess) and `transient` (a layer's backward)."""

    rank: int
    activations: float
    logits: float
    transient: float

    @property
    def total(self) -> float:
        return self.activations + self.logits + self.transient


def rank_peak(split: list[int], pp: int, vpp: int, m: int, b: StageBytes,
              rank: int) -> RankPeak:
    """The peak of one rank through its schedule (module doc)."""
    last = pp * vpp - 1
    stages = [rank + k * pp for k in range(vpp)]
    acts = sum((m * b.io if s > 0 else 0.0) + (m * b.io if s < last else 0.0)
               for s in stages)
    logits = 0.0
    best = RankPeak(rank, acts, 0.0, 0.0)

    def saved(s):
        return (split[s] * b.layer - (b.io if s > 0 else 0.0)
                + (b.head if s == last else 0.0))

    for s, kind, _ in rank_ops(pp, vpp, m, rank):
        if kind == "F":
            acts += saved(s) + (0.0 if s == last else b.io)
            logits += b.logits + b.loss_saved if s == last else 0.0
            now = RankPeak(rank, acts, logits, 0.0)
        elif s != last:
            now = RankPeak(rank, acts, logits, b.backward)
        else:   # the loss's backward, then the layers' without the loss's and head's bytes
            loss = RankPeak(rank, acts, logits - b.loss_saved + b.loss_peak, 0.0)
            body = RankPeak(rank, acts - b.head, logits - b.loss_saved, b.backward)
            now = max(loss, body, key=lambda p: p.total)
        if now.total > best.total:
            best = now
        if kind == "B":
            acts -= saved(s)
            logits -= b.loss_saved if s == last else 0.0
    return best


def most_held(split: list[int], pp: int, vpp: int, m: int, b: StageBytes) -> RankPeak:
    """The rank whose peak is the largest (torchtitan prints the maximum over every rank,
    docs/performance.md footnote 1 at eaea6f6)."""
    return max((rank_peak(split, pp, vpp, m, b, r) for r in range(pp)),
               key=lambda p: p.total)
