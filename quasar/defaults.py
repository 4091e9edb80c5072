"""Defaults shared by the API, CLI, server and bench (no heavy imports: `quasar --help` stays fast)."""

# "auto": tree drafts (`--drafter tree`) where a W8A8 or W4A8 step's extra rows are cheap (the fused
# step on a CPU with AMX tiles) or its one-row step is long (10 ms or more: a model of 1.5B and
# up), else the paper's chain (`ngram`). With AMX a tree's extra rows cost little beside the
# weights every step streams, so its longer accepted runs win. Without, a tree keeps only the
# nodes that pay for their measured row cost; on a long step that still beats the chain, on
# a short one the host's work on the tree costs more than it gains. `quasar bench --modes
# quasar,quasar-tree` times the two side by side (BENCHMARKS.md has the figures).
DEFAULT_DRAFTER = "auto"
DEFAULT_VERIFIER = "w8a8"  # a float model's
# A GGUF file with 4-bit tensors decodes at its own precision: the faithful W4A8 layout keeps
# the file's 4-bit groups and its wider tensors as wide (BENCHMARKS.md compares it with W8A8).
DEFAULT_4BIT_VERIFIER = "w4a8"
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
# faster than a fixed k with identical output (`quasar bench` against `quasar bench --no-adaptive`).
DEFAULT_ADAPTIVE = True
# The tree drafter (`--drafter tree`): at most this many draft nodes per step, and how many
# of the verifier's top next tokens per verified row it recycles. Each step verifies only
# the nodes likely enough to pay for their rows (DraftTree.worth_keeping at the verifier's
# row prices) and at most one pass of the fused step's GEMMs (Transformer.pass_rows: 16 rows
# with AMX, 6 with VNNI alone, i.e. 5 nodes whatever the budget). With AMX, 15 nodes (one
# pass with the pending token) keep the acceptance length of the largest trees while smaller
# budgets decode about as fast but accept less; larger models, whose rows are relatively
# cheaper, gain most. `python scripts/tools/compare_drafters.py --configs "chain;tree:6;tree:8;tree:15"`
# compares budgets on the bench prompts.
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
# Host memory per verifier for finished sequences' K/V, which later prompts that start the same
# way (a chat's next turn, a shared system prompt) reuse instead of prefilling them again
# (quasar.speculative.prompt_cache). 0 turns it off.
DEFAULT_PROMPT_CACHE_MIB = 1024
# `quasar bench`'s fidelity column: each engine's model is scored on the held-out text's
# first 1024 tokens, 1023 predictions in exactly three 512-token windows (stride 256; one
# token more would cost a fourth), seconds per model at the default size. Top-1 over ~1000
# predictions has a standard error near half a point at 97%. 0 skips it.
DEFAULT_FIDELITY_TOKENS = 1024
