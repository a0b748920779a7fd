"""Secrets out of the training data: API keys, tokens, private keys, passwords in configs, credentials in
connection strings, found by Yelp's detect-secrets (its plugins and false-positive filters), each replaced
with a fixed placeholder per kind (`REDACTED_AWS_ACCESS_KEY`), so the code around it stays whole and a model
never learns to complete the value.

- Only lines a cheap pattern marks (a secret-ish word, a long token, a URL with credentials) go to
  detect-secrets: most code has none, and its plugins cost ~0.3 ms a line.
- A high-entropy string alone (hex or base64) is a secret only in an assignment whose name says so (key,
  secret, token, password, ...): hash constants and test vectors in crypto code are not secrets.
- A finding is widened to the whole token around it (`ghp` -> the GitHub token it starts), and PEM private
  key blocks are replaced whole (detect-secrets flags only their first line).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from detect_secrets.core.scan import _process_line_based_plugins  # its own line scan, filters included
from detect_secrets.settings import default_settings

# a PEM private key block: a body of base64, whitespace, quotes and \n escapes only (so it never runs across
# code, and a key written as string literals keeps its quotes), at most 16 KB (so a header without a footer
# costs a bounded scan); only the base64 runs in it are replaced, every separator stays
PEM = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY( BLOCK|)-----([A-Za-z0-9+/=\s\"'\\]{0,16384}?)"
                 r"-----END \1PRIVATE KEY\2-----")
B64_RUN = re.compile(r"(?:(?<=\\n)|(?<![\\A-Za-z0-9+/=]))[A-Za-z0-9+/]{16,}={0,2}")  # after a \n escape too
# where a secret can be: a secret-ish name assigned a value, credentials in a URL, a long quoted token, or the
# prefix of a known token format; one scan of the whole text finds the lines to hand to detect-secrets
PREFILTER = re.compile(
    r"""(?i:(?:secret|token|passw|pwd|api_?key|access_?key|private_?key|auth|credential|bearer)"""
    r"""\w*['"]?\s*(?::=|=|:|,)\s*\S)|://[^\s/@]*:[^\s/@]*@|['"`][A-Za-z0-9+/=_\-.]{20,}['"`]"""
    r"""|\b(?:A[KS]IA|A(?:GP|ID|RO|IP|NP|NV)A|gh[pousr]_|github_pat_|glpat-|xox[abposr]-|[sr]k_live|"""
    r"""AIza|SG\.|eyJ|npm_|pypi-|sk-)|hooks\.slack\.com/|AccountKey=|Bearer\s|\b\d{8,10}:AA"""
    r"""|\b(?:SK|AC)[0-9a-f]{32}\b|[0-9a-f]{32}-us\d|sq0(?:atp|csp)-|AKC[A-Za-z0-9]{10}"""
    r"""|\b[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\."""
)
# formats detect-secrets 1.5.0 has no plugin for (measured: benchmarks/secrets_planted.py), as (kind, pattern
# whose group 1 is the value); the value is replaced exactly, wherever it stands
EXTRA = [(kind, re.compile(rx)) for kind, rx in (
    ("GitHub Token", r"\b(github_pat_[A-Za-z0-9_]{60,})"),
    ("Slack Webhook", r"hooks\.slack\.com/services/(T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]{16,})"),
    ("NPM Token", r"\b(npm_[A-Za-z0-9]{36})\b"),
    ("Telegram Bot Token", r"\b(\d{8,10}:AA[A-Za-z0-9_\-]{33})\b"),
    ("Azure Storage Account Key", r"AccountKey=([A-Za-z0-9+/]{40,}={0,2})"),
    ("Secret Keyword",
     r"""["'](?:client_secret|secret|password|passwd|api_key|apikey|access_token|token)["']\s*:\s*"""
                       r"""["']([^"'\s]{8,})["']"""),
    ("Bearer Token", r"\bBearer\s+([A-Za-z0-9\-._~+/]{20,}=*)"),
)]
NAMED = re.compile(r"(?i)(secret|token|passw|pwd|api_?key|access_?key|private_?key|auth|credential|bearer)"
                   r"\w*['\"]?\s*(?::=|=|:)")
TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-+/.~]+={0,2}")  # a token, with base64 padding at its end
ENTROPY_KINDS = ("Hex High Entropy String", "Base64 High Entropy String")
# kinds that name no format of their own (a keyword's value, a high-entropy string):
# replaced only where the value
# is a string literal, or a config file's value, never an identifier
# (`hs.masterSecret = hs.session.masterSecret`)
LOOSE_KINDS = ENTROPY_KINDS + ("Secret Keyword",)
CONFIG_EXT = (".env", ".ini", ".cfg", ".conf", ".properties", ".yaml", ".yml", ".toml", ".json", ".txt",
              ".sh", ".bash", ".md", ".rst")
# KEY=value text: config files, and the shell scripts, notes and JSONL records a corpus does read
ENV_LIKE = (".env", ".properties", ".cfg", ".conf", ".sh", ".bash", ".txt", ".md", ".rst")
CONFIG_VALUE = re.compile(r"^\s*(?:export\s+)?[\w.\-]+\s*[:=]\s*\S+\s*$")


# personal data, replaced only when asked (`prepare --redact-pii`): e-mail addresses and public IP addresses
EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
    r"([A-Za-z]{2,24})\b(?![(\[.\w])"
)
# the last label of a mail domain: the common generic ones and any two-letter country code, so `x@self.weight`
# (matrix multiplication) is no address
MAIL_TLDS = frozenset("com org net edu gov mil int io dev app ai co info biz me tech cloud email online site "
                      "xyz name pro mobi asia museum".split())
ROLE_ACCOUNTS = frozenset({"git", "noreply", "no-reply", "donotreply", "do-not-reply", "mailer-daemon"})
IPV4 = re.compile(
    r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w.]*\d)"
)
# at least three colons and a digit, not a call or a template (`dead::beef()`,
# `ab::cd<T>` are C++ and Rust paths)
IPV6 = re.compile(r"(?<![\w:])(?=[0-9A-Fa-f:]*\d)(?:[0-9A-Fa-f]{0,4}:){3,7}[0-9A-Fa-f]{0,4}(?![\w:(<])")
EXAMPLE_DOMAINS = re.compile(
    r"(?i)@(?:[\w-]+\.)*(?:example\.(?:com|org|net)|localhost|test|invalid|example)$"
)
# `version = "1.2.3.4"`, `__version__ = ...`, `AssemblyVersion("1.0.0.0")`: a dotted version, no address
VERSION_WORDS = re.compile(r"(?i)(?:version|ver|\bv)_*\s*[=:(]?\s*['\"]?$")


def _public(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False  # `std::vector`, a MAC-like run of colons: not an address
    return ip.is_global and not ip.is_multicast


def redact_pii(text: str) -> tuple[str, Counter]:
    """(the text with e-mail addresses and public IP addresses replaced by REDACTED_EMAIL_ADDRESS and
    REDACTED_IP_ADDRESS, how many of each). Addresses at example domains, private, loopback and reserved
    IP ranges (192.168.0.1, 127.0.0.1, 10.0.0.0/8, documentation ranges) and dotted versions after `version`
    stay: they identify no one, and code uses them as constants."""
    found: Counter = Counter()

    def email(m: re.Match) -> str:
        tld = m.group(1).lower()
        if (EXAMPLE_DOMAINS.search(m.group(0)) or m.group(0).split("@")[0].lower() in ROLE_ACCOUNTS
                or (tld not in MAIL_TLDS and len(tld) != 2)):
            return m.group(0)
        found["Email Address"] += 1
        return placeholder("Email Address")

    def ip(m: re.Match) -> str:
        dotted = "." in m.group(0)
        if not _public(m.group(0)) or (dotted
                                       and VERSION_WORDS.search(text[max(0, m.start() - 24):m.start()])):
            return m.group(0)
        found["IP Address"] += 1
        return placeholder("IP Address")
    if "@" in text:
        text = EMAIL.sub(email, text)
    text = IPV4.sub(ip, text)
    if ":" in text:
        text = IPV6.sub(ip, text)
    return text, found


RULES = "2"  # the version of what is replaced (patterns, widening, PEM): in the data's fingerprint


def placeholder(kind: str) -> str:
    return "REDACTED_" + re.sub(r"[^A-Z0-9]+", "_", kind.upper()).strip("_")


def _widen(line: str, value: str) -> list[tuple[int, int]]:
    """The spans of the whole tokens `value` begins in `line`, every occurrence: a secret begins its token
    (`ghp_...`, `AKIA...`); one found inside a longer token is a chance match in
    other data (`...AIABIAFQ...` in
    a base64 certificate is no AWS key). A value that ends in a backslash is not cut
    (an escaped quote follows)."""
    if not value or value.endswith("\\"):
        return []
    starts = {m.start(): m.end() for m in TOKEN_CHARS.finditer(line)}
    out = []
    for m in re.finditer(re.escape(value), line):
        i = m.start()
        if i in starts:
            out.append((i, max(starts[i], m.end())))
        elif not TOKEN_CHARS.match(line, i):  # a value that starts with other characters: itself
            out.append((i, m.end()))
    return out


def _literal(line: str, span: tuple[int, int], filename: str) -> bool:
    """Whether the span is a whole string literal (quotes on both sides, the closing one not escaped), or the
    value of a config file's line."""
    a, b = span
    if 0 < a and b < len(line) and line[a - 1] in "'\"`" and line[b] == line[a - 1] and line[b - 1] != "\\":
        return True
    name = re.sub(r":\d+$", "", filename.lower())
    return (name.endswith(CONFIG_EXT + (".jsonl",)) and bool(CONFIG_VALUE.match(line))
            and line.rstrip().endswith(line[a:b]))


def redact(text: str, filename: str = "file") -> tuple[str, Counter]:
    """(the text with each secret replaced by its kind's placeholder, how many of each kind)."""
    found: Counter = Counter()

    def pem(m: re.Match) -> str:
        body, n = B64_RUN.subn(placeholder("Private Key"), m.group(3))
        if not n:
            return m.group(0)  # a header and a footer with no key between them (PEM constants in code)
        found["Private Key"] += 1
        return m.group(0)[:m.start(3) - m.start()] + body + m.group(0)[m.end(3) - m.start():]
    if "PRIVATE KEY" in text:
        text = PEM.sub(pem, text)
    marks, line, at = set(), 0, 0  # the 0-based numbers of lines with a mark, counted once through the text
    for m in PREFILTER.finditer(text):
        line += text.count("\n", at, m.start())
        at = m.start()
        marks.add(line)
    if not marks:
        return text, found
    lines = text.split("\n")
    candidates = [(i + 1, lines[i]) for i in sorted(marks)]
    spans: dict[int, list[tuple[int, int, str]]] = {}
    # detect-secrets reads KEY=value files by their extension: .env and the like are scanned as the .ini
    # files they are (under their own name it finds nothing in them)
    base = re.sub(r":\d+$", "", filename.rsplit("/", 1)[-1].lower())  # a JSONL record's name is FILE:LINE
    scan_as = "config.ini" if base.startswith(".env") or base.endswith(ENV_LIKE + (".jsonl",)) else filename
    with default_settings():
        for secret in _process_line_based_plugins(candidates, scan_as):
            line = lines[secret.line_number - 1]
            if secret.type in ENTROPY_KINDS and not NAMED.search(line):
                continue  # a hash constant or test vector, not a credential
            if secret.type == "Private Key":
                continue  # whole blocks are replaced above; a lone header line is no key
            for span in _widen(line, secret.secret_value or ""):
                if secret.type in LOOSE_KINDS and not _literal(line, span, filename):
                    continue
                if span[1] - span[0] >= 4:
                    spans.setdefault(secret.line_number - 1, []).append((*span, secret.type))
    for n, line in candidates:
        for kind, rx in EXTRA:
            for m in rx.finditer(line):
                spans.setdefault(n - 1, []).append((m.start(1), m.end(1), kind))
    for i, got in spans.items():
        line = lines[i]
        got.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        out, at = [], 0
        for a, b, kind in got:
            if a < at:
                continue  # inside a span already replaced (two plugins on one token: the first kind names it)
            out += [line[at:a], placeholder(kind)]
            found[kind] += 1
            at = b
        lines[i] = "".join(out) + line[at:]
    return "\n".join(lines), found
