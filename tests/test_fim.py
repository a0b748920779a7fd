"""Fill-in-the-middle: the training permutation, its determinism and resume,
generate --suffix, eval --infill."""

import json

import numpy as np
import pytest

from codeforge.cli import main
from codeforge.fim import infill_ids, permute_window
from codeforge.data.loader import BatchLoader
from codeforge.data.shards import ShardSet
from codeforge.tokenizer import CodeTokenizer

EOT, PRE, MID, SUF = 0, 900, 901, 902


def test_permutation_psm_and_spm_keep_every_token_in_place_of_order():
    doc = np.arange(10, 30, dtype=np.int64)
    for spm, expect_head in ((0.0, [PRE]), (1.0, [PRE, SUF])):
        found = set()
        for seed in range(50):
            w = np.concatenate([doc, [EOT] * 4])  # room for the 3 FIM tokens: nothing of the document is cut
            out = permute_window(w, EOT, (PRE, MID, SUF), 1.0, spm, np.random.default_rng(seed))
            assert len(out) == len(w) and out.dtype == w.dtype
            assert list(out[:len(expect_head)]) == expect_head
            assert sorted(t for t in out if t not in (PRE, MID, SUF, EOT)) == doc.tolist()
            i_mid = list(out).index(MID)
            if spm == 0.0:  # PSM: prefix <suf> suffix <mid> middle; prefix + middle + suffix is the document
                i_suf = list(out).index(SUF)
                p, s, m = list(out[1:i_suf]), list(out[i_suf + 1:i_mid]), list(out[i_mid + 1:len(doc) + 3])
                assert p + m + s == doc.tolist()
            else:  # SPM: <pre> <suf> suffix <mid> prefix middle
                s, pm = list(out[2:i_mid]), list(out[i_mid + 1:len(doc) + 3])
                assert pm + s == doc.tolist()
            found.add(i_mid)
        assert len(found) > 5  # the cut points vary with the generator


def test_rate_zero_and_short_pieces_are_untouched():
    w = np.array([5, 6, 7, EOT, 8, EOT, 9], dtype=np.uint16)
    rng = np.random.default_rng(0)
    assert permute_window(w, EOT, (PRE, MID, SUF), 0.0, 0.5, rng) is w
    out = permute_window(np.array([EOT, 4, EOT], dtype=np.int64), EOT, (PRE, MID, SUF), 1.0, 0.5, rng)
    assert out.tolist() == [EOT, 4, EOT]  # a one-token piece is left as it is


def test_loader_fim_is_deterministic_and_resumes_exactly(data_dir, tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    ss = ShardSet(data_dir, "train")
    fim = {tok.special_ids[t] for t in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>")}

    def loader(rate=0.5):
        return BatchLoader(ss, 4, 64, seed=3, fim_rate=rate, special_ids=tok.special_ids)

    a, b = loader(), loader()
    xs = [a.next_batch()[0] for _ in range(6)]
    assert all((x == b.next_batch()[0]).all() for x in xs)
    assert any(bool(np.isin(x.numpy(), list(fim)).any()) for x in xs)
    plain = [BatchLoader(ss, 4, 64, seed=3).next_batch()[0]]
    assert not np.isin(plain[0].numpy(), list(fim)).any()
    state = a.state_dict()
    want = a.next_batch()
    c = loader()
    c.load_state_dict(json.loads(json.dumps(state)))
    got = c.next_batch()
    assert (want[0] == got[0]).all() and (want[1] == got[1]).all()
    with pytest.raises(ValueError, match="fim_rate"):
        loader(0.0).load_state_dict(state)


def test_infill_prompt_is_psm(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    ids = infill_ids(tok, "def f(x):\n", "\n    return y\n")
    s = tok.special_ids
    assert ids[0] == s["<fim_prefix>"] and ids[-1] == s["<fim_middle>"] and s["<fim_suffix>"] in ids
    assert tok.decode(ids) == "<fim_prefix>def f(x):\n<fim_suffix>\n    return y\n<fim_middle>"


@pytest.fixture(scope="module")
def fim_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fim") / "r"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "1", "--n-head", "2",
                 "--n-embd", "32", "--block-size", "64", "--batch-size", "4", "--max-iters", "6",
                 "--eval-every", "0", "--eval-tokens", "64", "--device", "cpu", "--no-progress"]) == 0
    return out


def test_training_defaults_to_fim_and_generate_fills_the_middle(fim_run, capsys):
    cfg = (fim_run / "config.toml").read_text()
    assert "fim_rate = 0.5" in cfg
    capsys.readouterr()
    assert main(["generate", "--run", str(fim_run), "--prompt", "def f(x):\n", "--suffix", "\n    return y\n",
                 "--max-new-tokens", "8", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):\n") and out.endswith("\n    return y\n\n")
    assert "<fim_" not in out


def test_eval_infill_reports_exact_and_syntax(fim_run, capsys):
    capsys.readouterr()
    assert main(["eval", "--run", str(fim_run), "--syntax-samples", "0", "--infill", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["infill_cases"] >= 2
    for k in ("infill_line_exact", "infill_line_syntax", "infill_span_exact", "infill_span_syntax"):
        assert 0.0 <= r[k] <= 1.0
    assert r["infill_middle_bpb"] > 0 and r["infill_middle_bpb_prefix_only"] > 0


def test_infill_cases_cut_files_at_several_lines():
    from codeforge.evaluation.generation import infill_cases
    doc = "".join(f"def f{i}(x):\n    y = x + {i}\n    return y\n\n\n" for i in range(8))
    cases = infill_cases([doc], 4, seed=1)
    assert [c["kind"] for c in cases].count("line") == 4 and [c["kind"] for c in cases].count("span") == 4
    for c in cases:
        assert c["prefix"] + c["middle"] + c["suffix"] == doc and c["middle"].strip()
    assert len({(c["kind"], len(c["prefix"])) for c in cases}) == len(cases)  # each at another place
    assert infill_cases(["def broken(:\n"] * 3, 4) == []  # files that do not parse are never used


def test_a_prompt_cut_to_the_context_keeps_its_fim_tokens(tokenizer_dir):
    """Found in review: the last resort cut could run through <fim_suffix>. Now other files go first, then the
    prefix's start, then the suffix's end, and the three FIM tokens always stay;
    fills end where llama.cpp's do."""
    from codeforge.fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, fit_infill, infill_stop_ids, repo_infill_ids
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tokenizer_dir)
    sp = tok.special_ids
    ids = repo_infill_ids(tok, "a = 1\n" * 50, "b = 2\n" * 50, [("u.py", "c = 3\n" * 50)], n_ctx=4096,
                          n_batch=2048, n_predict=-1)
    for room in (len(ids) - 5, 60, 12, 3):
        cut = fit_infill(ids, room, sp)
        assert len(cut) == max(room, 3) and [
            t for t in cut if t in (sp[FIM_PREFIX], sp[FIM_SUFFIX], sp[FIM_MIDDLE])
        ] == [sp[FIM_PREFIX], sp[FIM_SUFFIX], sp[FIM_MIDDLE]]
    assert cut == [sp[FIM_PREFIX], sp[FIM_SUFFIX], sp[FIM_MIDDLE]]
    assert {sp["<|file_sep|>"], sp["<|repo_name|>"], tok.eot_id, sp["<|im_end|>"]} <= infill_stop_ids(tok)


def test_repo_level_fim_documents_are_made_at_prepare_time(tmp_path, tokenizer_dir):
    """prepare --repo-fim: chosen training files get a second document in llama-server's repo-level layout,
    context from earlier training files of the same directory only; validation is untouched; the same inputs
    give the same bytes; the loader's own FIM leaves these documents alone; without the option the options
    (and so the fingerprint of data prepared before it) are unchanged."""
    import numpy as np

    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import ShardError, ShardSet, prepare
    from codeforge.fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, fim_ids, permute_window
    from codeforge.tokenizer import CodeTokenizer
    src = tmp_path / "proj"
    for d in ("a", "b"):
        (src / d).mkdir(parents=True)
        for i in range(6):
            (src / d / f"m{i}.py").write_text(f"def f_{d}{i}(x):\n    y = x + {i}\n    return y * {i + 1}\n")
    opts = CorpusOptions(val_fraction=0.2)
    plain = prepare([str(src)], tokenizer_dir, tmp_path / "plain", opts, log=lambda m: None)
    assert "repo_fim" not in plain["options"]
    meta = prepare([str(src)], tokenizer_dir, tmp_path / "repo", opts, log=lambda m: None, repo_fim=1.0)
    prepare([str(src)], tokenizer_dir, tmp_path / "again", opts, log=lambda m: None, repo_fim=1.0)
    assert (
        meta["options"]["repo_fim"] == 1.0
        and meta["repo_fim_documents"] == plain["splits"]["train"]["documents"]
    )
    for f in ("train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "repo" / f).read_bytes() == (tmp_path / "again" / f).read_bytes()
    assert (tmp_path / "repo" / "val_000000.bin").read_bytes() == (
        tmp_path / "plain" / "val_000000.bin"
    ).read_bytes()
    tok = CodeTokenizer.load(tokenizer_dir)
    sp = tok.special_ids
    train = ShardSet(tmp_path / "repo", "train")
    val_texts = {tok.decode(ShardSet(tmp_path / "plain", "val").document(i).tolist())
                 for i in range(plain["splits"]["val"]["documents"])}
    repo_docs = [train.document(i).tolist() for i in range(train.documents)
                 if train.document(i)[0] == sp["<|repo_name|>"]]
    assert len(repo_docs) == meta["repo_fim_documents"] > 0
    for ids in repo_docs:
        assert tok.decode(ids[1:ids.index(sp["<|file_sep|>"])]) == "proj\n"  # the repository's name
        a, b, c = ids.index(sp[FIM_PREFIX]), ids.index(sp[FIM_SUFFIX]), ids.index(sp[FIM_MIDDLE])
        assert a < b < c and ids[a - 1] != sp["<|file_sep|>"]
        # prefix middle suffix
        whole = tok.decode(ids[a + 1:b]) + tok.decode(ids[c + 1:]) + tok.decode(ids[b + 1:c])
        assert whole not in val_texts and whole.startswith("def f_")
        contexts = [tok.decode(ids[i + 1:]).split("\n", 1) for i, t in enumerate(ids[:a])
                    if t == sp["<|file_sep|>"]]
        assert 1 <= len(contexts) <= 3 and all(name.startswith(("a/", "b/")) for name, _ in contexts)
    old = tmp_path / "oldtok"  # a tokenizer from before the two tokens: refused with the fix
    import shutil
    shutil.copytree(tokenizer_dir, old)
    (old / "tokenizer.json").write_text(
        (old / "tokenizer.json").read_text().replace("<|repo_name|>", "<|reserved_6|>")
    )
    with pytest.raises(ShardError,
                       match="--repo-fim needs the tokenizer's <\\|repo_name\\|>.*tokenizer train"):
        prepare([str(src)], old, tmp_path / "x", opts, log=lambda m: None, repo_fim=0.5)
    window = np.array(repo_docs[0] + [tok.eot_id] + repo_docs[-1][:5], dtype=np.int64)
    out = permute_window(window, tok.eot_id, fim_ids(sp), 1.0, 0.5, np.random.default_rng(0))
    assert out[:len(repo_docs[0])].tolist() == repo_docs[0]  # left as it is
