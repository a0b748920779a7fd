"""Secrets found and missed by `prepare`'s redaction (codeforge/redact.py), and what it replaces that is no
secret. Every value is made up; none is live. Three parts:

1. KINDS: 35 kinds of fake credential, each in the kind of file it is usually found in (Python, Go, YAML,
   .env, JSON, a PEM block), one file each.
2. COMBINATIONS: each token format in each shape code holds a key in (a call's argument, a keyword argument,
   a dict entry, a list, a commented-out line, a Go struct field, a JS object, a shell export, YAML, prose,
   an f-string URL, `os.Setenv`), each password in each shape a keyword or position names it in
   (`connect(password=...)`, `boto3.client(..., aws_secret_access_key=...)`, `create_engine("mysql://u:PW@h")`,
   `auth=("u", PW)`, `Password: "..."`, `curl -u u:PW`, ...), and PEM private keys written six ways; plus
   KEPT, look-alikes that must stay (identifiers, None, attributes, hash constants, templates, names).
3. False positives: every finding in the Python standard library (with and without its tests) and in Go's
   `crypto/` and whole standard library, where installed (`apt-get install golang-src`).

A secret counts as found when its value is gone from the redacted text and the file still says where it was
(a REDACTED_ placeholder).

    python benchmarks/secrets_planted.py            # all three
    python benchmarks/secrets_planted.py --no-fp    # the planted sets only
"""

from __future__ import annotations

import argparse
import re
import sysconfig
import time
from collections import Counter
from pathlib import Path

from codeforge.redact import redact

B64 = "dGhpcyBpcyBub3QgYSByZWFsIGtleSBidXQgaXQgbG9va3MgbGlrZSBvbmUgdG8gYSBzY2FubmVyIG9rYXk="
KINDS = [  # (kind, file name, text, the value that must go)
    ("aws access key", "s3.py", 'AWS_ACCESS_KEY_ID = "AKIAZ7VQ3X2M4N5P6Q7R"\n', "AKIAZ7VQ3X2M4N5P6Q7R"),
    ("aws secret key", "s3.py", 'aws_secret_access_key = "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"\n',
     "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzQ8XgH2kLm"),
    ("github classic token", "ci.py", 'GH = "ghp_R4nd0mT0k3nV4lu3f0rT3st1ngPurp0s3sXy"\n',
     "ghp_R4nd0mT0k3nV4lu3f0rT3st1ngPurp0s3sXy"),
    (
        "github fine-grained token",
        "ci.go",
        'const tok = '
        '"github_pat_11ABCDEFG0123456789abc_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW"\n',
        "github_pat_11ABCDEFG0123456789abc_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW",
    ),
    ("gitlab token", "ci.yml", "gitlab_token: glpat-x9Yz8WvU7tS6rQ5pO4nM\n", "glpat-x9Yz8WvU7tS6rQ5pO4nM"),
    ("slack bot token", "bot.py", 'SLACK = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"\n',
     "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"),
    ("slack webhook", "notify.py",
     'HOOK = "https://hooks.slack.com/services/T01ABCDEF/B01ABCDEF/aBcDeFgHiJkLmNoPqRsTuVwX"\n',
     "aBcDeFgHiJkLmNoPqRsTuVwX"),
    ("stripe secret key", "pay.py", 'stripe.api_key = "sk_live_51H8zQ2KxYvWuTsRqPoNmLkJi"\n',
     "sk_live_51H8zQ2KxYvWuTsRqPoNmLkJi"),
    ("stripe restricted key", "pay.go", 'var key = "rk_live_51H8zQ2KxYvWuTsRqPoNmLkJi"\n',
     "rk_live_51H8zQ2KxYvWuTsRqPoNmLkJi"),
    ("sendgrid key", "mail.py",
     'SENDGRID = "SG.aBcDeFgHiJkLmNoPqRsTuV.aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789abcdEfG"\n',
     "SG.aBcDeFgHiJkLmNoPqRsTuV.aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789abcdEfG"),
    ("twilio api key", "sms.py", 'TWILIO_KEY = "SK0123456789abcdef0123456789abcdef"\n',
     "SK0123456789abcdef0123456789abcdef"),
    ("mailchimp key", "news.py", 'MC = "0123456789abcdef0123456789abcdef-us12"\n',
     "0123456789abcdef0123456789abcdef-us12"),
    ("npm token", ".npmrc.env", "NPM_TOKEN=npm_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789\n",
     "npm_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"),
    (
        "pypi token",
        "publish.py",
        'PYPI = '
        '"pypi-AgEIcHlwaS5vcmcCJGE0ZTk0YjU4LWQ2ZjgtNGZlNy05YjNjLTk2ZWYyNWY4NzA2YgACKlszLCJmZjg5In1dAAIGIjFlIgAABiAhKdL"\n',
        "pypi-AgEIcHlwaS5vcmcCJGE0ZTk0YjU4LWQ2ZjgtNGZlNy05YjNjLTk2ZWYyNWY4NzA2YgACKlszLCJmZjg5In1dAAIGIjFlIgAABiAhKdL",
    ),
    ("openai key", "llm.py", 'OPENAI = "sk-aBcDeFgHiJkLmNoPqRsTT3BlbkFJaBcDeFgHiJkLmNoPqRsT"\n',
     "sk-aBcDeFgHiJkLmNoPqRsTT3BlbkFJaBcDeFgHiJkLmNoPqRsT"),
    ("discord bot token", "bot.go",
     'const discord = "MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs"\n',
     "MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs"),
    ("telegram bot token", "tg.py", 'TG = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq"\n',
     "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq"),
    (
        "jwt",
        "auth_test.py",
        'TOKEN = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.'
        'dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"\n',
        "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ),
    ("azure storage key", "blob.py",
     f'CONN = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={B64};"\n', B64),
    ("square oauth secret", "square.py", 'SQ = "sq0csp-aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789abcdEfG"\n',
     "sq0csp-aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789abcdEfG"),
    ("artifactory token", "build.py", 'ART = "AKCp8jQ7Xy2Zw9Vu6Ts5Rq4Po3Nm2Lk1Jh0Gf9Ed8Cb7"\n',
     "AKCp8jQ7Xy2Zw9Vu6Ts5Rq4Po3Nm2Lk1Jh0Gf9Ed8Cb7"),
    ("ibm cloud iam key", "ibm.py",
     'ibm_cloud_iam_api_key = "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789_abcdEfG"\n',
     "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789_abcdEfG"),
    ("cloudant password", "db.py",
     'cloudant_password = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"\n',
     "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"),
    ("google api key", "maps.js", 'const apiKey = "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY";\n',
     "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY"),
    (
        "rsa private key",
        "key.py",
        '"""\n-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA75Kb0cn3lZb7Ij0X6q5k8b0v1wYH0Y2n\n'
        'Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5d2FsZG8=\n-----END RSA PRIVATE KEY-----\n"""\n',
        "MIIEpAIBAAKCAQEA75Kb0cn3lZb7Ij0X6q5k8b0v1wYH0Y2n",
    ),
    (
        "ec private key",
        "tls.go",
        "var k = `-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIIrYSSNQFaA2Hwf1duRSxKtLYX5CB04fSeQ6\n"
        "-----END EC PRIVATE KEY-----`\n",
        "MHcCAQEEIIrYSSNQFaA2Hwf1duRSxKtLYX5CB04fSeQ6",
    ),
    (
        "openssh private key",
        "deploy_key.txt",
        "-----BEGIN OPENSSH PRIVATE KEY-----\n"
        "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n-----END "
        "OPENSSH PRIVATE KEY-----\n",
        "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW",
    ),
    ("postgres url credentials", "settings.py",
     'DATABASE_URL = "postgres://app:Zq8rT2wPx9@db.internal:5432/app"\n', "Zq8rT2wPx9"),
    ("mysql url credentials", "config.go", 'dsn := "mysql://root:Hj3kL9mQ2v@tcp(127.0.0.1:3306)/shop"\n',
     "Hj3kL9mQ2v"),
    ("yaml password", "deploy.yaml", "database:\n  user: app\n  password: Xy7pQ2rT9wLm\n", "Xy7pQ2rT9wLm"),
    (".env password", ".env", "DB_PASSWORD=Xy7pQ2rT9wLm4v\nDEBUG=false\n", "Xy7pQ2rT9wLm4v"),
    ("json client secret", "oauth.json", '{"client_id": "app", "client_secret": "Gq5vN8xK2mW7pR4tZ9yB"}\n',
     "Gq5vN8xK2mW7pR4tZ9yB"),
    ("go api token constant", "client.go", 'const apiToken = "c8f2a91b7d3e4f5061728394a5b6c7d8"\n',
     "c8f2a91b7d3e4f5061728394a5b6c7d8"),
    ("django secret key", "settings.py", "SECRET_KEY = 'django-insecure-7x#k2m!p9q@w4e$r6t^y8u&i0o'\n",
     "django-insecure-7x#k2m!p9q@w4e$r6t^y8u&i0o"),
    ("bearer header", "api.py",
     'headers = {"Authorization": "Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0ffee"}\n',
     "9f8e7d6c5b4a39281706f5e4d3c2b1a0ffee"),
]


# token formats: a shape no identifier has, so each must go wherever it stands
FORMAT_VALUES = {
    "github classic": "ghp_R4nd0mT0k3nV4lu3f0rT3st1ngPurp0s3sXy",
    "github fine-grained":
        "github_pat_11ABCDEFG0123456789abc_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVW",
    "aws access key id": "AKIAZ7VQ3X2M4N5P6Q7R",
    "stripe live key": "sk_live_51H8zQ2KxYvWuTsRqPoNmLkJi",
    "slack bot token": "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "anthropic key": "sk-ant-api03-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Jh1Gf0Ed" * 3 + "AbCd-EfGhAA",
    "openai project key": "sk-proj-" + "Q1w2E3r4T5y6U7i8O9p0AaSsDdFfGgHh" * 2 + "Jk",
    "openai legacy key": "sk-aBcDeFgHiJkLmNoPqRsTT3BlbkFJaBcDeFgHiJkLmNoPqRsT",
    "hugging face token": "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",
    "gitlab token": "glpat-x9Yz8WvU7tS6rQ5pO4nM",
    "google api key": "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
    "sendgrid key": "SG.aBcDeFgHiJkLmNoPqRsTuV.aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789abcdEfG",
    "npm token": "npm_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
}
FORMAT_SHAPES = {  # shape -> (file name, text with {v} where the value goes)
    "call argument": ("gh.py", 'g = Github("{v}")\n'),
    "keyword argument": ("llm.py", 'client = Client(api_key="{v}", timeout=30)\n'),
    "dict entry, hyphenated key": ("api.py", 'headers = {{"X-Api-Key": "{v}", "Accept": "json"}}\n'),
    "list element": ("keys.py", 'KEYS = ["{v}", other_key]\n'),
    "commented out": ("conf.py", '# client = Client(token="{v}")\nclient = Client(token=load())\n'),
    "subscript assignment": ("env.py", 'os.environ["SERVICE_TOKEN"] = "{v}"\n'),
    "inside a header value": ("req.py", 'r = requests.get(url, headers={{"Authorization": "token {v}"}})\n'),
    "Go call": ("main.go", 'client := api.NewClient("{v}")\n'),
    "Go struct field": ("cfg.go", 'cfg := Config{{Token: "{v}", Retries: 3}}\n'),
    "JS object": ("app.js", "const client = new Client({{ apiKey: '{v}' }});\n"),
    "shell export": ("deploy.sh", "export SERVICE_TOKEN={v}\n"),
    "YAML value": ("ci.yml", "env:\n  SERVICE_TOKEN: {v}\n"),
    "prose": ("NOTES.md", "The key we use in staging is {v} (rotate it monthly).\n"),
    "f-string URL": ("q.py", 'url = f"https://api.example.com/v1/items?key={v}&page={{page}}"\n'),
    "Go Setenv": ("env.go", 'os.Setenv("SERVICE_TOKEN", "{v}")\n'),
}
# passwords and secret keys: no format, so only a keyword or a position says what they are
KEYWORD_VALUES = {
    "password": "Xy7pQ2rT9wLm",
    "password with & ! $": "p4ss&W0rd!x$9",
    "aws secret key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzQ8XgH2kLm",
}
KEYWORD_SHAPES = {
    "connect(password=)": ("db.py", 'conn = psycopg2.connect(host="db", user="app", password="{v}")\n'),
    "boto3.client(aws_secret_access_key=)":
        ("s3.py", 's3 = boto3.client("s3", aws_access_key_id=kid, aws_secret_access_key="{v}")\n'),
    "create_engine URL": ("orm.py", 'engine = create_engine("mysql://root:{v}@db.internal/shop")\n'),
    "amqp URL": ("mq.py", 'BROKER = "amqp://guest:{v}@rabbit:5672/"\n'),
    "requests auth tuple": ("get.py", 'r = requests.get(url, auth=("admin", "{v}"))\n'),
    "Go SetBasicAuth": ("req.go", 'req.SetBasicAuth("admin", "{v}")\n'),
    "Go struct field Password": ("db.go", 'db := DBConfig{{\n\tUser:     "app",\n\tPassword: "{v}",\n}}\n'),
    "curl -u": ("fetch.sh", "curl -s -u admin:{v} https://ci.internal/api/builds\n"),
    "dict entry PASSWORD":
        ("settings.py", 'DATABASES = {{"default": {{"USER": "app", "PASSWORD": "{v}"}}}}\n'),
    "typed assignment": ("cfg.py", 'password: str = "{v}"\n'),
    "Java field": ("Db.java", 'private static final String password = "{v}";\n'),
    "YAML password": ("db.yaml", "db:\n  password: {v}\n"),
    ".env": (".env", "DB_PASSWORD={v}\n"),
    "JS object password": ("db.js", 'const db = connect({{ user: "app", password: "{v}" }});\n'),
    "keyword client_secret=": ("oauth.py", 'flow = OAuth(client_id="app", client_secret="{v}")\n'),
}
URL_SHAPES = ("create_engine URL", "amqp URL", "curl -u")  # a `/` in the value would end the URL
PEM_BODY = ["MIIEpAIBAAKCAQEA75Kb0cn3lZb7Ij0X6q5k8b0v1wYH0Y2n",
            "Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5"]
PEM_IV = "8A7F3C21D9E0B4561F2A3B4C5D6E7F80"
PEM_WAYS = {
    "one string":
        ("k.py", 'KEY = """-----BEGIN RSA PRIVATE KEY-----\n{0}\n{1}\n-----END RSA PRIVATE KEY-----"""\n'),
    'list of lines, "\\n".join':
        ("k.py", 'KEY = "\\n".join([\n    "-----BEGIN RSA PRIVATE KEY-----",\n'
                 '    "{0}",\n    "{1}",\n    "-----END RSA PRIVATE KEY-----",\n])\n'),
    "commented out (# )": ("k.py", "# -----BEGIN RSA PRIVATE KEY-----\n# {0}\n# {1}\n"
                                   "# -----END RSA PRIVATE KEY-----\nKEY = load()\n"),
    "quoted (> )":
        ("README.md", "> -----BEGIN EC PRIVATE KEY-----\n> {0}\n> {1}\n> -----END EC PRIVATE KEY-----\n"),
    "Go comment (// )":
        ("k.go", "// -----BEGIN PRIVATE KEY-----\n// {0}\n// {1}\n// -----END PRIVATE KEY-----\n"),
    "legacy-encrypted": ("id_rsa.txt", "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
                                       "DEK-Info: AES-128-CBC,{2}\n\n{0}\n{1}\n"
                                       "-----END RSA PRIVATE KEY-----\n"),
}


def combinations() -> list[tuple[str, str, str, str, str]]:
    """(shape, value kind, file name, text, the value that must go) for every planted combination."""
    out = []
    for shape, (name, tpl) in FORMAT_SHAPES.items():
        for kind, v in FORMAT_VALUES.items():
            out.append((shape, kind, name, tpl.format(v=v), v))
    for shape, (name, tpl) in KEYWORD_SHAPES.items():
        for kind, v in KEYWORD_VALUES.items():
            if shape in URL_SHAPES and "/" in v:
                continue
            out.append((shape, kind, name, tpl.format(v=v), v))
    for way, (name, tpl) in PEM_WAYS.items():
        out.append((way, "private key", name, tpl.format(*PEM_BODY, PEM_IV), PEM_BODY[0]))
    return out


# shapes a hostile review tried after the first version (2026-11-29), beyond the matrix above: values on the
# next line, escapes and prefixes, fallbacks, setters, JSON-escaped code in records, connection strings, XML,
# Dockerfiles, command lines, formats inside URLs and paths. (name, file, text, the value that must go)
PW, PW2 = "Xk9#mQ2vLp7wRz4t", "s3cr3tP4ss9"
GH = "ghp_aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5"
B = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw"  # a PEM body line
REVIEWED = [
    ("keyword, value on the next line", "a.py",
     f'conn = connect(\n    host="db",\n    password=\n        "{PW}",\n)\n', PW),
    ("dict entry, value on the next line", "a.py", f'cfg = {{\n    "password":\n        "{PW}",\n}}\n', PW),
    ("Go struct field, value on the next line", "a.go",
     f'cfg := Config{{\n\tPassword:\n\t\t"{PW}",\n}}\n', PW),
    ("auth tuple over two lines", "a.py", f'requests.get(u,\n  auth=("user",\n        "{PW}"))\n', PW),
    ("escaped quote in the value", "a.py", 'password = "Xk9\\"mQ2vLp7wRz4t"\n', "mQ2vLp7wRz4t"),
    ("f-string without fields", "a.py", f'password = f"{PW}"\n', PW),
    ("bytes", "a.py", f'password = rb"{PW}"\n', PW),
    ("typed, Final", "a.py", f'password: Final[str] = "{PW}"\n', PW),
    ("walrus", "a.py", f'if (token := "{PW}"):\n    pass\n', PW),
    ("wrapped in str()", "a.py", f'password = str("{PW}")\n', PW),
    ("or fallback", "a.py", f'token = os.environ.get("T") or "{PW}"\n', PW),
    ("JS || fallback", "a.js", f'const token = process.env.TOKEN || "{PW}";\n', PW),
    ("getenv default", "a.py", f'pw = os.getenv("DB_PASSWORD", "{PW}")\n', PW),
    ("setdefault", "a.py", f'os.environ.setdefault("DB_PASSWORD", "{PW}")\n', PW),
    ("DB_PASS", "a.py", f'DB_PASS = "{PW}"\n', PW),
    ("Go typed var", "a.go", f'var apiKey string = "{PW}"\n', PW),
    ("Go header Set", "a.go", f'req.Header.Set("X-Api-Key", "{PW}")\n', PW),
    ("Go DSN", "a.go", f'dsn := "user:{PW2}@tcp(127.0.0.1:3306)/db"\n', PW2),
    ("Java setPassword", "A.java", f'ds.setPassword("{PW}");\n', PW),
    ("Java props.setProperty", "A.java", f'props.setProperty("password", "{PW}");\n', PW),
    ("Java getConnection", "A.java", f'DriverManager.getConnection(url, "root", "{PW}");\n', PW),
    ("smtp login", "a.py", f'smtp.login("me@x.com", "{PW}")\n', PW),
    ("Ruby hash rocket", "a.rb", f'config = {{ :password => "{PW}" }}\n', PW),
    ("PHP array", "a.php", f"$cfg = ['password' => '{PW}'];\n", PW),
    ("PHP define", "a.php", f"define('DB_PASSWORD', '{PW}');\n", PW),
    ("Rust &str const", "a.rs", f'const API_KEY: &str = "{PW}";\n', PW),
    ("Rust String::from", "a.rs", f'let password = String::from("{PW}");\n', PW),
    ("Dockerfile ENV", "Dockerfile", f"ENV DB_PASSWORD={PW}\n", PW),
    ("Dockerfile ARG", "Dockerfile", f"ARG NPM_TOKEN={PW}\n", PW),
    ("Kubernetes env pair", "c.yaml", f'env:\n  - name: DB_PASSWORD\n    value: "{PW}"\n', PW),
    ("AWS credentials file", "credentials",
     "[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYzQWERTZ\n", "wJalrXUtnFEMI"),
    ("mysql -p", "a.sh", f"mysql -u root -p{PW} db\n", PW),
    ("sshpass -p", "a.sh", f'sshpass -p "{PW}" ssh host\n', PW),
    ("curl -H api key", "a.sh", f'curl -H "X-Api-Key: {PW}" https://x\n', PW),
    ("Basic header", "a.py", "h = {'Authorization': 'Basic YWRtaW46WGs5I21RMnZMcDd3'}\n",
     "YWRtaW46WGs5I21RMnZMcDd3"),
    ("C# connection string", "a.cs", f'var cs = "Server=db;User Id=sa;Password={PW};";\n', PW),
    ("XML property", "a.xml", f'<property name="password" value="{PW}"/>\n', PW),
    ("XML element", "a.xml", f"<password>{PW}</password>\n", PW),
    ("token alone before a URL's @", "a.sh", f"git clone https://{GH}@github.com/o/r\n", GH),
    ("x-access-token URL", "a.sh", f"git clone https://x-access-token:{GH}@github.com/o/r\n", GH),
    ("AWS key after a slash", "a.py", 'path = "/keys/AKIAZ7Q3XW2LPK9RTU4M"\n', "AKIAZ7Q3XW2LPK9RTU4M"),
    ("token after a dash", "a.py", f'x = "prefix-{GH}"\n', GH),
    ("JSON-escaped code in a JSONL record", "nb.jsonl:7",
     '{"cells": [{"source": ["openai.api_key = \\"' + PW + '\\"\\n"]}]}\n', PW),
    ("PEM with ; comments", "a.ini",
     f"; -----BEGIN PRIVATE KEY-----\n; {B}\n; -----END PRIVATE KEY-----\n", B),
    ("PEM in a C comment", "a.c",
     f"/*\n * -----BEGIN PRIVATE KEY-----\n * {B}\n * -----END PRIVATE KEY-----\n */\n", B),
    ("PEM cut off before its footer", "k.pem", f"-----BEGIN PRIVATE KEY-----\n{B}\n{B}AAAA\n", B + "AAAA"),
    ("Slack app token", "a.py", "k = 'xapp-1-A0123456789-1234567890123-" + "abcdef0123456789" * 4 + "'\n",
     "xapp-1-A0123456789"),
    # known misses, kept here so the table says so
    ("two literals joined with +", "a.py", 'password = "Xk9#mQ2v" + "Lp7wRz4t"\n', "Lp7wRz4t"),
    ("triple-quoted", "a.py", f'password = """{PW}"""\n', PW),
    ("letters only", "a.py", 'password = "hunterhunterqwerty"\n', "hunterhunterqwerty"),
    ("Ruby %q()", "a.rb", f"config.api_key = %q({PW})\n", PW),
    ("YAML block scalar", "c.yaml", f"password: |\n  {PW}\n", PW),
    ("Dockerfile ENV with a space", "Dockerfile", f"ENV DB_PASSWORD {PW}\n", PW),
    ("Markdown inline code", "README.md", f"Set `API_KEY={PW}` in your env\n", PW),
    ("PEM in HTML with <br>", "a.html",
     f"<pre>-----BEGIN PRIVATE KEY-----<br>{B}<br>-----END PRIVATE KEY-----</pre>\n", B),
]
KNOWN_MISSES = {"two literals joined with +", "triple-quoted", "letters only", "Ruby %q()",
                "YAML block scalar", "Dockerfile ENV with a space", "Markdown inline code",
                "PEM in HTML with <br>"}


def exactly_replaced(text: str, out: str, values: list[str]) -> bool:
    """Whether `out` is `text` with each value (and nothing else) replaced by a REDACTED_ placeholder."""
    pattern = re.escape(text)
    for v in values:
        pattern = pattern.replace(re.escape(v), "REDACTED_[A-Z0-9_]+")
    return all(v not in out for v in values) and re.fullmatch(pattern, out) is not None


# look-alikes that must stay as they are: identifiers, None, attributes, calls, hash constants, templates,
# what a secret is called or where it is kept
KEPT = [
    ("a.py", "password = None\n"),
    ("a.py", "api_key = self.api_key\n"),
    ("a.py", "token = get_token(user)\n"),
    ("a.py", 'secret = os.environ["APP_SECRET"]\n'),
    ("a.py", 'token = os.getenv("GITHUB_TOKEN", "")\n'),
    ("a.py", "conn = psycopg2.connect(host=host, password=password)\n"),
    ("a.py", 'headers = {"X-Api-Key": api_key, "Accept": "application/json"}\n'),
    ("a.py", "r = requests.get(url, auth=(user, password))\n"),
    ("a.py", 'EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"\n'),
    ("a.py", 'PASSWORD_HASH = "5f4dcc3b5aa765d61d8327deb882cf99"\n'),
    ("a.py", 'token_type = "bearer"\n'),
    ("a.py", 'TOKEN_HEADER = "X-Auth-Token"\n'),
    ("a.py", 'TOKEN_URL = "https://oauth2.example.com/token"\n'),
    ("a.py", 'SECRET_KEY_FILE = "secret.pem"\n'),
    ("a.py", 'url = f"postgres://{user}:{password}@{host}/db"\n'),
    ("a.py", 'DB_URL = "postgres://app:${DB_PASSWORD}@db/app"\n'),
    ("a.py", 'parser.add_argument("--password", help="the password to use")\n'),
    ("a.py", 'password: str = ""\n'),
    ("a.py", 'if password == "":\n    raise ValueError("no password")\n'),
    ("a.py", 'grant = {"grant_type": "refresh_token", "refresh_token": refresh_token}\n'),
    ("a.py", 'kwargs["password"] = "%(password)s"\n'),
    ("a.go", "db := DBConfig{Password: cfg.Password, Token: os.Getenv(\"TOKEN\")}\n"),
    ("a.go", 'const tokenHeader = "X-Subject-Token"\n'),
    ("a.sh", "curl -u $USER:$PASSWORD https://ci.internal/api\n"),
    ("a.js", "const client = new Client({ apiKey: process.env.API_KEY });\n"),
    # false positives a hostile review found in site-packages (transformers, jinja2, six, huggingface_hub)
    ("a.py", 'tok = Tokenizer(mask_token="[MASK]", sep_token="[SEP]")\n'),
    ("a.py", 'if token == "#bygroup":\n    pass\n'),
    ("a.py", 'MovedAttribute("HTTPPasswordMgr", "urllib2", "urllib.request")\n'),
    ("a.py", 'login(api_key="hf_...", token="hf_xxx")\n'),
    ("a.py", 'passwd = "/etc/passwd"\n'),
    ("a.py", 'token = "utf-8-sig"\n'),
    ("a.py", 'secret = "sha256:abcd1234"\n'),
    ("a.py", 'password_validator = "min8,max64"\n'),
    ("a.py", "# cached token: `get_token()` may refresh it\n"),
    ("a.py", '_CONTROL_TOKEN_START = "\\U000f0000"\n'),
    ("a.py", "JobInfo(id='687fb701029421ae5549d998', token=tok)\n"),
    ("a.py", 'url = "https://x/?api_key=" + key_2 + "&q=1"\n'),
    ("a.py", "cmd = 'mysql --password=' + pw_1 + ' db'\n"),
    ("a.py", 'print("token:" + str(tok) + "!")\n'),
    ("a.py", 'h = {"Authorization": "token " + access_token_v2}\n'),
]


def planted_rows() -> tuple[list[tuple[str, str, bool]], list[tuple[str, bool]]]:
    """([(shape, value kind, replaced)], [(kept line, unchanged)])"""
    found = []
    for shape, kind, name, text, value in combinations():
        out = redact(text, name)[0]
        # a legacy-encrypted key's IV (DEK-Info) is key material too, and goes with the body
        values = [v for v in (*PEM_BODY, PEM_IV) if v in text] if kind == "private key" else [value]
        found.append((shape, kind, exactly_replaced(text, out, values)))
    kept = [(text, redact(text, name)[0] == text) for name, text in KEPT]
    return found, kept


def false_positives(root: Path, pattern: str,
                    skip_tests: bool = False) -> tuple[int, int, Counter, list, float]:
    """(files read, findings, findings per kind, a few examples, seconds) over the files under root."""
    files = sorted(f for f in root.rglob(pattern) if f.is_file()
                   and "site-packages" not in f.parts
                   and not (skip_tests and ("test" in f.parts or "tests" in f.parts or "testdata" in f.parts
                                            or f.name.endswith("_test.go"))))
    n, kinds, examples, t0 = 0, Counter(), [], time.perf_counter()
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out, got = redact(text, str(f))
        if got:
            n += sum(got.values())
            kinds.update(got)
            if len(examples) < 6:
                line = next(ln for ln in out.splitlines() if "REDACTED_" in ln)
                examples.append(f"{f.relative_to(root)}: {line.strip()[:100]}")
    return len(files), n, kinds, examples, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-fp", action="store_true", help="skip the standard libraries")
    args = ap.parse_args()
    found = 0
    print("## 1. 35 kinds, each in its usual file\n\n| kind | file | found | as |\n| --- | --- | --- | --- |")
    for kind, name, text, value in KINDS:
        out, kinds = redact(text, name)
        ok = value not in out and "REDACTED_" in out
        found += ok
        print(f"| {kind} | {name} | {'yes' if ok else '**missed**'} | {', '.join(kinds) or '-'} |")
    print(f"\n{found} of {len(KINDS)} planted secrets replaced")

    rows, kept = planted_rows()
    print("\n## 2. shape x value\n\n| shape | replaced |\n| --- | ---: |")
    by_shape: dict[str, list[bool]] = {}
    for shape, kind, ok in rows:
        by_shape.setdefault(shape, []).append(ok)
    for shape, oks in by_shape.items():
        print(f"| {shape} | {sum(oks)} of {len(oks)} |")
    missed = [f"{shape} / {kind}" for shape, kind, ok in rows if not ok]
    print(f"\n{sum(ok for *_, ok in rows)} of {len(rows)} planted combinations replaced"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    reviewed = [(shape, value not in redact(text, name)[0]) for shape, name, text, value in REVIEWED]
    missed = [shape for shape, ok in reviewed if not ok]
    print(f"{sum(ok for _, ok in reviewed)} of {len(reviewed)} shapes from the hostile review replaced"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    changed = [text.strip() for text, ok in kept if not ok]
    print(f"{len(kept) - len(changed)} of {len(kept)} look-alikes kept"
          + (f"; changed: {changed}" if changed else ""))
    if args.no_fp:
        return

    print("\n## 3. false positives: every finding in code that holds no secret (or only test ones)\n")
    print("| tree | files | findings | kinds | seconds |\n| --- | ---: | ---: | --- | ---: |")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    trees = [("Python stdlib, tests left out", stdlib, "*.py", True),
             ("Python stdlib with its tests", stdlib, "*.py", False)]
    go_roots = (Path("/usr/lib/go/src"), *sorted(Path("/usr/lib").glob("go-*/src")))
    go = next((p for p in go_roots if p.is_dir()), None)
    if go:
        trees += [("Go crypto/", go / "crypto", "*.go", False),
                  ("Go stdlib, tests left out", go, "*.go", True),
                  ("Go stdlib with its tests", go, "*.go", False)]
    for label, root, pattern, skip in trees:
        files, n, kinds, examples, secs = false_positives(root, pattern, skip)
        kinds_said = ", ".join(f"{k} {v}" for k, v in kinds.most_common())
        print(f"| {label} | {files} | {n} | {kinds_said} | {secs:.1f} |")
        for e in examples:
            print("|   e.g. " + e.replace("|", "\\|") + " | | | | |")
    if not go:
        print("(Go's standard library is not installed: apt-get install golang-src)")


if __name__ == "__main__":
    main()
