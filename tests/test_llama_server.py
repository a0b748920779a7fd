"""The other side of /infill: llama.cpp's own `llama-server`, built from the pinned llama-cpp-python's sources
(benchmarks/build_llama_server.py), serves codeforge's GGUF export to an editor's /infill request with other
files in `input_extra`; codeforge's own /infill must build the same prompt (the same number of tokens
evaluated) and, greedy, write the same middle. Slow: it needs the built binary (skipped without it)."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from codeforge.checkpoint import save_checkpoint
from codeforge.cli import main
from codeforge.models import build_model
from codeforge.models.gpt import GPTConfig
from codeforge.tokenizer import CodeTokenizer
from conftest import free_port, wait_healthy
from test_export import make_run, randomize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from build_llama_server import binary_path

pytestmark = pytest.mark.slow


def llama_server() -> str:
    path = (
        os.environ.get("CODEFORGE_LLAMA_SERVER")
        or (str(binary_path()) if binary_path().exists() else None)
        or shutil.which("llama-server")
    )
    if not path:
        pytest.skip("llama-server is not built: python benchmarks/build_llama_server.py")
    return path


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        pytest.fail(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:1000]}")


@contextlib.contextmanager
def both_servers(tmp: Path, run: Path):
    """llama-server on the run's GGUF (f32, so greedy is not moved by quantization) and codeforge serve on the
    run, both keeping what llama-server keeps with -c 192 -b 64 -n 16: their URLs."""
    binary = llama_server()
    gguf = tmp / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(gguf)]) == 0
    procs = []
    urls = []
    try:
        for name, argv in (("llama",
                            [binary, "-m", str(gguf), "-c", "192", "-b", "64", "-ub", "64", "-n", "16",
                                      "-t", "2",
                                      "--host", "127.0.0.1"]),
                           ("codeforge", [sys.executable, "-m", "codeforge", "serve", "--run", str(run),
                                          "--infill-batch", "64", "--infill-predict", "16", "--device", "cpu",
                                          "--host", "127.0.0.1"])):
            port = free_port()
            log = tmp / f"{name}.log"
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(argv + ["--port", str(port)], stdout=f,
                                              stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            wait_healthy(procs[-1], urls[-1], log, name, seconds=180)
        yield urls
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tokenizer_dir):
    llama_server()
    tmp = tmp_path_factory.mktemp("llama-server")
    with both_servers(tmp, make_run(tmp / "run", tokenizer_dir, seed=3)) as urls:
        yield urls


REQUESTS = [
    {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"},
    {"input_prefix": "import os\n\ndef main():\n    path = ", "input_suffix": "\n    return path\n",
     "input_extra": [{"filename": "util.py", "text": "def helper(x):\n    return x * 2\n"},
                     {"filename": "config.py", "text": "ROOT = '/srv'\nDEBUG = False\n"}]},
    {"input_prefix": "x = 1\n" * 60, "input_suffix": "y = 2\n" * 30, "prompt": "z = ",
     "input_extra": [{"filename": "big.py", "text": "w = 3\n" * 80}]},  # every part cut by the budget
]


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_infill_builds_llama_servers_prompt_and_writes_its_middle(servers, i):
    llama, ours = servers
    body = {**REQUESTS[i], "n_predict": 12, "temperature": 0, "top_k": 1, "seed": 0, "cache_prompt": False}
    theirs, mine = post(llama + "/infill", body), post(ours + "/infill", body)
    print(f"\nrequest {i}: llama-server {theirs['tokens_evaluated']} tokens -> {theirs['content']!r}; "
          f"codeforge {mine['tokens_evaluated']} -> {mine['content']!r} (truncated: {mine['truncated']})")
    assert theirs["tokens_predicted"] > 0 and mine["tokens_predicted"] == theirs["tokens_predicted"]
    assert mine["tokens_evaluated"] == theirs["tokens_evaluated"], (theirs, mine)
    assert mine["content"] == theirs["content"], (theirs, mine)
    for special in ("<fim_middle>", "<fim_prefix>", "<|file_sep|>", "<|endoftext|>"):
        assert special not in mine["content"]


def test_eval_repo_scores_the_gguf_in_llama_server_as_the_run(tmp_path, tokenizer_dir):
    """`eval --repo --gguf` starts the real llama-server itself; greedy on the f32 export, its scores equal
    the run's own, with the other files as context and without."""
    from test_repo_eval import py_file
    binary = llama_server()
    repo = tmp_path / "myrepo"
    repo.mkdir()
    for i in range(5):
        (repo / f"m{i}.py").write_text(py_file(i))
    run = make_run(tmp_path / "run", tokenizer_dir, seed=4)
    gguf = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(gguf)]) == 0
    scores = {}
    for name, extra in (("gguf", ["--gguf", str(gguf), "--llama-server", binary]), ("run", [])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--repo", str(repo), "--run", str(run), "--repo-cases", "3", "--repo-both",
                     "--device", "cpu", "--out", str(out)] + extra) == 0
        scores[name] = json.loads(out.read_text())
    assert scores["gguf"]["backend"].startswith("llama-server") and scores["gguf"]["cases"] == 9
    print(json.dumps({k: v["scores"]["all"] for k, v in scores.items()}))
    assert scores["gguf"]["scores_without_context"] == scores["run"]["scores_without_context"]
    assert scores["gguf"]["scores"] == scores["run"]["scores"]


def test_a_lora_runs_merged_gguf_continues_as_codeforge_does(tmp_path, tokenizer_dir, data_dir):
    """A LoRA run's checkpoint is its merged weights: the GGUF export, in llama.cpp's own server, continues
    greedily with the tokens codeforge computes (f32, so quantization moves nothing)."""
    import torch

    from codeforge.checkpoint import load_model
    from codeforge.engine import Engine, SamplingParams
    from codeforge.evaluation.llama_server import running
    binary = llama_server()
    base = make_run(tmp_path / "base", tokenizer_dir, seed=5)
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "ft"), "--init-from", str(base),
                 "--lora-rank", "8", "--lora-alpha", "32", "--learning-rate", "0.05", "--max-iters", "4",
                 "--batch-size", "2", "--eval-every", "0", "--no-tensorboard", "--no-progress",
                 "--device", "cpu", "--local-ranks", "1"]) == 0
    gguf = tmp_path / "ft.gguf"
    assert main(["export", "--run", str(tmp_path / "ft"), "--format", "gguf", "--out", str(gguf)]) == 0
    model, tok, _, _ = load_model(tmp_path / "ft", torch.device("cpu"), "latest")
    start = load_model(base, torch.device("cpu"), "latest")[0]
    eng, eng0 = (
        Engine(model, tok, torch.device("cpu"), "fp32"),
        Engine(start, tok, torch.device("cpu"), "fp32"),
    )
    p = SamplingParams(max_new_tokens=24, temperature=0, stop_at_eot=False)
    moved = 0
    with running(str(gguf), binary, log=lambda m: None) as url:
        for text in ("def add(a, b):\n    return",
                     "import os\n\nclass Store:\n    def __init__(self, root):\n"):
            prompt = tok.encode(text)
            ours = [s[0] for s in eng.generate_ids([prompt], p)]
            moved += ours != [s[0] for s in eng0.generate_ids([prompt], p)]
            theirs = post(url + "/completion",
                          {"prompt": prompt, "n_predict": 24, "temperature": 0, "top_k": 1,
                                                "cache_prompt": False, "return_tokens": True,
                                                "ignore_eos": True})
            assert theirs["tokens"] == ours, (text, theirs["tokens"], ours)
    assert moved  # the adapters changed what the model writes


# -- llama-server's own semantics: n_indent, the sampler chain, /completion ---------------------------------
#
# A random model rarely writes a newline and never a probability the infill sampler keeps, so these run on a
# model built to be a Markov chain: its blocks write nothing into the residual stream (their output
# projections are zero), so the next token's logits depend on the last token only, and they are set:
#   <fim_middle> -> x (9), b (8.8);  x -> "\n" (9), <|endoftext|> (3);  "\n" -> "  " (9);  "  " -> b (9);
#   b -> "\n" (9)
# every other token at logit 0 and the other special tokens far below. Greedy, a fill is "x\n  b\n  b...":
# its second line is indented by 2. The infill sampler (on the whole vocabulary) keeps x and b after
# <fim_middle>, then after x ends the fill: 3 x p(<|endoftext|>) x 1024 candidates outweighs the text.

def markov_run(root: Path, tokenizer_dir: Path) -> tuple[Path, dict[str, int]]:
    tok = CodeTokenizer.load(tokenizer_dir)
    sp = tok.special_ids
    ids = {s: tok.encode(s) for s in ("x", "b", "\n", "  ")}
    assert all(len(v) == 1 for v in ids.values()), ids
    ids = {s: v[0] for s, v in ids.items()}
    eot, mid = tok.eot_id, sp["<fim_middle>"]
    moves = {mid: {ids["x"]: 9.0, ids["b"]: 8.8}, ids["x"]: {ids["\n"]: 9.0, eot: 3.0},
             ids["\n"]: {ids["  "]: 9.0}, ids["  "]: {ids["b"]: 9.0}, ids["b"]: {ids["\n"]: 9.0}}
    cfg = GPTConfig(vocab_size=64 * -(-tok.vocab_size // 64), block_size=192, n_layer=1, n_head=4, n_embd=64,
                    tie_embeddings=False)
    model = build_model(cfg)
    randomize(model, 5, zero=("c_proj.weight", "c_proj.bias"))
    bias = cfg.n_embd - 1  # a dimension the final norm holds at 1: each token's logit offset
    with torch.no_grad():
        model.ln_f.weight.fill_(1.0)
        model.ln_f.weight[bias] = 0.0
        model.ln_f.bias.zero_()
        model.ln_f.bias[bias] = 1.0
        head = model.lm_head.weight
        head.zero_()
        for i in sp.values():
            if i is not None and i != eot:
                head[i, bias] = -30.0
        # a token embedded as 10 e_d normalises to about 7.94 in dimension d (the norm's mean and spread)
        for d, (a, nexts) in enumerate(moves.items()):
            model.wte.weight[a] = 0.0
            model.wte.weight[a, d] = 10.0
            for b, logit in nexts.items():
                head[b, d] += logit / 7.94
    config = {"model": cfg.to_dict(), "train": {}, "tokenizer_hash": tok.hash}
    save_checkpoint(root, 1, model, config, {}, {"tokenizer": tokenizer_dir}, keep_last=1)
    return root, ids


@pytest.fixture(scope="module")
def markov(tmp_path_factory, tokenizer_dir):
    llama_server()
    tmp = tmp_path_factory.mktemp("llama-server-markov")
    run, _ = markov_run(tmp / "run", tokenizer_dir)
    with both_servers(tmp, run) as urls:
        yield urls


FILL = {"input_prefix": "def f(a):\n", "input_suffix": "\n    return a\n", "cache_prompt": False, "seed": 0}
SEMANTICS = [
    # greedy: the second line, indented by 2, is cut before its text at n_indent 3 ("x\n  ", limit)...
    ("/infill", {**FILL, "n_indent": 3, "n_predict": 24, "temperature": 0}, "x\n  ", "limit"),
    # ... kept at n_indent 2 (the budget ends it), and the first line is never judged
    ("/infill", {**FILL, "n_indent": 2, "n_predict": 12, "temperature": 0}, None, "limit"),
    ("/infill", {**FILL, "n_indent": 8, "n_predict": 2, "temperature": 0}, "x\n", "limit"),
    # the infill sampler first, then top-k 1: x survives it, and after x the end of the fill does
    ("/infill", {**FILL, "samplers": ["infill", "top_k"], "top_k": 1, "n_predict": 12}, "x", "eos"),
    ("/infill", {**FILL, "samplers": "ik", "top_k": 1, "n_predict": 12}, "x", "eos"),
    # without the infill sampler the same chain writes on
    ("/infill", {**FILL, "samplers": ["top_k"], "top_k": 1, "n_predict": 6}, None, "limit"),
    # /completion: text (its last token picks the chain) and a FIM template written as text
    # (the prompt's last token is "\n": a first line "  b" that is never judged, then the second is cut)
    ("/completion", {"prompt": "y = 1\n", "n_predict": 9, "temperature": 0, "n_indent": 3,
                     "cache_prompt": False}, "  b\n  ", "limit"),
    ("/completion", {"prompt": "<fim_prefix>def f(x):\n<fim_suffix>\n<fim_middle>", "n_predict": 8,
                     "temperature": 0, "cache_prompt": False}, None, "limit"),
]


@pytest.mark.parametrize("i", range(len(SEMANTICS)))
def test_llama_servers_semantics(markov, i):
    """The same request to both servers on the Markov model: the same content, stop type and counts."""
    llama, ours = markov
    path, body, want, stop_type = SEMANTICS[i]
    theirs, mine = post(llama + path, body), post(ours + path, body)
    print(f"\n{path} {i}: llama-server {theirs['content']!r} ({theirs['stop_type']}); "
          f"codeforge {mine['content']!r} ({mine['stop_type']})")
    for k in ("content", "stop_type", "tokens_evaluated", "tokens_predicted", "has_new_line", "truncated"):
        assert mine[k] == theirs[k], (k, theirs, mine)
    assert theirs["stop_type"] == stop_type and (want is None or theirs["content"] == want), theirs


def test_completion_token_ids_and_response_fields_match(servers):
    llama, ours = servers
    text = post(ours + "/completion", {"prompt": "import os\n\ndef main():\n", "n_predict": 12,
                                        "temperature": 0, "return_tokens": True, "cache_prompt": False})
    ids = post(ours + "/tokenize", {"prompt": "import os\n\ndef main():\n"})["tokens"]
    fields = ["content", "tokens_predicted", "generation_settings/n_predict", "timings/nope", "stop"]
    body = {"prompt": ids, "n_predict": 12, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "response_fields": fields}
    theirs, mine = post(llama + "/completion", body), post(ours + "/completion", body)
    assert list(mine) == list(theirs) == [f for f in fields if f != "timings/nope"]
    assert mine == theirs and mine["content"] == text["content"]
    # a text prompt: the same tokens evaluated, the same greedy continuation
    body = {"prompt": "def add(a, b):\n    return", "n_predict": 16, "temperature": 0, "cache_prompt": False}
    theirs, mine = post(llama + "/completion", body), post(ours + "/completion", body)
    assert (mine["tokens_evaluated"], mine["content"]) == (theirs["tokens_evaluated"], theirs["content"])
