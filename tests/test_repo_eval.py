"""`codeforge eval --repo DIR`: FIM cases from held-out files of a repository, scored for a run, a server's
/infill and an OpenAI completions endpoint with `suffix`."""

import http.server
import json
import threading

import numpy as np
import pytest

from codeforge.cli import main
from codeforge.corpus import content_hash
from codeforge.data.shards import digest_key
from codeforge.evaluation.lm import EvalError
from codeforge.evaluation.repo import (completions_backend, held_out, infill_backend, repo_cases, repo_files,
                                       run_repo_eval, score_repo)
from test_export import make_run


def py_file(i: int) -> str:
    return (f"import os\n\n\ndef load_{i}(path):\n    with open(path) as f:\n        data = f.read()\n"
            f"    if not data:\n        return None\n    return data.split(',')[{i % 3}]\n\n\n"
            f"class Store{i}:\n    def __init__(self, root):\n        self.root = root\n        self.n = "
            f"{i}\n\n    def path(self, name):\n        return os.path.join(self.root, name)\n")


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "myrepo"
    (root / "pkg").mkdir(parents=True)
    for i in range(6):
        (root / ("pkg" if i % 2 else "") / f"m{i}.py").write_text(py_file(i))
    (root / "README.md").write_text("# my repo\n")
    return root


def test_cases_are_cut_from_the_files_with_other_files_as_context(repo):
    files = repo_files(str(repo))
    assert {p for p, _ in files} >= {"m0.py", "pkg/m1.py"}
    cases = repo_cases(files, 4, seed=1)
    assert cases == repo_cases(files, 4, seed=1)  # deterministic for a seed
    assert {c["kind"] for c in cases} == {"line", "span", "block"}
    texts = dict(files)
    for c in cases:
        assert c["prefix"] + c["middle"] + c["suffix"] == texts[c["path"]]
        assert c["path"] not in [p for p, _ in c["extra"]] and 0 < len(c["extra"]) <= 4
        if c["kind"] == "line":
            assert c["middle"].count("\n") == 1
        if c["kind"] == "block":  # the body under a header line ending in ':'
            assert c["prefix"].rstrip().endswith(":") and c["middle"].startswith((" ", "\t"))
    same_dir = [c for c in cases if c["path"].startswith("pkg/")]
    assert same_dir and all(c["extra"][0][0].startswith("pkg/") for c in same_dir)  # its neighbours first


def test_scores_an_oracle_perfectly_and_a_blank_fill_not(repo):
    cases = repo_cases(repo_files(str(repo)), 3)
    by_text = {(c["prefix"], c["suffix"]): c["middle"] for c in cases}
    perfect = score_repo(lambda p, s, extra, n: by_text[(p, s)], cases)
    assert all(v["exact_match"] == 1.0 and v["edit_similarity"] == 1.0 and v["syntax_valid"] == 1.0
               for v in perfect.values())
    assert perfect["all"]["cases"] == len(cases)
    blank = score_repo(lambda p, s, extra, n: "", cases)
    assert blank["all"]["exact_match"] == 0.0 and blank["all"]["edit_similarity"] == 0.0
    seen = []
    score_repo(lambda p, s, extra, n: seen.append(extra) or "", cases, with_context=False)
    assert seen and all(x == [] for x in seen)


def test_files_the_run_trained_on_are_left_out(repo, tmp_path, tokenizer_dir):
    files = repo_files(str(repo))
    run = make_run(tmp_path / "run", tokenizer_dir)
    trained = sorted(digest_key(content_hash(t)) for p, t in files if p != "m0.py")
    np.save(run / "trained_documents.npy", np.array(trained, dtype=np.uint64))
    kept, left_out, checked = held_out(files, str(run))
    assert [p for p, _ in kept] == ["m0.py"] and left_out == len(files) - 1 and checked
    assert held_out(files, None) == (files, 0, False)
    np.save(run / "trained_documents.npy", np.array(sorted(digest_key(content_hash(t)) for _, t in files),
                                                   dtype=np.uint64))
    with pytest.raises(EvalError, match="all .* files were in the run's training data"):
        run_repo_eval(str(repo), str(run))
    with pytest.raises(EvalError, match="not a directory"):
        run_repo_eval(str(tmp_path / "nope"), endpoint="http://127.0.0.1:9")


class Stub(http.server.BaseHTTPRequestHandler):
    """A server answering from a script: each POST's JSON body is kept; the reply is (status, body)."""
    reply = (200, {})
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.seen.append((self.path, body))
        status, out = Stub.reply
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture()
def stub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Stub.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_endpoint_backends_send_what_editors_send(stub):
    Stub.reply = (200, {"content": "x = 1\n", "stop": True})
    fill = infill_backend(stub)
    assert fill("a\n", "b\n", [("pkg/u.py", "def u(): pass\n")], 16) == "x = 1\n"
    path, body = Stub.seen[-1]
    assert path == "/infill" and body["input_extra"] == [{"filename": "pkg/u.py", "text": "def u(): pass\n"}]
    assert body["input_prefix"] == "a\n" and body["input_suffix"] == "b\n" and body["temperature"] == 0
    Stub.reply = (200, {"choices": [{"text": "y = 2\n"}]})
    assert completions_backend(stub + "/v1", "m")("a\n", "b\n", [], 8) == "y = 2\n"
    path, body = Stub.seen[-1]
    assert (
        path == "/v1/completions"
        and body["suffix"] == "b\n"
        and body["model"] == "m"
        and body["max_tokens"] == 8
    )
    # an endpoint without fill-in-the-middle: said, with what to use instead
    Stub.reply = (400, {"error": {"message": "suffix is not supported"}})
    with pytest.raises(EvalError, match="does not take `suffix`.*--endpoint-api infill"):
        completions_backend(stub, None)("a", "b", [], 8)
    Stub.reply = (200, {"choices": []})
    with pytest.raises(EvalError, match="not an OpenAI completions endpoint"):
        completions_backend(stub, None)("a", "b", [], 8)
    with pytest.raises(EvalError, match="is the server running"):
        infill_backend("http://127.0.0.1:9")("a", "b", [], 8)


def test_eval_repo_on_a_run_prints_and_records(repo, tmp_path, tokenizer_dir, capsys):
    run = make_run(tmp_path / "run", tokenizer_dir)
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "2", "--repo-both",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cases"] == 6 and r["held_out_checked"] is False and r["context_files"] == 4
    # "by_file": the average over files, each file alike (test_repo_report.py)
    assert set(r["scores"]) == {"line", "span", "block", "all", "by_file"} and "scores_without_context" in r
    assert all(0 <= v["edit_similarity"] <= 1 for v in r["scores"].values())
    rec = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert rec["repo_eval"]["scores"] == r["scores"]
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "1"]) == 0
    printed = capsys.readouterr().out
    assert "eval --repo" in printed and "edit sim" in printed and "block" in printed


def test_review_fixes_budgets_indentation_and_line_breaks(repo):
    """Found in review: every case gets its own budget (a perfect model was cut short on 8-line blocks), a
    fill with its indentation lost is neither exact nor valid Python, and only "\\n" breaks lines."""
    from codeforge.evaluation.repo import parses, split_lines
    cases = repo_cases(repo_files(str(repo)), 3)
    for i, c in enumerate(cases):
        c["budget"] = 100 + i
    asked = []
    score_repo(lambda p, s, extra, n: asked.append(n) or "", cases)
    assert asked == [100 + i for i in range(len(cases))]
    flat = score_repo(lambda p, s, extra, n: next(c["middle"].lstrip() for c in cases if c["prefix"] == p),
                      cases)
    assert flat["block"]["exact_match"] == 0.0 and flat["block"]["syntax_valid"] < 1.0
    assert not parses("def f():\nreturn 1\n", "python") and parses("def f():\n    return 1\n", "python")
    assert split_lines("a = '\x0c'\nb\u2028c\nd") == ["a = '\x0c'\n", "b\u2028c\n", "d"]


FAKE_LLAMA_SERVER = r'''#!{python}
# stands in for llama-server: records its arguments, answers /health and /infill with one fixed middle
import json, sys, http.server
argv = sys.argv[1:]
open({log!r}, "w").write(json.dumps(argv))
if {exit_code}:
    print("error: failed to load model", file=sys.stderr)
    sys.exit({exit_code})
port = int(argv[argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self.reply({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reply({{"content": "    return None\n", "extra": len(body["input_extra"])}})
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def fake_llama_server(tmp_path, exit_code: int = 0):
    import sys
    exe, log = tmp_path / "llama-server", tmp_path / "argv.json"
    exe.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, log=str(log), exit_code=exit_code))
    exe.chmod(0o755)
    return exe, log


def test_eval_repo_gguf_starts_llama_server_with_the_documented_settings(
    repo, tmp_path, tokenizer_dir, capsys
):
    run = make_run(tmp_path / "run", tokenizer_dir)  # block_size 192
    gguf_file = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(gguf_file)]) == 0
    exe, log = fake_llama_server(tmp_path)
    out = tmp_path / "scores.json"
    assert main(["eval", "--repo", str(repo), "--gguf", str(gguf_file), "--run", str(run), "--llama-server",
                 str(exe), "--repo-cases", "2", "--out", str(out)]) == 0
    argv = json.loads(log.read_text())
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["-m"] == str(gguf_file) and flags["-c"] == "192" and flags["-b"] == flags["-ub"] == "96"
    # an eighth of the context: fills and other files both fit
    assert flags["-n"] == "24" and flags["--host"] == "127.0.0.1"
    r = json.loads(out.read_text())
    assert r["backend"] == f"llama-server {gguf_file}" and r["cases"] == 6
    assert r["scores"]["all"]["cases"] == 6 and r["scores"]["all"]["edit_similarity"] > 0
    assert "eval --repo" in capsys.readouterr().out


def test_eval_repo_gguf_bad_inputs_say_what_to_do(repo, tmp_path, tokenizer_dir, monkeypatch):
    import gguf
    with pytest.raises(EvalError, match="no such file"):
        run_repo_eval(str(repo), gguf=str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(EvalError, match="not a GGUF file"):
        run_repo_eval(str(repo), gguf=str(junk))
    # a GGUF without fill-in-the-middle ids: llama-server's /infill would refuse it, so it is not even started
    nofim = tmp_path / "nofim.gguf"
    w = gguf.GGUFWriter(str(nofim), "llama")
    w.add_context_length(128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EvalError,
                       match=r"no fill-in-the-middle token ids.*codeforge export --run RUN --format gguf"):
        run_repo_eval(str(repo), gguf=str(nofim), llama_server="/bin/false")
    # a server that cannot start: its own words come back
    run = make_run(tmp_path / "run", tokenizer_dir)
    ok = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(ok)]) == 0
    exe, _ = fake_llama_server(tmp_path, exit_code=3)
    with pytest.raises(EvalError, match=r"(?s)exited \(3\).*failed to load model"):
        run_repo_eval(str(repo), gguf=str(ok), llama_server=str(exe))
    monkeypatch.setenv("CODEFORGE_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(EvalError, match="not an executable file"):
        run_repo_eval(str(repo), gguf=str(ok))


def test_infill_endpoint_without_fim_names_the_export_that_fixes_it(stub):
    # llama-server's words for a GGUF without FIM ids
    Stub.reply = (501,
                  {"error": {"code": 501, "message": "Infill is not supported by this model: prefix token is "
                                  "missing"}})
    with pytest.raises(EvalError, match="no fill-in-the-middle tokens: export the run again"):
        infill_backend(stub)("a", "b", [], 4)
