import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import codeforge.tokenizer as tokenizer_mod
from codeforge.tokenizer import (CODE_SPLIT_PATTERN, EOT, SPECIAL_TOKENS, CodeTokenizer, TokenizerError,
                                 evaluate_tokenizer, train_tokenizer)

# Split rules that backtrack catastrophically: on a 35-character prompt the regex engine (onig) reaches its
# retry limit and tokenizers panics (pyo3_runtime.PanicException, a BaseException, not an Exception).
BACKTRACKING_SPLITS = [r"(a+)+$", r"(\w+\s?)*$"]
BACKTRACKING_PROMPT = "a" * 34 + "!"
# Qwen2's split, as its tokenizer.json has it (Llama 3's is codeforge's llama3
# rule, GPT-2's is ByteLevel's own)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| """
               r"""?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def with_split(tokenizer_dir: Path, out: Path, pattern: str | None = None,
               pre_tokenizer: dict | None = None) -> Path:
    """A copy of a codeforge tokenizer directory whose tokenizer.json splits by the regex `pattern` (or has
    `pre_tokenizer` as a whole)."""
    shutil.copytree(tokenizer_dir, out)
    f = out / "tokenizer.json"
    j = json.loads(f.read_text())
    if pattern is not None:
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": pattern}
    else:
        j["pre_tokenizer"] = pre_tokenizer
    f.write_text(json.dumps(j))
    return out


def assert_raw_tokenizers_panics(tok_dir: Path) -> None:
    """The defect is real: Hugging Face tokenizers itself panics on the prompt."""
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    with pytest.raises(BaseException) as e:
        raw.encode(BACKTRACKING_PROMPT, add_special_tokens=False)
    assert type(e.value).__name__ == "PanicException" and not isinstance(e.value, Exception)

AWKWARD = ["\tif x {\r\n\t\treturn  \r\n\t}\r\n", "trailing spaces   \n\n\n   \t \n",
           "emoji 🎉🚀 and CJK 漢字 and combining é\u0301", "x" * 5000 + "\n" + "long_identifier_" * 300,
           "ctrl \x01\x02\x07\x1b[31m bell \x7f del \u200b zero-width", "",
           " leading space and  double  spaces", "numbers 1234567890 3.14159 0xdeadbeef 1e-9",
           "<s> literal special strings </s> <|im_start|> in code"]


def test_roundtrip_awkward_text(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    for text in AWKWARD:
        assert tok.decode(tok.encode(text)) == text, repr(text[:40])
    r = evaluate_tokenizer(tok, AWKWARD)
    assert r["roundtrip_ok"] and r["roundtrip_failures"] == 0


def test_special_tokens_fixed_single_ids(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.special_ids[t] == i
        assert tok.encode(t, allow_special=True) == [i]
    assert tok.eot_id == 0 and SPECIAL_TOKENS[0] == EOT
    # Corpus text is data: the literal string is not turned into the special id.
    ids = tok.encode("<|im_start|>")
    assert tok.special_ids["<|im_start|>"] not in ids and tok.decode(ids) == "<|im_start|>"


def test_files_written_and_load_in_transformers(tokenizer_dir):
    meta = json.loads((tokenizer_dir / "codeforge_tokenizer.json").read_text())
    tok = CodeTokenizer.load(tokenizer_dir)
    assert meta["hash"] == tok.hash and meta["vocab_size"] == tok.vocab_size == 1024
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size() == 1024
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    text = "func main() {\n\tfmt.Println(\"hi\")\n}\n"
    assert hf.decode(hf.encode(text)) == text
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (
        auto.eos_token == "</s>" and auto.convert_tokens_to_ids("<|im_end|>") == tok.special_ids["<|im_end|>"]
    )


@pytest.mark.parametrize("v", [255, 200_001, 0])
def test_vocab_size_range_refused(tmp_path, v):
    with pytest.raises(TokenizerError, match="out of range"):
        train_tokenizer(iter(["abc"]), v, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_load_missing_says_how_to_train(tmp_path):
    with pytest.raises(TokenizerError, match="codeforge tokenizer train"):
        CodeTokenizer.load(tmp_path)


def test_code_pretokenizer_keeps_indentation_with_punctuation(tmp_path):
    tok, meta = train_tokenizer(iter(["if x {\n\treturn a_b1\n}\n" * 20]), 300, tmp_path / "t", split="code")
    assert (meta["split"], meta["llama_cpp_pre"]) == ("code", None)
    pieces = tok.tok.pre_tokenizer.pre_tokenize_str("if x {\n\t\treturn a_b1\n\t}")
    words = [p for p, _ in pieces]
    assert "Ġ{Ċĉĉ" in words  # " {\n\t\t" is one piece, byte-level mapped
    assert "Ġa_b1" in words  # identifiers keep underscores and digits


def test_the_default_split_is_llama_cpps_llama_bpe(tokenizer_dir):
    """The default tokenizer splits as Llama 3 does (llama.cpp's "llama-bpe"), and records that name."""
    tok = CodeTokenizer.load(tokenizer_dir)
    words = [p for p, _ in tok.tok.pre_tokenizer.pre_tokenize_str("if x {\n\t\treturn a_b1 12345\n\t}")]
    assert words == ["if", "Ġx", "Ġ{Ċ", "ĉ", "ĉreturn", "Ġa", "_b", "1", "Ġ", "123", "45", "Ċ", "ĉ", "}"], (
        words
    )
    meta = json.loads((tokenizer_dir / "codeforge_tokenizer.json").read_text())
    assert (meta["split"], meta["llama_cpp_pre"]) == ("llama3", "llama-bpe")


def test_train_refuses_to_replace_a_directory(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "important.txt").write_text("keep me")
    with pytest.raises(TokenizerError, match="already holds other files"):
        train_tokenizer(iter(["some text " * 20]), 300, out)
    assert (out / "important.txt").read_text() == "keep me"
    train_tokenizer(iter(["some text " * 20]), 300, tmp_path / "tok")
    with pytest.raises(TokenizerError, match="already holds a tokenizer.*--overwrite"):
        train_tokenizer(iter(["other text " * 20]), 300, tmp_path / "tok")
    train_tokenizer(iter(["other text " * 20]), 300, tmp_path / "tok", overwrite=True)


@pytest.mark.parametrize("pattern", BACKTRACKING_SPLITS)
def test_a_backtracking_split_rule_is_refused_at_load(pattern, tokenizer_dir, tmp_path):
    """Before: loaded as it was, and a 35-character prompt ended in a
    PanicException from the Rust tokenizer."""
    bad = with_split(tokenizer_dir, tmp_path / "bad", pattern)
    assert_raw_tokenizers_panics(bad)
    with pytest.raises(TokenizerError) as e:
        CodeTokenizer.load(bad)
    msg = str(e.value)
    assert str(bad / "tokenizer.json") in msg and "pre_tokenizer" in msg and repr(pattern) in msg, msg
    assert "backtrack" in msg and "codeforge tokenizer train" in msg, msg


def test_every_encode_path_turns_a_tokenizer_panic_into_a_tokenizer_error(tokenizer_dir, tmp_path):
    """A tokenizer built around the load-time check (CodeTokenizer(Tokenizer, ...)): encode, encode with
    special tokens, encode_batch and encode_with_offsets raise TokenizerError (a CodeforgeError), not the
    PanicException that is a BaseException; the tokenizer keeps working on other text."""
    bad = with_split(tokenizer_dir, tmp_path / "bad", BACKTRACKING_SPLITS[0])
    tok = CodeTokenizer(Tokenizer.from_file(str(bad / "tokenizer.json")), bad)
    calls = [lambda: tok.encode(BACKTRACKING_PROMPT),
             lambda: tok.encode(BACKTRACKING_PROMPT, allow_special=True),
             lambda: tok.encode_batch(["ok", BACKTRACKING_PROMPT]),
             lambda: tok.encode_with_offsets(BACKTRACKING_PROMPT)]
    for call in calls:
        with pytest.raises(TokenizerError, match=r"cannot encode this text \(35 characters\).*backtrack"):
            call()
    assert tok.tok.encode_special_tokens is True  # restored after the failure
    assert tok.decode(tok.encode("aaa")) == "aaa"


def test_interrupts_are_not_turned_into_tokenizer_errors(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)

    class Interrupted:
        encode_special_tokens = True

        def encode(self, *a, **k):
            raise KeyboardInterrupt

    tok.tok = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        tok.encode("x")


@pytest.mark.parametrize("rule", ["code", "llama3", "qwen2", "gpt2"])
def test_the_split_rules_codeforge_knows_load_without_a_word(rule, tokenizer_dir, tmp_path):
    """codeforge's own rules and those of the models it imports (Llama 3's is llama3, Qwen2's, GPT-2's
    ByteLevel) are known: no probe, no warning."""
    d = tmp_path / rule
    if rule == "gpt2":
        with_split(tokenizer_dir, d, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False,
                                                    "trim_offsets": True, "use_regex": True})
    elif rule == "llama3":
        shutil.copytree(tokenizer_dir, d)
    else:
        with_split(tokenizer_dir, d, {"code": CODE_SPLIT_PATTERN, "qwen2": QWEN2_SPLIT}[rule])
    said: list[str] = []
    tok = CodeTokenizer.load(d, log=said.append)
    assert said == [] and tok.decode(tok.encode(BACKTRACKING_PROMPT)) == BACKTRACKING_PROMPT


def test_an_unknown_split_rule_that_survives_the_probe_loads_with_a_warning(tokenizer_dir, tmp_path, capsys):
    pattern = r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"
    d = with_split(tokenizer_dir, tmp_path / "other", pattern)
    said: list[str] = []
    tok = CodeTokenizer.load(d, log=said.append)
    assert (
        len(said) == 1
        and "pre_tokenizer" in said[0]
        and repr(pattern) in said[0]
        and "not one codeforge knows" in said[0]
    ), said
    assert tok.decode(tok.encode(BACKTRACKING_PROMPT)) == BACKTRACKING_PROMPT
    capsys.readouterr()
    CodeTokenizer.load(d)  # without a log: on stderr
    assert capsys.readouterr().err.startswith(f"warning: {d / 'tokenizer.json'}: "
                                              "the split rule in its pre_tokenizer")


def test_an_unknown_split_rule_too_slow_on_the_probe_is_refused(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "PROBE_SECONDS", -1.0)  # every probe is "too slow"
    monkeypatch.setattr(tokenizer_mod, "_VETTED", {})  # verdicts are remembered: this rule passed above
    d = with_split(tokenizer_dir, tmp_path / "slow", r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+")
    with pytest.raises(TokenizerError,
                       match=r"pre_tokenizer.*fails on a 8-character probe text .*: it took -?[0-9.]+ s"):
        CodeTokenizer.load(d)


def test_a_rule_keyed_on_its_own_characters_is_probed_with_them(tokenizer_dir, tmp_path):
    """Found in review: `(c+c+)+d` passed the fixed probe texts (none is a run of "c") and then panicked on
    "c" * 40. The characters a rule names are now probe units of their own."""
    from codeforge.tokenizer import rule_characters
    assert rule_characters([r"(c+c+)+d", r"(?i:foo)\p{L}+[0-9]"]) == ("c", "d", "f", "o", "0", "-", "9")
    bad = with_split(tokenizer_dir, tmp_path / "bad", r"(c+c+)+d")
    raw = Tokenizer.from_file(str(bad / "tokenizer.json"))
    with pytest.raises(BaseException):  # the defect is real: the Rust tokenizer panics
        raw.encode("c" * 40, add_special_tokens=False)
    with pytest.raises(TokenizerError, match="probe text"):
        CodeTokenizer.load(bad)


def test_hf_config_lists_only_the_special_tokens_a_tokenizer_has(tmp_path, tokenizer_dir):
    """Found in review: a tokenizer made before <|repo_name|> and <|file_sep|> existed (reserved slots there)
    was written to transformers with both names, which it then added past the model's vocabulary."""
    import json
    import shutil

    from codeforge.tokenizer import TOKENIZER_FILE, write_hf_config
    old = tmp_path / "old"
    shutil.copytree(tokenizer_dir, old)
    tj = (old / TOKENIZER_FILE).read_text()
    (old / TOKENIZER_FILE).write_text(
        tj.replace("<|repo_name|>", "<|reserved_6|>").replace("<|file_sep|>", "<|reserved_7|>")
    )
    write_hf_config(old)
    listed = json.loads((old / "tokenizer_config.json").read_text())["additional_special_tokens"]
    assert "<|repo_name|>" not in listed and "<|file_sep|>" not in listed and "<fim_prefix>" in listed
    write_hf_config(tokenizer_dir)
    assert (
        "<|file_sep|>"
        in json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["additional_special_tokens"]
    )
