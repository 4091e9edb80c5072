"""Defaults shared by the API, CLI, server and bench (no heavy imports: `quasar --help` stays fast)."""

DEFAULT_DRAFTER = "ngram"
DEFAULT_VERIFIER = "w8a8"
DEFAULT_CONTEXT = 8192
# The paper's drafter: k = 5 draft tokens, n-grams of 1..3 tokens (vLLM's prompt lookup).
DEFAULT_NUM_DRAFT = 5
DEFAULT_NGRAM_MIN = 1
DEFAULT_NGRAM_MAX = 3
# Draft length chosen per step from recent acceptance (speculative.acceptance.AdaptiveDraftLength);
# measured faster than a fixed k on the default model with identical output (BENCHMARKS.md).
DEFAULT_ADAPTIVE = True
# The tree drafter (`--drafter tree`): draft nodes per step, and how many of the verifier's
# top next tokens per verified row it recycles. The budget is the row count at which a
# fused step stays within ~1.3x of a one-token step (`scripts/step_rows.py`): the small-M
# GEMM takes 6 rows in one pass over each weight tile and more in another, so on the 2-core
# development machine 6 rows cost 1.23x one row on the default model (7: 1.32x) and 1.09x at
# 1.5B (7: 1.26x): 5 nodes (6 rows with the pending token). At 1.5B, 5 nodes decode 1.06x
# faster than 6 at the same acceptance length.
DEFAULT_DRAFT_BUDGET = 5
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
DEFAULT_BATCH_ROWS = 16
