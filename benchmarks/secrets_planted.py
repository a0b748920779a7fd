"""Secrets found and missed by `prepare`'s redaction (codeforge/redact.py): planted fake credentials of 35
kinds, each in the kind of file it is usually found in (Python, Go, YAML, .env, JSON, a PEM block), one file
each; a secret counts as found when its value is gone from the redacted text and the file still says where it
was (a REDACTED_ placeholder). Every value is made up; none is live.

    python benchmarks/secrets_planted.py
"""

from __future__ import annotations

from codeforge.redact import redact

B64 = "dGhpcyBpcyBub3QgYSByZWFsIGtleSBidXQgaXQgbG9va3MgbGlrZSBvbmUgdG8gYSBzY2FubmVyIG9rYXk="
PLANTED = [  # (kind, file name, text, the value that must go)
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


def main() -> None:
    found = 0
    print("| kind | file | found | as |\n| --- | --- | --- | --- |")
    for kind, name, text, value in PLANTED:
        out, kinds = redact(text, name)
        ok = value not in out and "REDACTED_" in out
        found += ok
        print(f"| {kind} | {name} | {'yes' if ok else '**missed**'} | {', '.join(kinds) or '-'} |")
    print(f"\n{found} of {len(PLANTED)} planted secrets replaced")


if __name__ == "__main__":
    main()
