"""Defaults shared by the API, CLI, server and bench (no heavy imports: `quasar --help` stays fast)."""

# "auto": tree drafts (`--drafter tree`) where a W8A8 step's extra rows are cheap (the fused
# step on a CPU with AMX tiles), else the paper's chain (`ngram`). On this project's 2-core AMX
# machine (`quasar bench`, greedy, 128 tokens, BENCHMARKS.md session 12) trees decode the
# default model 1.07x the chain's tokens/s (1.02-1.11x per task), a 1.5B model 1.18x
# (1.07-1.31x), a 5.3k-token prompt at parity; with the VNNI kernel alone, where every row is
# a further pass of arithmetic, 0.96x (interleaved A/B).
DEFAULT_DRAFTER = "auto"
DEFAULT_VERIFIER = "w8a8"
DEFAULT_CONTEXT = 8192
# The paper's drafter: k = 5 draft tokens, n-grams of 1..3 tokens (vLLM's prompt lookup).
DEFAULT_NUM_DRAFT = 5
DEFAULT_NGRAM_MIN = 1
DEFAULT_NGRAM_MAX = 3
# The most draft tokens (chain k) or tree nodes a step may propose, and the longest n-gram
# a drafter matches (one index per n): bounds that keep a step's rows and a drafter's
# tables small whatever a request asks.
MAX_DRAFT = 64
MAX_NGRAM = 64
# Draft length chosen per step from recent acceptance (speculative.acceptance.AdaptiveDraftLength);
# measured faster than a fixed k on the default model with identical output (BENCHMARKS.md).
DEFAULT_ADAPTIVE = True
# The tree drafter (`--drafter tree`): at most this many draft nodes per step, and how many
# of the verifier's top next tokens per verified row it recycles. Each step verifies only
# the nodes likely enough to pay for their rows (DraftTree.worth_keeping at the verifier's
# row cost) and at most one pass of the fused step's GEMMs (Transformer.pass_rows: 16 rows
# with AMX, 6 with VNNI alone). On the default model (2-core machine, 15 prompts, greedy)
# 15 nodes decode as fast as 5 with AMX and L 1.82 vs 1.67; at 1.5B 16 nodes reach L 1.97
# against the chain's 1.58 (1.08x its tokens/s); without AMX both are capped at 5 nodes.
DEFAULT_DRAFT_BUDGET = 15
# A verifier step's extra time per row, as a fraction of a one-row step (Transformer.row_cost;
# the fused W8A8 step sets its own): what adaptive chain lengths and tree sizes weigh the
# expected accepted tokens against.
DEFAULT_ROW_COST = 0.1
DEFAULT_RECYCLE_TOP_K = 8
# Continuous batching (server and LLM.generate_batch): sequences decoded together, and the
# rows a batched verifier step aims for (greedy drafts are shortened to fit; see
# quasar.speculative.batch): 16 rows are one pass of the fused step's GEMMs over the
# weights, more rows a second pass.
DEFAULT_MAX_BATCH = 8
MAX_BATCH = 64
DEFAULT_BATCH_ROWS = 16
