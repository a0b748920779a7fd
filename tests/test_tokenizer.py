import json

import pytest

from codeforge.tokenizer import EOT, SPECIAL_TOKENS, CodeTokenizer, TokenizerError, evaluate_tokenizer, train_tokenizer

AWKWARD = [
    "\tif x {\r\n\t\treturn  \r\n\t}\r\n",
    "trailing spaces   \n\n\n   \t \n",
    "emoji 🎉🚀 and CJK 漢字 and combining é\u0301",
    "x" * 5000 + "\n" + "long_identifier_" * 300,
    "ctrl \x01\x02\x07\x1b[31m bell \x7f del \u200b zero-width",
    "",
    " leading space and  double  spaces",
    "numbers 1234567890 3.14159 0xdeadbeef 1e-9",
    "<s> literal special strings </s> <|im_start|> in code",
]


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
    assert auto.eos_token == "</s>" and auto.convert_tokens_to_ids("<|im_end|>") == tok.special_ids["<|im_end|>"]


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
    assert words == ["if", "Ġx", "Ġ{Ċ", "ĉ", "ĉreturn", "Ġa", "_b", "1", "Ġ", "123", "45", "Ċ", "ĉ", "}"], words
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
