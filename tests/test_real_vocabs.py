"""The imported-tokenizer path on real published vocabularies, against their published tokenisations.

llama.cpp ships, in models/ of its source (and so in the llama-cpp-python source distribution pyproject.toml
pins for the slow tests: benchmarks/build_llama_server.py downloads it), vocabulary-only GGUF files of real
models, ggml-vocab-NAME.gguf, each with test texts (.gguf.inp, separated by "\\n__ggml_vocab_test__\\n") and
the ids the model's own Hugging Face tokenizer gives them (.gguf.out, one line each; llama.cpp's
convert_hf_to_gguf_update.py wrote them with `tokenizer.encode(text, add_special_tokens=False)`).

From each GGUF this builds the tokenizer.json a model directory on the Hub holds (the byte-level BPE's tokens
and merges from the file; the split rule by the GGUF's tokenizer.ggml.pre, as the model's tokenizer.json
spells it), then takes it the way `codeforge import --hf` / `quickstart --from-hf` do (CodeTokenizer.load,
which vets its rules and marks control tokens) and checks every test text encodes to the published ids:
  qwen2 (Qwen2 / Qwen2.5 / Qwen2.5-Coder)  also imported end to end: a random Qwen2 of the real vocabulary
                                           through import_hf, and its GGUF export carries the same tokens,
                                           merges and pre-tokenizer name as llama.cpp's own file
  starcoder (StarCoder, StarCoder 2)       a vocabulary codeforge loads (its model family is not importable)
  deepseek-coder (DeepSeek-Coder 1.x)      encodes right, but CodeTokenizer.load refuses it: it has no
                                           <|endoftext|> (its end token is <｜end▁of▁sentence｜>), which
                                           codeforge's shards and generation need (a known gap, xfail strict)
Slow: the source distribution is 77 MB (skipped, with the command to fetch it, where it is not on disk).
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from build_llama_server import cache_dir, pinned_version

from codeforge.tokenizer import QWEN2_SPLIT_PATTERN

pytestmark = pytest.mark.slow

NAMES = ("qwen2", "deepseek-coder", "starcoder")
SEP = "\n__ggml_vocab_test__\n"
# the split rule of each vocabulary as its tokenizer.json on the Hub has it (llama.cpp's llama-vocab.cpp
# implements the same rules under the GGUF's tokenizer.ggml.pre name)
QWEN2 = QWEN2_SPLIT_PATTERN  # codeforge's copy of Qwen2's, as its tokenizer.json spells it
SPLIT_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


PRE_TOKENIZERS = {
    "qwen2": {"type": "Sequence", "pretokenizers": [split(QWEN2), SPLIT_BYTES]},
    "deepseek-coder": {"type": "Sequence", "pretokenizers": [
        split("[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"),
        split("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"), split(r"\p{N}"), SPLIT_BYTES]},
    # StarCoder's own: digits one by one, then GPT-2's byte-level rule
    "starcoder": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def sdist() -> Path:
    """The pinned llama-cpp-python source distribution (or its unpacked tree); a skip saying how to get it."""
    v = pinned_version()
    env = os.environ.get("CODEFORGE_LLAMA_SDIST")
    work = cache_dir() / f"llama-cpp-python-{v}"
    for p in ([Path(env)] if env else []) + [work / f"llama_cpp_python-{v}.tar.gz",
                                             work / f"llama_cpp_python-{v}"]:
        if p.exists():
            return p
    pytest.skip(f"the llama-cpp-python {v} source distribution is not on disk: pip download "
                f"llama-cpp-python=={v} --no-deps --no-binary :all: -d {work} (or set CODEFORGE_LLAMA_SDIST)")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """models/ggml-vocab-{NAMES}.gguf{,.inp,.out}, out of the source distribution."""
    src = sdist()
    out = tmp_path_factory.mktemp("vocabs")
    wanted = {f"ggml-vocab-{n}.gguf{ext}" for n in NAMES for ext in ("", ".inp", ".out")}
    if src.is_dir():
        for name in wanted:
            (out / name).write_bytes((src / "vendor" / "llama.cpp" / "models" / name).read_bytes())
        return out
    with tarfile.open(src) as t:
        for m in t:
            base = m.name.rsplit("/", 1)[-1]
            if m.isfile() and base in wanted and "/vendor/llama.cpp/models/" in m.name:
                (out / base).write_bytes(t.extractfile(m).read())
    missing = sorted(n for n in wanted if not (out / n).exists())
    assert not missing, f"{src} lacks {missing}"
    return out


def gguf_field(reader, key: str):
    import gguf
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8") if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def tokenizer_json(gguf_file: Path) -> dict:
    """The tokenizer.json a Hub model directory would hold for this vocabulary: every token at its id in the
    BPE vocabulary (byte-level strings, as GGUF stores them), the merges in order, CONTROL and USER_DEFINED
    tokens as added tokens (CONTROL ones special), the split rule of its tokenizer.ggml.pre."""
    import gguf
    r = gguf.GGUFReader(str(gguf_file))
    assert gguf_field(r, "tokenizer.ggml.model") == "gpt2"  # byte-level BPE
    pre = gguf_field(r, "tokenizer.ggml.pre")
    tokens, types = gguf_field(r, "tokenizer.ggml.tokens"), gguf_field(r, "tokenizer.ggml.token_type")
    merges = gguf_field(r, "tokenizer.ggml.merges")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": ty == USER_DEFINED, "special": ty == CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": {t: i for i, t in reversed(list(enumerate(tokens)))},
                      "merges": [m.split(" ", 1) for m in merges]}}


def cases(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) as llama.cpp's test-tokenizer-0 reads them."""
    raw = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.split(SEP)
    if texts and texts[-1] == "":
        texts.pop()
    lines = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def model_dir(models: Path, name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(models / f"ggml-vocab-{name}.gguf")),
                                      encoding="utf-8")
    return d


def wrong(tok, pairs) -> list[str]:
    bad = []
    for text, want in pairs:
        got = tok.encode(text)
        if got != want:
            bad.append(f"{text[:40]!r}: {got[:12]} != {want[:12]}")
    return bad


@pytest.mark.parametrize("name", ["qwen2", "starcoder"])
def test_codeforge_loads_the_vocabulary_and_encodes_as_its_model_does(models, tmp_path, name):
    from codeforge.tokenizer import CodeTokenizer
    warned: list[str] = []
    tok = CodeTokenizer.load(model_dir(models, name, tmp_path), log=warned.append)
    pairs = cases(models, name)
    assert len(pairs) >= 40
    assert wrong(tok, pairs) == []
    # decoding gives the text back (byte-level: every text round-trips)
    assert all(tok.decode(want) == text for text, want in pairs)
    # Qwen2's split rule is one codeforge knows; StarCoder's is a Digits step and ByteLevel's own (no regex)
    assert warned == []


def test_deepseek_coder_encodes_right_but_is_refused_for_lack_of_an_end_of_text_token(models, tmp_path):
    """Its rules and merges give the published ids through codeforge's tokenizer class; the load refuses it
    (no <|endoftext|>), naming the token: importing a DeepSeek-Coder model needs an end-of-text alias
    first."""
    from tokenizers import Tokenizer

    from codeforge.tokenizer import CodeTokenizer, TokenizerError
    d = model_dir(models, "deepseek-coder", tmp_path)
    tok = CodeTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), d)
    assert wrong(tok, cases(models, "deepseek-coder")) == []
    with pytest.raises(TokenizerError, match="lacks the <\\|endoftext\\|> token"):
        CodeTokenizer.load(d, log=lambda m: None)


@pytest.mark.xfail(strict=True, reason="known gap: codeforge needs <|endoftext|>; DeepSeek-Coder's end token "
                                       "is <｜end▁of▁sentence｜> and is not taken as an alias")
def test_deepseek_coder_loads(models, tmp_path):
    from codeforge.tokenizer import CodeTokenizer
    CodeTokenizer.load(model_dir(models, "deepseek-coder", tmp_path), log=lambda m: None)


def test_a_qwen2_model_of_the_real_vocabulary_imports_and_exports_it_unchanged(models, tmp_path):
    """A random two-layer Qwen2 with the real 151,936-token vocabulary and this tokenizer.json, imported as
    `import --hf` does (logits checked against transformers): the imported run's tokenizer encodes every
    test text to the published ids, and its GGUF export carries llama.cpp's own file's tokens, merges and
    pre-tokenizer name."""
    import gguf
    import torch
    import transformers as tr

    from codeforge.cli import main
    from codeforge.checkpoint import find_checkpoint
    from codeforge.export.hf import import_hf
    from codeforge.tokenizer import CodeTokenizer
    src = model_dir(models, "qwen2", tmp_path)
    torch.manual_seed(0)
    cfg = tr.Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True)
    tr.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    r = import_hf(src, tmp_path / "run", log=lambda m: None, context=1024)
    assert r["max_abs_diff"] is None or r["max_abs_diff"] < 1e-3
    tok = CodeTokenizer.load(find_checkpoint(tmp_path / "run", "auto") / "tokenizer")
    assert wrong(tok, cases(models, "qwen2")) == []
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(out)]) == 0
    ours, theirs = gguf.GGUFReader(str(out)), gguf.GGUFReader(str(models / "ggml-vocab-qwen2.gguf"))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges"):
        assert gguf_field(ours, key) == gguf_field(theirs, key), key
