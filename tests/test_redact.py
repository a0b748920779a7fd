"""Secrets out of the training data (redact.py, with detect-secrets): planted keys, tokens, passwords,
connection strings and private keys are replaced by their kind's placeholder in the shards, counted; hash
constants and identifiers that merely mention a secret stay as they are; --keep-secrets keeps them, loudly."""

import json

import numpy as np

from codeforge.cli import main
from codeforge.redact import redact
from codeforge.tokenizer import CodeTokenizer

PLANTED = {  # value -> a line of code or config that holds it
    "AKIAIOSFODNN7EXAMPLE": 'aws_access_key_id = "AKIAIOSFODNN7EXAMPLE"',
    "ghp_0123456789abcdefghijABCDEFGHIJ012345": 'GITHUB = "ghp_0123456789abcdefghijABCDEFGHIJ012345"',
    "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx":
        'slack = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"',
    "sk_live_4eC39HqLyjWDarjtT1zdp7dc": 'stripe.api_key = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"',
    "hunter2isverysecret": 'DB_PASSWORD = "hunter2isverysecret"',
    "p4ssw0rdQ7": 'DATABASE_URL = "postgres://app:p4ssw0rdQ7@db.internal:5432/app"',
    "9f8e7d6c5b4a39281706f5e4d3c2b1a0": 'api_key: "9f8e7d6c5b4a39281706f5e4d3c2b1a0"',
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U":
        'JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.'
        'dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"',
    "MIIEpAIBAAKCAQEA75Kb0cn3lZb7Ij0X6q5k8b0v1wYH0Y2nGqZt": (
        'KEY = """-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA75Kb0cn3lZb7Ij0X6q5k8b0v1wYH0Y2nGqZt\n'
        'bW9yZSBrZXkgbWF0ZXJpYWwgaGVyZQ==\n-----END RSA PRIVATE KEY-----"""'),
}
KEPT = [  # not secrets: a hash constant, a test vector, identifiers that say "secret"
    'EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"',
    'md5_of_hello = "5d41402abc4b2a76b9719d911017c592"',
    "hs.masterSecret = hs.session.masterSecret if hs else None",
    'secret = os.environ["APP_SECRET"]',
    "def check_password(user, password): return user",
]


def test_each_planted_secret_becomes_its_placeholder_and_the_rest_stays():
    text = "\n".join(list(PLANTED.values()) + KEPT) + "\n"
    out, found = redact(text, "settings.py")
    for value in PLANTED:
        assert value not in out, value
    for line in KEPT:
        assert line in out, line
    assert 'aws_access_key_id = "REDACTED_AWS_ACCESS_KEY"' in out and "REDACTED_PRIVATE_KEY" in out
    assert "postgres://app:REDACTED_BASIC_AUTH_CREDENTIALS@db.internal" in out
    assert sum(found.values()) == len(PLANTED) and found["Private Key"] == 1
    compile(out, "settings.py", "exec")  # the code around each value is whole
    # a config file's unquoted value, and a key inside a base64 blob that is no key
    env, n = redact("API_KEY=9f8e7d6c5b4a39281706f5e4d3c2b1a0\nCERT=VABNAEcAIABIAFQAVABQAFMAIABJAG4Ac\n",
                    "app.env")
    assert "9f8e7d6c5b4a39281706f5e4d3c2b1a0" not in env and "VABNAEcAIABIAFQAVABQAFMAIABJAG4Ac" in env


def test_prepare_writes_no_secret_into_the_shards(tmp_path, code_corpus, tokenizer_dir, capsys):
    tok = CodeTokenizer.load(tokenizer_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, line in enumerate(PLANTED.values()):
        (corpus / f"config_{i}.py").write_text(f"import os\n\n\n{line}\n\ndef main():\n    return {i}\n")
    out = tmp_path / "data"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--val-fraction", "0"]) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert sum(meta["secrets_replaced"].values()) == len(PLANTED) and "secrets replaced:" in printed
    assert meta["options"]["redact_secrets"] is True
    step = meta["steps"]["secrets replaced"]
    assert (
        step["documents_in"] == step["documents_out"] == len(PLANTED)
        and step["bytes_out"] != step["bytes_in"]
    )
    ids = np.fromfile(out / meta["splits"]["train"]["shards"][0]["file"], dtype=meta["dtype"])
    text = tok.decode(ids.tolist())
    assert "REDACTED_" in text and not any(v in text for v in PLANTED)
    out2 = tmp_path / "data2"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out2),
                 "--val-fraction", "0", "--keep-secrets"]) == 0
    assert "WARNING: --keep-secrets" in capsys.readouterr().err
    meta2 = json.loads((out2 / "meta.json").read_text())
    assert not meta2["secrets_replaced"] and "redact_secrets" not in meta2["options"]
    text2 = tok.decode(np.fromfile(out2 / meta2["splits"]["train"]["shards"][0]["file"],
                                   dtype=meta2["dtype"]).tolist())
    assert "AKIAIOSFODNN7EXAMPLE" in text2


def test_the_planted_set_of_35_kinds_is_replaced():
    """benchmarks/secrets_planted.py's 35 fake credentials, each in its usual kind of file: all replaced."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from secrets_planted import KINDS as PLANTED
    missed, broken = [], []
    for kind, name, text, value in PLANTED:
        out = redact(text, name)[0]
        if value in out or "REDACTED_" not in out:
            missed.append(kind)
        try:  # the file around the value is whole
            compile(out, name, "exec") if name.endswith(".py") else json.loads(out) if name.endswith(
                ".json"
            ) else None
        except (SyntaxError, ValueError):
            broken.append(kind)
    assert not missed and not broken and len(PLANTED) >= 30, (missed, broken)


def test_what_a_hostile_review_found():
    """PEM headers kept as constants are no key (and the code between them stays); a key written as string
    literals or with \\n escapes keeps its quotes; a secret twice on a line goes twice; an escaped quote is
    not cut through; shell exports are config values."""
    consts = ('H = "-----BEGIN PRIVATE KEY-----"\ndef f(x):\n  '
              '  return x + 1\nF = "-----END PRIVATE KEY-----"\n')
    assert redact(consts, "pem.py") == (consts, {})
    concat = ('K = ("-----BEGIN PRIVATE KEY-----\\n"\n     "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n"\n     '
              '"-----END PRIVATE KEY-----\\n")\n')
    out, n = redact(concat, "k.py")
    assert "MIIEvQ" not in out and n["Private Key"] == 1
    compile(out, "k.py", "exec")
    one = ('{"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n-----END '
           'PRIVATE KEY-----\\n"}')
    out, n = redact(one, "sa.json")
    assert "MIIEvQ" not in out and json.loads(out)["private_key"].count("REDACTED_PRIVATE_KEY") == 1
    out, n = redact('a = "AKIAIOSFODNN7EXAMPLE"; b = "AKIAIOSFODNN7EXAMPLE"\n', "x.py")
    assert "AKIA" not in out and n["AWS Access Key"] == 2
    compile(redact('PASSWORD = "abc\\"defghijk"\n', "x.py")[0], "x.py", "exec")
    out, n = redact("export DB_PASSWORD=Xy7pQ2rT9wLm4v\n", "deploy.sh")
    assert "Xy7pQ2rT9wLm4v" not in out
    # 20,000 headers with no footer: each scan is bounded (16 KB), so this returns (the unbounded pattern took
    # minutes: quadratic); nothing is replaced, there is no key
    assert redact("-----BEGIN PRIVATE KEY-----\n" * 20000, "k.txt")[1] == {}


def _benchmark():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import secrets_planted
    return secrets_planted


def test_secrets_in_the_shapes_code_holds_them_and_look_alikes_kept():
    """Every token format in every shape (a call's argument, a keyword argument, a dict entry, a commented-out
    line, a Go struct field, prose, ...), every password where a keyword or a position names it (connect's
    password=, boto3's aws_secret_access_key=, a URL with & ! $, requests' auth tuple, curl -u, a Go struct
    field), PEM keys written six ways: all replaced, the Python files still compile; identifiers, None,
    attributes, hash constants and templates kept (detect-secrets' is_indirect_reference dropped every line
    shaped `x = f(...)`: 125 of 243 before)."""
    bench = _benchmark()
    combos = bench.combinations()
    assert len(combos) >= 200
    missed, broken = [], []
    for shape, kind, name, text, value in combos:
        out = redact(text, name)[0]
        pem = [v for v in (*bench.PEM_BODY, bench.PEM_IV) if v in text]
        values = pem if kind == "private key" else [value]
        if not bench.exactly_replaced(text, out, values):  # the value, and nothing else
            missed.append(f"{shape} / {kind}")
        if name.endswith(".py"):
            try:
                compile(out, name, "exec")
            except SyntaxError:
                broken.append(f"{shape} / {kind}")
    assert not missed and not broken, (missed, broken)
    changed = [text for name, text in bench.KEPT if redact(text, name)[0] != text]
    assert not changed, changed


def test_format_tokens_fire_whatever_the_line_and_keywords_only_on_literals():
    out, n = redact('g = Github("ghp_R4nd0mT0k3nV4lu3f0rT3st1ngPurp0s3sXy")\n', "gh.py")
    assert out == 'g = Github("REDACTED_GITHUB_TOKEN")\n' and n["GitHub Token"] == 1
    out, _ = redact('c = Anthropic(api_key="sk-ant-api03-' + "Ab1" * 30 + '")  # sk-ant\n', "a.py")
    assert "Ab1Ab1" not in out and "REDACTED_ANTHROPIC_API_KEY" in out
    assert "hf_" not in redact("login(token='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')\n", "h.py")[0]
    # a URL password with &, ! and $, up to the last @ before the host
    out, _ = redact('e = create_engine("mysql://root:p@ss&w0rd!$x@db.internal/shop")\n', "orm.py")
    assert out == 'e = create_engine("mysql://root:REDACTED_BASIC_AUTH_CREDENTIALS@db.internal/shop")\n'
    for kept in ('conn = connect(password=os.environ["DB_PASSWORD"])\n',
                 "cfg := Config{Password: p.Password}\n",
                 'CHECKSUM_SHA = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"\n', 'TOKEN_KIND = "Bearer"\n'):
        assert redact(kept, "k.py")[0] == kept, kept


def test_jsonl_records_are_scanned_as_their_code(tmp_path, tokenizer_dir):
    """A JSONL record's code is scanned as code (its language guessed), not as a KEY=value config file:
    `pwd = None` and `self._authkey = authkey` stay (they were replaced, changing the record's AST); a
    record of KEY=value lines is still a config, and a literal secret in code still goes."""
    import ast
    code = ("import os\n\n\nclass Conn:\n    def __init__(self, authkey=None):\n        pwd = None\n"
            "        self._authkey = authkey\n        self.secret = os.urandom(8)\n")
    for where in ("data.jsonl:7", "data.jsonl.gz:7", "data.parquet#3"):
        out, n = redact(code, where)
        assert out == code and not n, (where, out)
        assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(code))
    out, _ = redact(code + '        self.key = connect(password="Xy7pQ2rT9wLm")\n', "data.jsonl:8")
    assert "Xy7pQ2rT9wLm" not in out
    env = "DB_HOST=db.internal\nDB_PASSWORD=Xy7pQ2rT9wLm4v\nDEBUG=false\n"
    assert "Xy7pQ2rT9wLm4v" not in redact(env, "configs.jsonl:2")[0]
    go = 'package main\n\nfunc main() {\n\tpwd := os.Getenv("PWD")\n\tfmt.Println(pwd)\n}\n'
    assert redact(go, "go.jsonl:1")[0] == go
    # through prepare: the record's code reaches the shards as it was, nothing counted as replaced
    rec = tmp_path / "corpus.jsonl"
    rec.write_text("".join(json.dumps({"text": code.replace("Conn", f"Conn{i}")}) + "\n" for i in range(3)))
    out_dir = tmp_path / "data"
    assert main(["prepare", "--input", str(rec), "--tokenizer", str(tokenizer_dir), "--out", str(out_dir),
                 "--val-fraction", "0"]) == 0
    meta = json.loads((out_dir / "meta.json").read_text())
    assert not meta["secrets_replaced"]
    ids = np.fromfile(out_dir / meta["splits"]["train"]["shards"][0]["file"], dtype=meta["dtype"])
    text = CodeTokenizer.load(tokenizer_dir).decode(ids.tolist())
    assert "        pwd = None\n        self._authkey = authkey\n" in text and "REDACTED_" not in text


def test_what_the_third_hostile_review_found():
    """Values on the next line, escaped quotes, f-strings, fallbacks, setters, JSON-escaped code in a record,
    Dockerfiles, Kubernetes env pairs, connection strings, XML, mysql -p, tokens inside URLs and paths, PEM
    with other comment marks or cut off: replaced (benchmarks/secrets_planted.py REVIEWED, less its named
    known misses). A keyword inside a string glued to code (`"?api_key=" + key + "&q=1"`) is no literal: the
    line stays, and compiles. Names and values that only look like secrets (`mask_token="[MASK]"`,
    `passwd = "/etc/passwd"`, `"sha256:..."`, an id beside a token) stay."""
    bench = _benchmark()
    missed = [shape for shape, name, text, value in bench.REVIEWED
              if shape not in bench.KNOWN_MISSES and value in redact(text, name)[0]]
    assert not missed, missed
    assert len(bench.REVIEWED) - len(bench.KNOWN_MISSES) >= 40
    for name, text in bench.KEPT:
        out = redact(text, name)[0]
        assert out == text, (text, out)
        if name.endswith(".py"):
            compile(out, name, "exec")
    # many findings on one long line cost one pass of the line each, not one per finding (quadratic before)
    line = "x = [" + '{"password": "Xk9#mQ2v"}, ' * 3000 + "]\n"
    out, n = redact(line, "a.py")
    assert n["Secret Keyword"] == 3000 and "Xk9#mQ2v" not in out
    compile(out, "a.py", "exec")
