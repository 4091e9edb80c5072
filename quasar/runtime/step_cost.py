"""What more rows cost a fused W8A8 step on this CPU: measured on the model itself, with
priors per kernel path for models not measured yet.

A verifier step of k rows (drafts, tree nodes, batched sequences) costs little more than a
one-row step where the GEMMs have arithmetic to spare while the weights stream in (AMX
tiles; a large model) and real time where they do not (AVX2's int8 products; a small model
whose weights sit in L3). Rather than guessing from the CPU's name, :func:`measure` times
steps of ``PROBE_ROWS`` rows of the model on the active kernel path, interleaved round by
round, and caches them under the model's shapes, the kernel path and build and the thread
count (``$QUASAR_CACHE/step_costs``): the fastest one-row step (other processes only ever
add time) and, for more rows, the median of each round's ratio to that round's one-row step
(a shared host's memory bandwidth drifts over minutes; within a round it holds, so ratios
read within one round agree where the fastest times of each row count, taken in different
rounds, need not). :class:`StepCosts` turns them into what the decoder weighs drafts with:

- ``pass_rows``: the most probed rows a step takes while each row past the first costs at
  most ``CHEAP_ROW`` of a one-row step (at least ``MIN_PASS_ROWS``, a chain of k = 5
  drafts): the rows a tree may use;
- ``row_cost``: the least-squares slope of the step's time over its rows up to
  ``pass_rows``, as a fraction of a one-row step (``Transformer.row_cost``);
- ``row_prices``: what each row past the first adds, read off the probed times (between
  probes linearly): where a step's GEMMs hide a few rows under the weight stream and then
  pay for each, one slope would price the free rows and the dear ones alike
  (``Transformer.row_prices``, what tree drafts are sized by, until the decoder's own steps
  price them again: quasar.runtime.learned_prices);
- ``rows_are_cheap``: ``pass_rows`` reaches ``TREE_ROWS``;
- ``prefers_trees``: rows are cheap or a one-row step takes ``TREE_STEP_SECONDS`` or more, so
  ``--drafter auto`` drafts trees;
- ``prefetch_whole``: on the AVX2 and AVX-VNNI paths (and for W4A8 layers on every SIMD
  path), whether a one-row step is faster with
  its weight streams prefetched in software throughout or only at their starts
  (``ext.prefetch_whole_stream``; the probe times one-row steps both ways, interleaved, and
  :func:`install_measured` sets the faster). It depends on the CPU's hardware prefetcher and
  on how long the model's streams are;
- ``prefetch_bytes``: for a model with W4A8 layers on a SIMD path, how far ahead their
  kernels prefetch (``ext.w4_prefetch_distance``): the one of ``PREFETCH_DISTANCES`` whose
  steps of ``DISTANCE_ROWS`` rows are fastest, timed interleaved before the probe above
  (which runs at it). Too far ahead and a step of several rows evicts lines before it reads
  them on some CPUs; too near and the lines arrive late on others.

``scripts/tools/step_rows.py`` prints the same times with their floor.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from quasar.defaults import DEFAULT_ROW_COST
from quasar.fileio import write_atomic
from quasar.kernels import ext
from quasar.models.rows import Rows
from quasar.models.moe import sparse_blocks
from quasar.paths import cache_dir
from quasar.runtime.learned_prices import LearnedRowPrices, joined_prices
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w8a8 import Int8Linear

__all__ = ["PREFETCH_CHOICE_PATHS", "PREFETCH_DISTANCES", "PROBE_ROWS", "StepCosts", "current", "expected_experts",
           "expert_row_cost", "install_measured", "key_cost", "measure", "prior_pass_rows", "step_bytes",
           "touched_bytes", "prior_row_cost"]

PROBE_ROWS = (1, 2, 4, 8, 16)
# A row costing at most this share of a one-row step is cheap enough to fill a pass with.
# AMX steps stay under it to 16 rows; the AVX512-VNNI kernel's second pass over each weight
# tile (7+ rows) and AVX2's int8 products (three instructions a product pair) do not.
CHEAP_ROW = 0.04
# The least a row is priced at: rows are never free to the host (it proposes and scores them).
MIN_ROW_PRICE = 0.005
MIN_PASS_ROWS = 6  # the pending token and a chain of 5 drafts: never fewer
TREE_ROWS = 16  # a step that takes 16 cheap rows is worth drafting trees for
# A one-row step at least this long is worth drafting trees for even where rows are dear: the
# host's share of a tree step (proposing the tree in Python, scoring its rows) is small beside
# it, and a tree priced by the measured row cost (DraftTree.worth_keeping) keeps only the nodes
# that pay, so it beats the chain, which drafts up to k tokens on any n-gram match. Shorter
# steps (the default model's) lose to the chain: the host's share is larger there.
TREE_STEP_SECONDS = 0.010
_ROUNDS = 7
_PROMPT_TOKENS = 32
_VERSION = 4  # of the probe: a change here invalidates cached results
# Kernel paths whose int8 one-row passes can leave their stream to the hardware prefetcher
# (the W4A8 kernels can on every path but the portable one).
PREFETCH_CHOICE_PATHS = ("avx2", "avx-vnni")
# The W4A8 kernels' prefetch distances the probe tries, and the rows of the steps it times
# them by: a tree step's usual few.
PREFETCH_DISTANCES = (8 << 10, 16 << 10, 32 << 10)
DISTANCE_ROWS = (2, 4)


# ---------------------------------------------------------------- priors
# Before a model's step is measured (models built outside LLM: the quantizer's, the tests'),
# its row cost and pass rows come from the kernel path: per-row costs of the default model
# (135 MB of int8 weights) from scripts/tools/step_rows.py and scripts/tools/compare_drafters.py (the
# figures are in docs/bench/HISTORY.md). AMX is priced a little under its measured cost
# because a path's probability, the product of its edges', undervalues deep nodes of a text
# that repeats; the AVX512-VNNI kernel keeps 6 rows in registers and makes a further pass
# over each weight tile past them; below AVX512 each int8 product pair takes three
# instructions. A row's work grows with the model like the step's bytes, but its fixed share
# shrinks: the cost is scaled by sqrt(135 MB / the model's int8 bytes).
AMX_ROW_COST = 0.02
VNNI_ROW_COST = 0.07
AVX2_ROW_COST = 0.25
_REFERENCE_BYTES = 135e6
# Rows one pass of the GEMMs over each weight tile takes: a tdpbusd's 16 rows with AMX, 6
# rows in registers with VNNI (the lower paths too: a chain of 5 drafts).
AMX_PASS_ROWS = 16
VNNI_PASS_ROWS = 6


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s quantized weights, what a step of a dense model streams: every
    Int8Linear's in x out, every W4A8Linear's in x out / 2 and its groups' scales and offsets
    (float16, or the Q4_K form's codes and superblock factors; a Q6_K layer's 6.5625 bits). A mixture-of-experts step reads fewer: see step_bytes."""
    total = 0
    for m in model.modules():
        if not getattr(m, "streamed", True):  # read a few rows a step (a RefinedHead's int8 head)
            continue
        if isinstance(m, Int8Linear):
            total += m.in_features * m.out_features
        elif isinstance(m, W4A8Linear):
            total += m.step_bytes()
    return total


def expected_experts(n_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens reach when each picks `top_k` of `n_experts` uniformly at
    random (expected): n (1 - (1 - k / n)^rows)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


def expert_bytes(model: nn.Module) -> tuple[int, list[float]]:
    """(quantized bytes outside the experts, one expert's mean bytes in each sparse layer)."""
    per_layer = [[weight_bytes(e) for e in block.experts] for block in sparse_blocks(model)]
    return weight_bytes(model) - sum(map(sum, per_layer)), [sum(p) / len(p) for p in per_layer]


def step_bytes(model: nn.Module, rows: int = 1) -> float:
    """Quantized bytes a step of `rows` rows streams: all of a dense model's; of a sparse
    layer, the experts its rows reach (expected_experts: routing taken as uniform)."""
    dense, experts = expert_bytes(model)
    return dense + sum(b * expected_experts(len(block.experts), block.top_k, rows)
                       for b, block in zip(experts, sparse_blocks(model)))


def touched_bytes(model: nn.Module) -> float:
    """Quantized bytes the model's last step read: everything outside the experts and, in
    each sparse layer, the experts its rows reached (SparseMoE.last_experts)."""
    dense, experts = expert_bytes(model)
    return dense + sum(b * len(block.last_experts) for b, block in zip(experts, sparse_blocks(model)))


def expert_row_cost(model: nn.Module | None) -> float:
    """What one more row adds to a one-row step of a mixture-of-experts model by the experts
    it reaches, as a fraction of that step's bytes: the mean over a step of MIN_PASS_ROWS rows
    (0 for a dense model: its rows share every weight)."""
    if model is None or not sparse_blocks(model):
        return 0.0
    one = step_bytes(model, 1)
    return (step_bytes(model, MIN_PASS_ROWS) - one) / ((MIN_PASS_ROWS - 1) * max(one, 1.0))


def prior_row_cost(model: nn.Module | None = None) -> float:
    """What one more row costs a fused W8A8 step of `model` on this kernel path before it is
    measured (Transformer.row_cost), as a fraction of a one-row step: the path's cost on the
    default model, scaled down as sqrt(135 MB / the bytes of a one-row step) (at most 4x),
    plus, for a mixture-of-experts model, the bytes of the experts one more row reaches
    (expert_row_cost)."""
    path = ext.kernel_path()
    if path == "amx":
        base = AMX_ROW_COST
    elif path == "avx512-vnni":
        base = VNNI_ROW_COST
    elif path in ext.KERNEL_PATHS:
        base = AVX2_ROW_COST
    else:
        return min(1.0, DEFAULT_ROW_COST + expert_row_cost(model))
    if model is None:
        return base
    streamed = step_bytes(model, 1)
    return min(1.0, base * min(1.0, max(0.25, (_REFERENCE_BYTES / max(streamed, 1)) ** 0.5))
               + expert_row_cost(model))


def prior_pass_rows() -> int | None:
    """Rows a fused W8A8 step takes in one pass over its weights on this kernel path before it
    is measured (None without the C++ op)."""
    if ext.amx_supported():
        return AMX_PASS_ROWS
    return VNNI_PASS_ROWS if ext.small_m_supported() else None


def key_cost(model: nn.Module) -> float:
    """A one-row fused step's extra time per cached key, as a fraction of its time without
    context (Transformer.key_cost): both stream from memory, so the ratio of a key's K/V bytes
    (every layer, in the KV cache's dtype) to the quantized weight bytes (weight_bytes)."""
    cfg = model.config
    elem = torch.finfo(model.kv_dtype or torch.float32).bits // 8
    key_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return key_bytes / max(step_bytes(model, 1), 1)


# ---------------------------------------------------------------- measured
@dataclass(frozen=True)
class StepCosts:
    """Seconds of a fused step of each probed row count (the fastest of a few), on one kernel path."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    kernel_path: str
    prefetch_whole: bool | None = None  # None: the path has no such choice
    prefetch_bytes: int | None = None  # None: no W4A8 layers, or the portable path

    def ratio(self, k: int) -> float:
        """A k-row step's time over a one-row step's."""
        return self.seconds[self.rows.index(k)] / self.seconds[self.rows.index(1)]

    @property
    def pass_rows(self) -> int:
        cheap = [k for k in self.rows if self.ratio(k) <= 1.0 + CHEAP_ROW * (k - 1)]
        return max(MIN_PASS_ROWS, *cheap)

    @property
    def row_cost(self) -> float:
        ks = [k for k in self.rows if 1 < k <= max(self.pass_rows, 2)]
        slope = sum((k - 1) * (self.ratio(k) - 1.0) for k in ks) / sum((k - 1) ** 2 for k in ks)
        return min(1.0, max(MIN_ROW_PRICE, slope))

    @property
    def row_prices(self) -> tuple[float, ...]:
        """What rows 2, 3, ... up to the most probed add to a step, each as a fraction of a
        one-row step: the probed times joined by straight lines, never falling (a probe faster
        than one of fewer rows was noise), at least MIN_ROW_PRICE a row."""
        return joined_prices([(k, self.ratio(k)) for k in self.rows], MIN_ROW_PRICE)

    def install_prefetch(self) -> None:
        """Set the prefetch choices measured with these costs, process-wide (the fused step
        sets its model's before each call: another model may have set its own meanwhile)."""
        if self.prefetch_whole is not None:
            ext.prefetch_whole_stream(self.prefetch_whole)
        if self.prefetch_bytes is not None:
            ext.w4_prefetch_distance(self.prefetch_bytes)

    @property
    def rows_are_cheap(self) -> bool:
        return self.pass_rows >= TREE_ROWS

    @property
    def prefers_trees(self) -> bool:
        """Whether ``--drafter auto`` drafts trees here (TREE_ROWS, TREE_STEP_SECONDS)."""
        return self.rows_are_cheap or self.seconds[self.rows.index(1)] >= TREE_STEP_SECONDS


def _cache_key(model: nn.Module, path: str) -> str:
    cfg = model.config
    parts = (_VERSION, path, ext.build_dir().name, torch.get_num_threads(), cfg.hidden_size, cfg.num_layers,
             cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, str(model.kv_dtype),
             weight_bytes(model), PROBE_ROWS)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def _probe(model: nn.Module, choose_prefetch: bool,
           choose_distance: bool) -> tuple[tuple[float, ...], bool | None, int | None]:
    """The time of a step of each of PROBE_ROWS rows after a short prompt, in a cache of its own
    (the model's cache is put back): the fastest one-row step, and the k-row steps as that
    times the median ratio of a round's k-row step to its one-row step. choose_prefetch:
    one-row steps are timed with the whole stream prefetched and with only its starts, in
    turn, and the faster way is returned with its time (else None and the current way's).
    choose_distance: first, steps of DISTANCE_ROWS rows are timed at each of
    PREFETCH_DISTANCES in turn, and the rest runs at (and returns) the fastest (else None)."""
    saved, saved_prefetch, saved_costs = model.cache, ext.prefetch_whole_stream(), model.step_costs
    saved_distance = ext.w4_prefetch_distance()
    model.cache = None
    model.step_costs = None  # else the fused step would set its earlier choices over the probe's
    ways = (True, False) if choose_prefetch else (saved_prefetch,)
    try:
        model.setup_cache(_PROMPT_TOKENS + max(PROBE_ROWS) + 1, 1)
        ids = [(7 * i + 3) % model.config.vocab_size for i in range(_PROMPT_TOKENS)]

        def step_seconds(k: int) -> float:
            rows = Rows.chain(ids[:k], 0, model.cache.lengths)
            t0 = time.perf_counter()
            model.step(rows)
            return time.perf_counter() - t0

        with torch.inference_mode():
            model(torch.tensor([ids]), logits="none")
            for k in PROBE_ROWS:  # warm-up: scratch buffers of each size
                step_seconds(k)
            distance = _fastest_distance(step_seconds) if choose_distance else None
            if distance is not None:
                ext.w4_prefetch_distance(distance)
            times: dict[tuple[int, bool], list[float]] = {}
            for _ in range(_ROUNDS):
                for k in PROBE_ROWS:
                    for way in ways if k == 1 else (saved_prefetch,):  # only one-row passes differ
                        ext.prefetch_whole_stream(way)
                        times.setdefault((k, way), []).append(step_seconds(k))
        best = min(ways, key=lambda way: min(times[(1, way)]))
        one = times[(1, saved_prefetch)]  # each round's one-row step, beside its k-row ones
        seconds = tuple(min(times[(1, best)]) if k == 1 else
                        min(one) * statistics.median(t / o for t, o in zip(times[(k, saved_prefetch)], one))
                        for k in PROBE_ROWS)
        return seconds, (best if choose_prefetch else None), distance
    finally:
        model.cache, model.step_costs = saved, saved_costs
        ext.prefetch_whole_stream(saved_prefetch)
        ext.w4_prefetch_distance(saved_distance)


def _fastest_distance(step_seconds) -> int:
    """The prefetch distance of PREFETCH_DISTANCES whose steps of DISTANCE_ROWS rows take the
    least time: each distance's median step of each row count, in rounds that take the
    distances in turn (so a drift of the host's bandwidth reaches them alike), summed."""
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(_ROUNDS):
        for d in PREFETCH_DISTANCES:
            ext.w4_prefetch_distance(d)
            for k in DISTANCE_ROWS:
                times.setdefault((d, k), []).append(step_seconds(k))
    return min(PREFETCH_DISTANCES, key=lambda d: sum(statistics.median(times[(d, k)]) for k in DISTANCE_ROWS))


def measure(model: nn.Module) -> StepCosts | None:
    """The step costs of W8A8 `model` on the active kernel path (cached), or None when its
    steps do not run fused (no C++ op, not an int8 model)."""
    if getattr(model, "step_kernel", None) is None or ext.decoder_layer_op() is None:
        return None
    path = ext.kernel_path()
    has_w4 = path != "portable" and any(isinstance(m, W4A8Linear) for m in model.modules())
    # every path's W4A8 kernels have the choice, the AVX2 / AVX-VNNI int8 ones too
    choose_prefetch = path in PREFETCH_CHOICE_PATHS or has_w4
    file = cache_dir("step_costs") / f"{_cache_key(model, path)}.json"
    try:
        saved = json.loads(file.read_text())
        seconds = tuple(float(s) for s in saved["seconds"])
        prefetch, distance = saved.get("prefetch_whole"), saved.get("prefetch_bytes")
        if len(seconds) == len(PROBE_ROWS) and (prefetch in (True, False)) == choose_prefetch and \
                (distance in PREFETCH_DISTANCES if has_w4 else distance is None):
            return StepCosts(PROBE_ROWS, seconds, path, prefetch, distance)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # not measured yet (or unreadable): measure again
    seconds, prefetch, distance = _probe(model, choose_prefetch, has_w4)
    if _plausible(seconds):  # else a busy machine disturbed the probe: measure again next time
        write_atomic(file, json.dumps({"rows": PROBE_ROWS, "seconds": seconds, "kernel_path": path,
                                       "prefetch_whole": prefetch, "prefetch_bytes": distance}))
    return StepCosts(PROBE_ROWS, seconds, path, prefetch, distance)


def _plausible(seconds: tuple[float, ...]) -> bool:
    """More rows never take much less time than fewer: a step that did was slowed by other
    processes (with two threads on two busy cores an OpenMP barrier can wait a whole time slice)."""
    return all(later >= 0.9 * earlier for earlier, later in zip(seconds, seconds[1:]))


def install_measured(model: nn.Module) -> StepCosts | None:
    """Set `model`'s row cost, row prices and pass rows from its measured step costs, and a
    learner to re-read the prices from its decoders' steps (None: unchanged)."""
    costs = measure(model)
    if costs is not None:
        model.row_cost, model.row_prices, model.pass_rows = costs.row_cost, costs.row_prices, costs.pass_rows
        model.step_costs = costs
        model.learned_prices = LearnedRowPrices(costs.row_prices, MIN_ROW_PRICE)
        costs.install_prefetch()
    return costs


def current(model: nn.Module) -> StepCosts | None:
    """`model`'s step costs on the kernel path active now: measured again (from the cache,
    usually) when the path changed since they were measured (QUASAR_ISA in tests, AMX off)."""
    costs = model.step_costs
    if costs is None or costs.kernel_path != ext.kernel_path():
        costs = install_measured(model)
    return costs
