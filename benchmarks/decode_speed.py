"""Decode speed on this CPU, batch 1: codeforge's Engine, transformers' generate on the Hugging Face export of
the same weights, and llama.cpp (llama-cpp-python) on the GGUF export, f32 and q8_0.

Each engine writes --new-tokens tokens greedily after the same short code prompt, never stopping at an
end-of-text token (random weights emit one sooner or later), after a warm-up of 16 tokens. tokens/s is
new tokens over the wall time of the whole call (the prompt's prefill is a few dozen tokens: under 2% of it).
Threads: torch and llama.cpp both use --threads. Weights are random (speed does not depend on their values);
the architecture is a Llama-style one (SwiGLU, RMSNorm, RoPE, GQA where the preset has it), the one family
every engine here runs.

    python benchmarks/decode_speed.py [--model small|qwen-small] [--new-tokens 512] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Before any OpenMP runtime starts (torch's, llama.cpp's): busy-waiting worker threads collapse on a shared
# machine. Measured here with other jobs on both cores, llama.cpp at 2 threads: 6.9 tokens/s spinning, 370
# passive. Applied to every engine alike; pass OMP_WAIT_POLICY=ACTIVE to measure spinning on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

MODELS = {  # Llama-style, so that every engine (and llama.cpp's llama architecture) runs it
    "small": dict(vocab_size=8192, block_size=1024, n_layer=4, n_head=4, n_embd=256, mlp="swiglu",
                  ffn_hidden=704, norm="rmsnorm", pos="rope", bias=False),
    "qwen-small": dict(vocab_size=32000, block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768,
                       mlp="swiglu", ffn_hidden=3072, norm="rmsnorm", norm_eps=1e-6, pos="rope", bias=False),
}
PROMPT = ('def parse_config(path: str) -> dict:\n    """Read a '
          'TOML file and return its tables."""\n    with open(path')


def make_run(root: Path, spec: dict, tok_dir: Path) -> Path:
    from codeforge.checkpoint import save_checkpoint
    from codeforge.models import build_model
    from codeforge.models.gpt import GPTConfig
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tok_dir)
    m = GPTConfig(**spec)
    torch.manual_seed(0)
    model = build_model(m)
    save_checkpoint(root, 1, model, {"model": m.to_dict(), "train": {}, "tokenizer_hash": tok.hash}, {},
                    {"tokenizer": tok_dir}, keep_last=1)
    return root


def train_tok(out: Path) -> Path:
    """A llama.cpp-compatible tokenizer (--split llama3) from the Python standard
    library's json and asyncio."""
    import sysconfig

    from codeforge.tokenizer import train_tokenizer
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for d in ("json", "asyncio", "email")
             for p in sorted((lib / d).glob("*.py"))]
    train_tokenizer(iter(texts), 8192, out, split="llama3")
    return out


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    got = fn(n)
    dt = time.perf_counter() - t0
    assert got == n, f"generated {got} tokens, wanted {n}"
    return n / dt


def bench_codeforge(run: Path, ids: list[int], n: int) -> float:
    from codeforge.checkpoint import load_model
    from codeforge.engine import Engine, SamplingParams
    model, tok, _, _ = load_model(run, torch.device("cpu"))
    eng = Engine(model, tok, "cpu", "fp32")

    def go(k: int) -> int:
        p = SamplingParams(max_new_tokens=k, temperature=0, stop_at_eot=False)
        return sum(1 for _ in eng.generate_ids([ids], p))
    go(16)
    return timed(go, n)


def bench_transformers(hf_dir: Path, ids: list[int], n: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    mask = torch.ones_like(x)

    def go(k: int) -> int:
        gc = GenerationConfig(max_new_tokens=k, min_new_tokens=0, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        with torch.inference_mode():
            return hf.generate(x, attention_mask=mask, generation_config=gc).shape[1] - len(ids)
    go(16)
    return timed(go, n)


def bench_llama_cpp(gguf_file: Path, ids: list[int], n: int, threads: int) -> float:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=1024, n_batch=512, n_threads=threads,
                          verbose=False)

    def go(k: int) -> int:
        llm.reset()
        got = 0
        for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            got += 1
            if got == k:
                break
        return got
    go(16)
    try:
        return timed(go, n)
    finally:
        llm.close()  # now, not at interpreter exit (where llama-cpp-python's teardown raises)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from codeforge.export.gguf import export_gguf
    from codeforge.export.hf import export_hf
    from codeforge.tokenizer import CodeTokenizer
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok_dir = train_tok(d / "tok")
        run = make_run(d / "run", MODELS[a.model], tok_dir)
        ids = CodeTokenizer.load(tok_dir).encode(PROMPT)
        quiet = lambda *_: None  # noqa: E731
        export_hf(run, d / "hf", verify=False, log=quiet)
        from codeforge.models import build_model
        from codeforge.models.gpt import GPTConfig
        params = build_model(GPTConfig(**MODELS[a.model])).num_params()
        rows.append(("codeforge Engine (fp32, KV cache)", bench_codeforge(run, ids, a.new_tokens)))
        rows.append(("transformers generate (fp32)", bench_transformers(d / "hf", ids, a.new_tokens)))
        try:
            import llama_cpp  # noqa: F401
            for dtype in ("f32", "q8_0"):
                f = d / f"m-{dtype}.gguf"
                export_gguf(run, f, dtype=dtype, log=quiet)
                rows.append((f"llama.cpp {dtype} ({f.stat().st_size / 2**20:,.0f} MiB)",
                             bench_llama_cpp(f, ids, a.new_tokens, a.threads)))
        except ImportError:
            rows.append(("llama.cpp", None))
    base = dict(rows)["transformers generate (fp32)"]
    if a.json:
        print(json.dumps({"model": a.model, "params": params, "new_tokens": a.new_tokens,
                          "threads": a.threads, "tokens_per_s": dict(rows)}))
        return
    print(f"decode, batch 1, {a.new_tokens} new tokens, {a.threads} threads, model {a.model} "
          f"({params / 1e6:.1f}M parameters, {MODELS[a.model]['n_layer']} layers, width "
          f"{MODELS[a.model]['n_embd']})")
    print(f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; load average at the end "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine: other jobs ran meanwhile)")
    print(f"{'engine':42s} {'tokens/s':>9s} {'vs transformers':>16s}")
    for name, v in rows:
        if v is None:
            print(f"{name:42s} {'-':>9s}   (not installed: pip install llama-cpp-python)")
        else:
            print(f"{name:42s} {v:9.1f} {v / base:15.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
