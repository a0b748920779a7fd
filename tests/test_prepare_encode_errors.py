"""A tokenizer failure inside the encoder's own thread is reported as the inline path reports it."""

import pytest

from codeforge import CodeforgeError
from codeforge.corpus import CorpusOptions
from codeforge.data.shards import prepare
from codeforge.tokenizer import CodeTokenizer, TokenizerError


def _quiet(*a):
    pass


def _failure(tmp_path, tokenizer_dir, code_corpus, monkeypatch, workers):
    calls = []

    def boom(self, texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise TokenizerError("the tokenizer cannot encode these texts: boom")
        return [self.encode(t) for t in texts]

    monkeypatch.setattr(CodeTokenizer, "encode_batch", boom)
    monkeypatch.setattr("codeforge.data.steps.BATCH_BYTES", 2000)
    with pytest.raises(BaseException) as e:
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / f"o{workers}", CorpusOptions(), log=_quiet,
                workers=workers, tasks=1)
    return type(e.value), str(e.value).split(" (each task")[0]


def test_encode_thread_error_matches_inline(tmp_path, tokenizer_dir, code_corpus, monkeypatch):
    inline = _failure(tmp_path, tokenizer_dir, code_corpus, monkeypatch, 1)
    threaded = _failure(tmp_path, tokenizer_dir, code_corpus, monkeypatch, None)
    print(inline, threaded)
    assert inline == threaded
    assert issubclass(inline[0], CodeforgeError)
