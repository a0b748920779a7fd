"""Byte-level BPE for code: train, load, encode, decode.

The tokenizer is HF `tokenizers` (Rust). Pre-tokenization splits text before BPE merges are learned, which
decides what a token may span. Two rules (`split`):

  llama3 (the default): Llama 3's regex, which llama.cpp implements under the name "llama-bpe", so every
    model exports to GGUF and runs in llama.cpp, Ollama and LM Studio with the same token ids. Of the
    pre-tokenizers llama.cpp knows, it compresses held-out code best (with gpt-4o's, which is ahead on Go and
    behind on Python); it costs 7-11% bytes per token against the code rule
    (docs/LOG.md#2026-11-24-llama3-split-default).
  code: codeforge's own (a regex in the style of GPT-4's, tuned on Go):
    - contractions; identifiers (letters, digits, `_`, not starting with a digit) with at most one leading
      non-identifier character (`.Println`, ` func`, `(int64`),
    - digit groups of at most 3,
    - punctuation runs (optional leading space) with the newline and indentation that follow (`{\n\t\t`),
    - newline runs with the whitespace around them, whitespace runs not followed by text.
    No llama.cpp pre-tokenizer is this rule: such a model exports to Hugging Face, not to GGUF.
Then every byte is mapped to a printable symbol (byte-level), so any UTF-8 text round-trips byte for byte.
The rule's llama.cpp name (LLAMA_CPP_PRE) is recorded in codeforge_tokenizer.json for the GGUF export.

A tokenizer.json is vetted when it loads (CodeTokenizer.load: training, generating, serving,
`codeforge import --hf`): a split regex codeforge does not know (KNOWN_SPLIT_PATTERNS) is run on probe texts
first, and refused when the tokenizer fails or crawls on one (a rule such as `(a+)+$` backtracks
catastrophically: the Rust regex engine gives up and tokenizers panics on a 35-character prompt); one that
passes loads with a warning. Whatever still fails while encoding is raised as TokenizerError, never as the
tokenizer's own PanicException.

Special tokens get fixed ids 0..N-1 in the order of SPECIAL_TOKENS, so every tokenizer codeforge trains
agrees on them and later stages (chat SFT, tool calls, fill-in-the-middle) need no new tokenizer.

Control tokens are never made from plain text. The `tokenizers` library matches every added token it finds
in a text unless the token is marked special, and Qwen2.5-Coder's tokenizer.json (like CodeGemma's) marks its
FIM, repository and tool tokens `"special": false`: a training file, an editor's other files in /infill or a
chat message that mentions `<|fim_middle|>` would become that token. So every load marks special, in the
loaded Tokenizer (mark_control_tokens), each added token codeforge treats as a control token (is_control:
the names and aliases of SPECIAL_TOKENS, and what llama.cpp's GGUF converter takes for one, `<|...|>`),
whatever the file says, and plain text is encoded with special tokens left as text (encode_special_tokens).
That is llama.cpp's reading of user text too (parse_special=false leaves CONTROL tokens as text), and the GGUF
export, which types the tokenizer's special tokens CONTROL, carries the marks. Other added tokens (ordinary
text some tokenizers add as tokens) are still matched, as llama.cpp matches USER_DEFINED ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from . import CodeforgeError
from .atomic import publish, staging_dir
from .chat import CHAT_TEMPLATE

if TYPE_CHECKING:
    import torch

EOT = "<|endoftext|>"
# Other spellings of a special token in tokenizers codeforge imports (Qwen2.5-Coder, StarCoder 2 and
# DeepSeek-Coder style), used under codeforge's name when the tokenizer lacks codeforge's own
SPECIAL_ALIASES = {
    "<fim_prefix>": ("<|fim_prefix|>", "<｜fim▁begin｜>"),
    "<fim_suffix>": ("<|fim_suffix|>", "<｜fim▁hole｜>"),
    "<fim_middle>": ("<|fim_middle|>", "<｜fim▁end｜>"),
    "<|repo_name|>": ("<repo_name>", "<reponame>"),
    "<|file_sep|>": ("<file_sep>",),
}
SPECIAL_TOKENS = [
    EOT,  # separates documents in the shards
    "<s>", "</s>", "<pad>", "<unk>",  # seed 000
    "<PR_TITLE>", "<PR_BODY>",  # seed 000
    "<|im_start|>", "<|im_end|>",  # ChatML, seed 004
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",  # seed 003 stage 3
    "<fim_prefix>", "<fim_middle>", "<fim_suffix>",  # fill-in-the-middle
] + [f"<|reserved_{i}|>" for i in range(6)] + [
    "<|repo_name|>", "<|file_sep|>",  # repo-level FIM (llama.cpp's fim_rep / fim_sep; once reserved_6 and _7)
]

# Every spelling of a token codeforge places itself and so never reads from plain text (is_control)
CONTROL_TEXTS = frozenset(SPECIAL_TOKENS) | frozenset(s for spellings in SPECIAL_ALIASES.values()
                                                       for s in spellings)


CODE_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}_]?[\p{L}_][\p{L}\p{N}_]*|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}_]+[\r\n]*[ \t]*|\s*[\r\n]+[ \t]*|\s+(?!\S)|\s+"""
)
# Llama 3's split, which llama.cpp implements under the pre-tokenizer name "llama-bpe" (llama-vocab.cpp): the
# choice for a model that will run in llama.cpp, which refuses pre-tokenizers it does not know and has no
# code-aware one. It costs some compression on code (identifiers split at `_` and digits;
# docs/LOG.md#2026-11-24-llama3-split-default).
LLAMA3_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| """
    r"""?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
SPLITS = {"code": CODE_SPLIT_PATTERN, "llama3": LLAMA3_SPLIT_PATTERN}
# The split regexes of the models codeforge imports, as their tokenizer.json has them (Llama 3's is llama3's;
# GPT-2's is ByteLevel's built-in rule, written out here for a tokenizer.json that spells it as a Split).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The allow-list: regexes (in tokenizer.json's normalizer, pre_tokenizer or decoder) that load without a
# probe. Compared as exact strings, as JSON decodes them.
KNOWN_SPLIT_PATTERNS = {
    "Llama 3's (codeforge's llama3)": LLAMA3_SPLIT_PATTERN, "codeforge's code": CODE_SPLIT_PATTERN,
    "Qwen2's": QWEN2_SPLIT_PATTERN, "GPT-2's": GPT2_SPLIT_PATTERN,
}
REGEX_FIELDS = ("normalizer", "pre_tokenizer", "decoder")  # the tokenizer.json fields that may hold a regex
# Probe texts for a regex not in the allow-list: runs of one kind of text (letters, words and spaces, digits,
# punctuation, whitespace, newlines, non-ASCII letters), cut short by another kind, at growing lengths. A rule
# that backtracks catastrophically fails (onig's retry limit: a panic) or crawls on one of them; a sound one
# takes about 0.1 s for all of them. A probe may take at most PROBE_SECONDS + PROBE_SECONDS_PER_CHAR per
# character (a sound rule: ~5 us per character), timed twice before it counts as too slow.
PROBE_UNITS = ("a", "a ", "ab1_", "A", "Ab ", "1", "1 ", "!", "!(", " ", "\n", "\t ", "\u00e9", "\u00c9",
               "'s", "\r\n", "\u4e2d", "\U0001f600")
PROBE_ENDS = ("", "!", "a", " ", "1", "\n")
PROBE_LENGTHS = (8, 16, 32, 64, 128, 256, 512, 2048)
PROBE_SECONDS, PROBE_SECONDS_PER_CHAR = 0.1, 5e-5
DEFAULT_SPLIT = "llama3"
# the name llama.cpp's llama-vocab.cpp knows the rule by
LLAMA_CPP_PRE = {"llama3": "llama-bpe", "code": None}
MIN_VOCAB, MAX_VOCAB = 256, 200_000
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "codeforge_tokenizer.json"


class TokenizerError(CodeforgeError):
    """A tokenizer could not be trained or loaded, or cannot encode a text (its rule fails on it: a server
    answers 400); the message says what to do."""


def _tokenizer_failure(e: BaseException) -> bool:
    """Whether `e`, raised by HF tokenizers, is the tokenizer failing: a Rust panic
    (pyo3_runtime.PanicException, a BaseException, e.g. the regex engine giving up) or one of its errors (bare
    Exceptions); not a KeyboardInterrupt, SystemExit or GeneratorExit, nor a wrong argument (TypeError) or
    MemoryError."""
    if isinstance(e, Exception):
        return not isinstance(e, (TypeError, MemoryError, CodeforgeError))
    return _is_panic(e)


def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


def _failure_reason(e: BaseException) -> str:
    if _is_panic(e):
        return (f"the tokenizer's regex engine gave up ({str(e)[:200]}), as it does where a split rule "
                f"backtracks catastrophically")
    return f"{type(e).__name__}: {str(e)[:300]}"


def _regexes(node: object, field: str, out: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(field, regex) for every {"Regex": ...} pattern in a tokenizer.json subtree."""
    if isinstance(node, dict):
        if isinstance(node.get("Regex"), str):
            out.append((field, node["Regex"]))
        for v in node.values():
            _regexes(v, field, out)
    elif isinstance(node, list):
        for v in node:
            _regexes(v, field, out)
    return out


def _probe_texts(extra: tuple[str, ...] = ()) -> Iterator[str]:
    """The probe texts; `extra`: characters the rule names itself, as units and ends of their own (a rule
    keyed on a character no fixed unit holds, `(c+c+)+d`, passed the fixed probes and panicked on
    `"c" * 40`)."""
    for n in PROBE_LENGTHS:
        for unit in PROBE_UNITS + extra:
            for end in PROBE_ENDS + extra[:8]:
                yield (unit * (n // len(unit) + 1))[: n - len(end)] + end


REGEX_SYNTAX = re.compile(r"\\[pP]\{[^}]*\}|\\[pPdDwWsSbBAzZGhHRXNnrtfve]|\{\d*,?\d*\}"
                          r"|\(\?(?:[a-zA-Z-]*:|[=!]|<[=!]|[a-zA-Z-]*\))|[][(){}|*+?^$.\\]")


def rule_characters(regexes: list[str], most: int = 24) -> tuple[str, ...]:
    """The literal characters rules name (their syntax and classes left out), in order of first use, at most
    `most`: probe units a backtracking rule keyed on them cannot miss."""
    seen: dict[str, None] = {}
    for r in regexes:
        for c in REGEX_SYNTAX.sub("", r):
            if c.isprintable() and not c.isspace():
                seen.setdefault(c, None)
    return tuple(seen)[:most]


def _probe(tok: Tokenizer, extra: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(probe text, why) for the first probe text `tok` fails on or crawls over, else None."""
    for text in _probe_texts(extra):
        limit = PROBE_SECONDS + PROBE_SECONDS_PER_CHAR * len(text)
        took = []
        for _ in range(2):  # a slow probe is timed again: one pause of the machine is not the rule's
            t0 = time.perf_counter()
            try:
                tok.decode(tok.encode(text, add_special_tokens=False).ids)
            except BaseException as e:
                if not _tokenizer_failure(e):
                    raise
                return text, _failure_reason(e)
            took.append(time.perf_counter() - t0)
            if took[-1] <= limit:
                break
        if min(took) > limit:
            return text, (f"it took {min(took):.2f} s (at most {limit:.2f} s allowed), as it does where a "
                          f"split rule backtracks catastrophically")
    return None


_VETTED: dict[str, tuple[list[tuple[str, str]], tuple[str, str] | None]] = {}  # by content hash


def vet_rules(tok: Tokenizer, f: Path, content_hash: str, log: Callable[[str], None] | None = None) -> None:
    """Refuse (TokenizerError naming the file, the field and the fix) a tokenizer whose regexes are not in
    KNOWN_SPLIT_PATTERNS and that fails or crawls on a probe text; warn (`log`, default stderr) when such
    regexes pass the probe. Known regexes are not probed; verdicts are remembered by content hash."""
    if content_hash not in _VETTED:
        found: list[tuple[str, str]] = []
        for field in REGEX_FIELDS:
            part = getattr(tok, field, None)
            if part is not None:
                _regexes(json.loads(part.__getstate__()), field, found)
        known = set(KNOWN_SPLIT_PATTERNS.values())
        unknown = [(field, r) for field, r in found if r not in known]
        extra = tuple(c for c in rule_characters([r for _, r in unknown]) if c not in "".join(PROBE_UNITS))
        _VETTED[content_hash] = (unknown, _probe(tok, extra) if unknown else None)
    unknown, failed = _VETTED[content_hash]
    if not unknown:
        return
    if len(unknown) == 1:
        field, r = unknown[0]
        what = (f"the split rule in its pre_tokenizer, {r!r}, is" if field == "pre_tokenizer" else
                f"the regex in its {field}, {r!r}, is")
    else:
        what = "the regexes in its " + ", ".join(f"{field} {r!r}" for field, r in unknown) + " are"
    fields = " and ".join(sorted({field for field, _ in unknown}))
    known = ("Llama 3's split regex, which is codeforge's llama3, codeforge's code split, Qwen2's or GPT-2's "
             "split regex, or GPT-2's ByteLevel pre_tokenizer")
    if failed is not None:
        text, why = failed
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}...{text[-8:]!r}"
        raise TokenizerError(
            f"{f}: {what} not one codeforge knows, and the tokenizer fails on a {len(text)}-character probe "
            f"text ({shown}): {why}, so prompts like it would fail too. Fix: give {f} a {fields} with a rule "
            f"codeforge knows ({known}), e.g. save the model's original tokenizer again, or train a "
            f"tokenizer with `codeforge tokenizer train`")
    msg = (f"{f}: {what} not one codeforge knows ({known}); it passed codeforge's probe for catastrophic "
           f"backtracking and is used as it is")
    (log or _warn)(msg)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _build_empty(split: str = DEFAULT_SPLIT) -> Tokenizer:
    # llama.cpp's llama-bpe takes a pre-token that is itself in the vocabulary whole, before any merge
    # (ignore_merges, as Llama 3's own tokenizer.json says): the same here, so the ids agree in every case.
    tok = Tokenizer(models.BPE(ignore_merges=(split == "llama3")))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def file_hash(path: str | os.PathLike) -> str:
    """Content hash of a tokenizer.json; shards and checkpoints record it to detect mismatches."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def is_control(text: str) -> bool:
    """Whether an added token spelled `text` is a control token, never made from plain text: codeforge's own
    (CONTROL_TEXTS), or one llama.cpp's convert_hf_to_gguf.py (does_token_look_special) makes a CONTROL token
    whatever its tokenizer.json says, `<|...|>` or DeepSeek's `<｜...｜>` (Qwen's <|fim_pad|>), so that
    codeforge reads user text as llama.cpp does."""
    return text in CONTROL_TEXTS or (text.startswith("<|") and text.endswith("|>")) or (
        text.startswith("<\uff5c") and text.endswith("\uff5c>"))


def mark_control_tokens(tok: Tokenizer) -> list[str]:
    """Mark special, in `tok` (not in its file), every added token is_control takes for a control token and
    the file does not mark: plain text (encoded with encode_special_tokens) then keeps them as text, and the
    GGUF export types them CONTROL. Their ids, their other flags and the vocabulary stay as they are.
    Returns their texts."""
    fix = {i: a for i, a in tok.get_added_tokens_decoder().items() if not a.special and is_control(a.content)}
    if fix:
        # adding a token the vocabulary holds keeps its id and replaces its entry: the same token, now special
        size = tok.get_vocab_size()
        tok.add_special_tokens([AddedToken(a.content, single_word=a.single_word, lstrip=a.lstrip,
                                           rstrip=a.rstrip, normalized=a.normalized, special=True)
                                for a in fix.values()])
        # checked, not assumed: a moved id would silently change every shard and prompt
        if tok.get_vocab_size() != size or any(tok.token_to_id(a.content) != i for i, a in fix.items()):
            raise TokenizerError(
                f"marking the control tokens {[a.content for a in fix.values()][:8]} special moved their ids "
                f"in this version of `tokenizers`; mark them \"special\": true in tokenizer.json instead")
    return [a.content for a in fix.values()]


class CodeTokenizer:
    """A trained tokenizer plus what codeforge needs around it (special ids, content hash)."""

    def __init__(self, tok: Tokenizer, path: Path | None = None):
        self.tok = tok
        # Text from a corpus is data: a literal "<s>" inside a source file must not become the special token,
        # nor "<|fim_middle|>" where an imported tokenizer.json leaves it unmarked (mark_control_tokens);
        # `marked`: the tokens this load marked
        self.marked = mark_control_tokens(tok)
        self.tok.encode_special_tokens = True
        self._raw: Tokenizer | None = None  # _reading_special's copy, made on first use
        self._copy_lock = threading.Lock()
        self.path = path
        self.hash = file_hash(path / TOKENIZER_FILE) if path is not None else ""
        self.vocab_size = tok.get_vocab_size()
        self.special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        for name, others in SPECIAL_ALIASES.items():  # an imported tokenizer's own FIM tokens do the same job
            if self.special_ids.get(name) is None:
                self.special_ids[name] = next((i for o in others if (i := tok.token_to_id(o)) is not None),
                                              None)
        self.eot_id = self.special_ids[EOT]
        # added tokens (codeforge's specials, an imported tokenizer's own) are text as written, not byte-level
        self._special_set = frozenset(tok.get_added_tokens_decoder())

    def special_text(self, name: str) -> str | None:
        """The text of special token `name` in this tokenizer (an alias's spelling where it uses one)."""
        i = self.special_ids.get(name)
        return None if i is None else self.tok.id_to_token(i)

    # -- loading ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, log: Callable[[str], None] | None = None) -> "CodeTokenizer":
        """The tokenizer in directory `path` (or its tokenizer.json), vetted (vet_rules): a rule that fails on
        probe texts is refused with TokenizerError; an unknown one that passes is said to `log` (default:
        stderr)."""
        p = Path(path)
        if p.is_file() and p.name == TOKENIZER_FILE:
            p = p.parent
        f = p / TOKENIZER_FILE
        if not f.exists():
            raise TokenizerError(
                f"no tokenizer at {p} (expected {f}); "
                f"train one with `codeforge tokenizer train --input SRC --out {p}`")
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises a bare Exception on a corrupt file
            raise TokenizerError(f"{f} is not a valid tokenizer.json: {e}") from e
        if tok.token_to_id(EOT) is None:
            raise TokenizerError(f"{f} lacks the {EOT} token; it was not trained by codeforge")
        out = cls(tok, p)
        vet_rules(tok, f, out.hash, log)
        return out

    # -- encoding -----------------------------------------------------------------------------------------
    # Every call into the Rust tokenizer goes through _encoding/_guard: what fails there (a panic of its regex
    # engine included, which is a BaseException) comes out as TokenizerError, which the CLI prints and the
    # server answers with a 400.
    def _reading_special(self) -> Tokenizer:
        """A copy of the tokenizer that reads special-token strings as their tokens (a prompt given raw).
        A copy, not the flag flipped on the shared one: another thread encoding plain text meanwhile would
        read its control-token strings as tokens."""
        with self._copy_lock:
            if self._raw is None:
                self._raw = Tokenizer.from_str(self.tok.to_str())
                self._raw.encode_special_tokens = False
            return self._raw

    def _encoding(self, text: str, allow_special: bool = False):
        try:
            tok = self._reading_special() if allow_special else self.tok
            return tok.encode(text, add_special_tokens=False)
        except BaseException as e:
            if not _tokenizer_failure(e):
                raise
            n = len(text) if isinstance(text, str) else 0
            raise TokenizerError(f"the tokenizer cannot encode this text ({n:,} characters): "
                                 f"{_failure_reason(e)}") from None

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With allow_special, special-token strings in the text become their ids.
        TokenizerError when the tokenizer fails on the text."""
        return self._encoding(text, allow_special).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, (start, end) character offsets of each token) of `text`, special-token strings as text."""
        enc = self._encoding(text)
        return enc.ids, enc.offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of many texts at once, in parallel over all cores (Rust threads). TokenizerError (for the first
        text it fails on) when the tokenizer fails."""
        try:
            return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]
        except BaseException as e:
            if not _tokenizer_failure(e):
                raise
            for t in texts:  # which one: the same error, one text at a time
                self.encode(t)
            raise TokenizerError(f"the tokenizer cannot encode these {len(texts):,} texts: "
                                 f"{_failure_reason(e)}") from None

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = list(ids)
        try:
            return self.tok.decode(ids, skip_special_tokens=skip_special)
        except BaseException as e:
            if not _tokenizer_failure(e):
                raise
            raise TokenizerError(f"the tokenizer cannot decode these {len(ids):,} token ids: "
                                 f"{_failure_reason(e)}") from None

    def token_bytes(self, i: int) -> bytes:
        """The bytes of text one token id stands for (a special token: its name; an unknown id: none); a
        token may hold part of a UTF-8 character, which is why this is bytes and not text."""
        piece = self.tok.id_to_token(i)
        if piece is None:
            return b""
        if i in self._special_set:
            return piece.encode()
        dec = _byte_decoder()
        return bytes(dec[ch] for ch in piece if ch in dec)


def write_hf_config(tok_dir: str | os.PathLike) -> None:
    """tokenizer_config.json for `transformers` (PreTrainedTokenizerFast): special tokens and the chat
    template (chat.py), so AutoTokenizer.apply_chat_template renders conversations as codeforge does."""
    present = set(SPECIAL_TOKENS)
    # only the special tokens this tokenizer has (one made before <|repo_name|> existed has reserved ones)
    try:
        added = json.loads((Path(tok_dir) / TOKENIZER_FILE).read_text()).get("added_tokens", [])
        present = {a.get("content") for a in added if isinstance(a, dict)}
    except (OSError, ValueError, AttributeError):
        pass
    (Path(tok_dir) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000,
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "additional_special_tokens": [t for t in SPECIAL_TOKENS
                                      if t not in ("<s>", "</s>", "<pad>", "<unk>") and t in present],
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def train_tokenizer(texts: Iterator[str], vocab_size: int, out_dir: str | os.PathLike,
                    min_frequency: int = 2, show_progress: bool = False,
                    overwrite: bool = False, split: str = DEFAULT_SPLIT) -> tuple[CodeTokenizer, dict]:
    """Train byte-level BPE from an iterator of texts (streamed: memory grows with distinct pre-tokens,
    not with the corpus) and write tokenizer.json, the HF wrapper files and codeforge's metadata. A non-empty
    `out_dir` is replaced only with overwrite (shards and runs made with it would no longer match).
    split: the pre-tokenizer rule, "llama3" (the default; llama.cpp's "llama-bpe": GGUF export) or "code"
    (CODE_SPLIT_PATTERN: 8-12% fewer tokens on code, no GGUF)."""
    if split not in SPLITS:
        raise TokenizerError(f"--split {split!r} is not one of {sorted(SPLITS)}")
    if not (MIN_VOCAB <= vocab_size <= MAX_VOCAB):
        raise TokenizerError(
            f"--vocab-size {vocab_size} is out of range [{MIN_VOCAB}, {MAX_VOCAB}]: "
            f"pick e.g. 32000 for code, or 50000 as GPT-2 uses")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise TokenizerError(
            f"--vocab-size {vocab_size} leaves no room for merges: 256 byte symbols + "
            f"{len(SPECIAL_TOKENS)} special tokens need at least {256 + len(SPECIAL_TOKENS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        what = "a tokenizer" if (out / TOKENIZER_FILE).exists() else "other files"
        raise TokenizerError(
            f"{out} already holds {what}; choose another --out, or pass --overwrite to replace it")
    stats = {"documents": 0, "bytes": 0}

    def counted() -> Iterator[str]:
        for t in texts:
            stats["documents"] += 1
            stats["bytes"] += len(t.encode("utf-8"))
            yield t

    tok = _build_empty(split)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    t0 = time.perf_counter()
    tok.train_from_iterator(counted(), trainer=trainer)
    seconds = time.perf_counter() - t0
    if stats["documents"] == 0:
        raise TokenizerError("no training text: every input was empty or filtered out")

    # Write aside, then rename into place: an interrupted run never leaves a half-written tokenizer.
    tmp = staging_dir(out)
    tok.save(str(tmp / TOKENIZER_FILE))
    write_hf_config(tmp)
    meta = {
        "format": "codeforge-tokenizer-v1", "vocab_size": tok.get_vocab_size(),
        "requested_vocab_size": vocab_size, "hash": file_hash(tmp / TOKENIZER_FILE),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}, "eot": EOT,
        "split": split, "pre_tokenizer_pattern": SPLITS[split], "llama_cpp_pre": LLAMA_CPP_PRE[split],
        "train_documents": stats["documents"],
        "train_bytes": stats["bytes"], "train_seconds": round(seconds, 2),
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    publish(tmp, out)
    return CodeTokenizer.load(out), meta


def evaluate_tokenizer(tok: CodeTokenizer, texts: Iterable[str]) -> dict:
    """Bytes per token and byte-exact round-trip over `texts`."""
    n_bytes = n_tokens = n_docs = 0
    failures: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_bytes, n_tokens, n_docs
        for text, ids in zip(batch, tok.encode_batch(batch)):
            n_bytes += len(text.encode("utf-8"))
            n_tokens += len(ids)
            if tok.decode(ids) != text:
                failures.append(n_docs)
            n_docs += 1
        batch.clear()

    for t in texts:
        batch.append(t)
        if len(batch) >= 256:
            flush()
    flush()
    return {"documents": n_docs, "bytes": n_bytes, "tokens": n_tokens,
            "bytes_per_token": n_bytes / max(n_tokens, 1), "roundtrip_failures": len(failures),
            "roundtrip_ok": not failures}


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes map to themselves, the other 68 byte values to
    the code points 256, 257, ... in order (the GPT-2 byte-level convention that HF tokenizers uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_byte_lengths(tok: CodeTokenizer, size: int | None = None) -> torch.Tensor:
    """(size,) int64: how many bytes of text each token id stands for; 0 for special and unused ids."""
    import torch  # here, not at the top: training a tokenizer never loads torch
    dec = _byte_decoder()
    lengths = torch.zeros(size or tok.vocab_size, dtype=torch.int64)
    special = set(tok.special_ids.values())
    for piece, i in tok.tok.get_vocab().items():
        if i not in special and i < len(lengths):
            lengths[i] = sum(1 for ch in piece if ch in dec)
    return lengths
