"""The peers the benchmark times against Quasar, behind the `Contender` interface of
`quasar.bench.engine` (which also states the timing rule every engine follows).

- `hf`, `hf-pld`: transformers `generate`, greedy, on the same model directory Quasar
  loaded (for a GGUF source, its float conversion); `hf-pld` adds
  `prompt_lookup_num_tokens=10`.
- `llamacpp`, `llamacpp-pld`: llama-cpp-python on the model's own GGUF file, plain and with
  `LlamaPromptLookupDecoding(num_pred_tokens=2)`; `llamacpp-q8`, `llamacpp-pld-q8` the same
  on a Q8_0 copy made by llama.cpp's own quantizer (8.5 bits per weight, like W8A8).
  llama-cpp-python is an optional extra (scripts/setup/install_llamacpp.sh); without it these
  peers are reported as unavailable.
- `openvino`, `openvino-pld`: OpenVINO GenAI on an int8 export of the same float model
  (quasar/bench/openvino.py); optional too (scripts/setup/install_openvino.sh).

For the fidelity column transformers decodes the float model itself, and llama.cpp scores
its file from its own logits (`llamacpp_logits`).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from gguf import GGUFReader

from quasar.bench.engine import FLOAT_MODEL, Contender, FidelitySource, RunResult, Unavailable
from quasar.bench.openvino import OPENVINO_PEERS, OpenVINOPeer
from quasar.models.gguf import cache_dir_for
from quasar.paths import cache_dir

HF_PEERS = ("hf", "hf-pld")
LLAMACPP_PEERS = ("llamacpp", "llamacpp-pld", "llamacpp-q8", "llamacpp-pld-q8")
PEERS = HF_PEERS + LLAMACPP_PEERS + OPENVINO_PEERS
HF_PLD_TOKENS = 10
LLAMACPP_PLD_TOKENS = 2
LLAMA_FTYPES = {"Q8_0": 7, "Q4_K_M": 15, "BF16": 32}  # llama.h enum llama_ftype


# --------------------------------------------------------------------------- transformers


def hf_weight_bytes(model) -> int:
    """Bytes one forward reads: all parameters but the embedding table (one row of it is
    read), a tied lm_head counted once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # dedups tied
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


class _Clock:
    """A transformers streamer that timestamps each put: the first is the prompt, each
    later one the tokens a step emitted."""

    def __init__(self):
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value):
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self):
        pass


def _import_transformers():
    """transformers, for the hf peers (slow to import: only when they run), or Unavailable."""
    try:
        import transformers  # lazy: optional dependency (the hf peers only; slow to import)
    except ImportError as e:
        raise Unavailable(f"transformers not importable ({e})") from None
    return transformers


class _HFShared:
    """One transformers model shared by `hf` and `hf-pld`."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, eos_ids: set[int]):
        self.model_dir, self.dtype, self.eos_ids = model_dir, dtype, sorted(eos_ids)
        self.model = None
        self.calls = 0

    def load(self):
        if self.model is None:
            transformers = _import_transformers()
            hf_logging = transformers.utils.logging
            hf_logging.disable_progress_bar()  # keep stderr to the bench's own progress bar
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.dtype)
            except Exception as e:  # a model layout transformers does not know
                raise Unavailable(f"transformers cannot load {self.model_dir} ({type(e).__name__}: {e})") from None
            finally:
                hf_logging.enable_progress_bar()
            model.eval()
            model.register_forward_pre_hook(self._count)
            self.model = model
        return self.model

    def _count(self, module, args):
        self.calls += 1


class HFPeer(Contender):
    def __init__(self, name: str, shared: _HFShared):
        self.name, self.shared = name, shared
        self.pld = name == "hf-pld"
        self.description = ("transformers generate, greedy"
                            + (f", prompt_lookup_num_tokens={HF_PLD_TOKENS}" if self.pld else ""))
        self.weights = f"{shared.model_dir} ({str(shared.dtype).removeprefix('torch.')})"

    def prepare(self) -> None:
        model = self.shared.load()
        self.bytes_per_step = hf_weight_bytes(model)
        self.kv_element_size = model.dtype.itemsize  # a DynamicCache in the model's dtype

    def fidelity_source(self) -> FidelitySource:
        return FLOAT_MODEL  # the same float weights as ar-fp, in the same dtype

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        transformers = _import_transformers()
        model, eos = self.shared.model, self.shared.eos_ids
        extra = {"prompt_lookup_num_tokens": HF_PLD_TOKENS} if self.pld else {}
        cfg = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **extra)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        clock = _Clock()
        self.shared.calls = 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, streamer=clock)
            t_end = time.perf_counter()
        new = out[0, len(prompt_ids):].tolist()
        emitted = len(new)
        for i, tok in enumerate(new):
            if tok in eos:
                new, emitted = new[:i], i + 1
                break
        # clock.times[0] is the prompt; [1] the first new token (from the prefill forward)
        t_first = clock.times[1] if len(clock.times) > 1 else t_end
        steps = max(self.shared.calls - 1, 0)
        return RunResult(token_ids=new, new_tokens=len(new), rate_tokens=max(len(new) - 1, 0),
                         step_tokens=max(emitted - 1, 0), steps=steps, prefill_s=t_first - t0,
                         decode_s=t_end - t_first, wall_s=t_end - t0, hist=Counter(clock.sizes[2:]))


# --------------------------------------------------------------------------- llama.cpp


def import_llama_cpp():
    """llama-cpp-python's module, or Unavailable saying how to build it."""
    try:
        import llama_cpp  # lazy: optional dependency
    except ImportError as e:
        raise Unavailable(f"llama-cpp-python (module llama_cpp) is not installed ({e}); "
                          "build it with scripts/setup/install_llamacpp.sh") from None
    return llama_cpp


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of tensors read per forward of one token: all but `token_embd` when `output` is
    separate, and of a mixture of experts' stacked expert tensors (`ffn_*_exps`) the
    `expert_used_count` of `expert_count` experts a token reaches."""
    reader = GGUFReader(str(path))
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else ""
    count, used = (reader.fields.get(f"{arch}.expert_{key}") for key in ("count", "used_count"))
    if count is not None and used is not None and int(count.contents()) > 0:
        share = int(used.contents()) / int(count.contents())
        tensors = {n: round(b * share) if "_exps." in n else b for n, b in tensors.items()}
    return sum(tensors.values())


def q8_0_copy(src: Path, threads: int) -> Path:
    """A Q8_0 copy of `src` made by llama.cpp's quantizer, cached beside the GGUF conversion."""
    out = cache_dir("llamacpp") / f"{cache_dir_for(src).name}.Q8_0.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        llamacpp_quantize(src, out, "Q8_0", threads)
    return out


def llamacpp_quantize(src: Path, out: Path, ftype: str, threads: int) -> None:
    """Write `src` quantized by llama.cpp's own quantizer to `out` (ftype e.g. "Q8_0",
    "Q4_K_M"; a source already quantized is requantized), via a temp file and a rename."""
    llama_cpp = import_llama_cpp()
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", LLAMA_FTYPES[ftype])
    params.allow_requantize = True  # the source may itself be quantized (Q4_1 for default)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise Unavailable(f"llama.cpp could not quantize {src} to {ftype} (return code {rc})")
    os.replace(tmp, out)


@contextmanager
def llamacpp_logits(path: Path, window: int, threads: int):
    """llama.cpp's logits for token ids (an eval.fidelity LogitsFn): the GGUF at `path` in a
    context of `window` tokens that keeps every position's logits (logits_all). The ids go in
    as they are, so the tokenization is the float model's."""
    llama_cpp = import_llama_cpp()
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=window, n_threads=threads, n_threads_batch=threads,
                              logits_all=True, verbose=False)
    except Exception as e:
        raise Unavailable(f"llama.cpp cannot load {path} ({type(e).__name__}: {e})") from None

    def logits(ids: list[int]) -> torch.Tensor:
        llm.reset()  # each window from an empty cache
        llm.eval(ids)
        return torch.from_numpy(llm.scores[: len(ids)].copy())

    try:
        yield logits
    finally:
        llm.close()


class LlamaCppPeer(Contender):
    def __init__(self, name: str, gguf_path: Path | None, threads: int, n_ctx: int, eos_ids: set[int],
                 why_no_gguf: str = ""):
        self.name, self.src, self.threads, self.n_ctx = name, gguf_path, threads, n_ctx
        self.eos_ids, self.why_no_gguf = set(eos_ids), why_no_gguf
        self.pld = "-pld" in name
        self.q8 = name.endswith("-q8")
        self.description = ("llama-cpp-python, greedy"
                            + (f", LlamaPromptLookupDecoding(num_pred_tokens={LLAMACPP_PLD_TOKENS})" if self.pld else "")
                            + (", Q8_0 copy made by llama.cpp's quantizer" if self.q8 else ", the model's own GGUF"))
        self.llm = None
        self.path: Path | None = None  # the GGUF it decodes, once prepared
        self.calls = 0

    def prepare(self) -> None:
        llama_cpp = import_llama_cpp()
        if self.src is None:
            raise Unavailable(self.why_no_gguf or "no GGUF file for this model")
        path = q8_0_copy(self.src, self.threads) if self.q8 else self.src
        self.path = path
        self.weights = str(path)
        self.bytes_per_step = gguf_weight_bytes(path)
        self.kv_element_size = 2  # llama.cpp's default f16 K and V
        kwargs = {}
        if self.pld:
            kwargs["draft_model"] = llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=LLAMACPP_PLD_TOKENS)
            # With a draft model llama-cpp-python keeps logits for every position but sizes
            # that buffer by the logits_all argument (n_batch rows unless it is True), so
            # past 512 tokens its eval fails to broadcast; ask for n_ctx rows.
            kwargs["logits_all"] = True
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.threads,
                                  n_threads_batch=self.threads, verbose=False, **kwargs)
        except Exception as e:
            raise Unavailable(f"llama.cpp cannot load {path} ({type(e).__name__}: {e})") from None
        self.attach(llm)

    def fidelity_source(self) -> FidelitySource:
        """Its GGUF file (-pld peers share the plain one's), scored by llama.cpp itself."""
        path, threads = self.path, self.threads
        return FidelitySource(f"gguf {path}", lambda window: llamacpp_logits(path, window, threads))

    def attach(self, llm) -> None:
        """Use `llm` (a llama_cpp.Llama), counting its forwards: generate() calls
        self.eval once per forward (the prompt, then each step's tokens)."""
        try:
            self.eos_ids.add(int(llm.token_eos()))
        except Exception:
            pass
        inner = llm.eval

        def counted_eval(tokens):
            self.calls += 1
            return inner(tokens)

        llm.eval = counted_eval
        self.llm = llm

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        llm = self.llm
        llm.reset()  # no reuse of the previous run's KV cache for a shared prefix
        self.calls = 0
        out: list[int] = []
        hist: Counter = Counter()
        step_calls, in_step, emitted = 1, 0, 0
        t0 = time.perf_counter()
        t_first = None
        gen = llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                           repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                now_calls = self.calls
                if t_first is None:
                    t_first = time.perf_counter()
                elif now_calls != step_calls:  # a new forward produced this token
                    if in_step:
                        hist[in_step] += 1
                    step_calls, in_step = now_calls, 0
                if emitted > 0:
                    in_step += 1
                emitted += 1
                if tok in self.eos_ids:
                    break
                out.append(int(tok))
                if len(out) >= max_new_tokens:
                    break
        finally:
            gen.close()
        t_end = time.perf_counter()
        if in_step:
            hist[in_step] += 1
        t_first = t_first or t_end
        return RunResult(token_ids=out, new_tokens=len(out), rate_tokens=max(len(out) - 1, 0),
                         step_tokens=max(emitted - 1, 0), steps=max(self.calls - 1, 0),
                         prefill_s=t_first - t0, decode_s=t_end - t_first, wall_s=t_end - t0, hist=hist)


def make_peers(names: list[str], *, model_dir: Path, dtype: torch.dtype, gguf_path: Path | None,
               why_no_gguf: str, threads: int, n_ctx: int, eos_ids: set[int]) -> list[Contender]:
    """Engines for the requested peer names (not yet prepared)."""
    shared = _HFShared(model_dir, dtype, eos_ids)
    engines: list[Contender] = []
    for name in names:
        if name in HF_PEERS:
            engines.append(HFPeer(name, shared))
        elif name in OPENVINO_PEERS:
            engines.append(OpenVINOPeer(name, model_dir, threads, eos_ids))
        else:
            engines.append(LlamaCppPeer(name, gguf_path, threads, n_ctx, eos_ids, why_no_gguf))
    return engines
