"""Secrets out of the training data: API keys, tokens, private keys, passwords in code and configs,
credentials in connection strings and command lines, found by Yelp's detect-secrets (its plugins) and by
patterns of ours for the shapes it misses, each replaced with a fixed placeholder per kind
(`REDACTED_AWS_ACCESS_KEY`), so the code around it stays whole and a model never learns to complete the value.

- Only lines a cheap pattern marks (a secret-ish word, a long token, a URL with credentials, a token prefix)
  go to detect-secrets: most code has none, and its plugins cost ~0.3 ms a line.
- A format detector (a GitHub, AWS, Stripe, Slack, Anthropic, OpenAI or Hugging Face token: a shape no
  identifier has) fires whatever the line looks like. detect-secrets' own line heuristics are not used: one of
  them (`is_indirect_reference`) drops every line shaped `x = f(...)` or `x = a[...]`, which is where code
  holds its keys (`g = Github("ghp_...")`, `connect(password="...")`).
- A loose finding (a secret-ish name's value, a high-entropy string) is replaced only where the value is a
  string literal (or a config file's value) that could be a secret: not an identifier, `None`, an attribute,
  an environment variable's name, a template, a file name, or a constant whose name says it is a hash.
- A finding is widened to the whole token around it (`ghp` -> the GitHub token it starts), and PEM private
  key blocks are replaced whole, however the code writes them (one string, a list of lines, commented out,
  legacy-encrypted with `Proc-Type`/`DEK-Info` headers).
- A JSONL record is scanned as the code it holds (its language guessed from its text), a config file's
  `KEY=value` lines as config.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
from collections import Counter
from collections.abc import Iterator

from .prescan import Gate, Starts
from .syntax import guess_language

# a PEM private key block: a header, a footer of the same kind at most 16 KB on, and between them a body of
# base64, whitespace, quotes, \n escapes, the commas of a list of lines, comment marks (`# `, `> `, `// `) and
# the `Proc-Type: 4,ENCRYPTED` / `DEK-Info:` headers of a legacy-encrypted key only (so it never runs across
# code: no brackets, no operators); only its base64 runs are replaced, every separator stays
PEM_BEGIN = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?)-----")
PEM_END = re.compile(r"-----END ((?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?)-----")
PEM_BODY = re.compile(r"[A-Za-z0-9+/=\s\"'\\,#>:;*\-]*")
# the body of a key cut off before its footer: lines of base64 (16+ characters), each perhaps commented,
# quoted, comma-separated or ending in a \n escape, right after the header
PEM_CUT = re.compile(r"(?:[ \t]*(?:\\n|\n)[ \t]*(?:[#>;*]|//)?[ \t]*[\"']?[A-Za-z0-9+/]{16,}={0,2}[\"']?,?)+")
PEM_SPAN = 16384
B64_RUN = re.compile(r"(?:(?<=\\n)|(?<![\\A-Za-z0-9+/=]))[A-Za-z0-9+/]{16,}={0,2}")  # after a \n escape too
# where a secret can be: a secret-ish name given a value, credentials in a URL or a command line, a long
# quoted token, or the prefix of a known token format; two scans of the whole text find the lines to hand on.
# The words are matched in the text lowered (MARK_WORDS: a case-sensitive pattern on lowered text is ~4x
# faster than (?i)), the formats as written (MARK_FORMATS), no pattern begins with an assertion (a leading
# \b or lookbehind costs ~0.5 s per 31 MB of the standard library, 2026-11-29), and every repetition is
# bounded, so a hostile line costs linear time (`"token" * 20000` took 27 s unbounded). No alternative
# begins with an assertion either (`p(?<![a-z]p)ass`, not `(?<![a-z])pass`: the same matches, and the engine
# keeps its first-character check, 0.29 -> 0.20 s on 7.3 MB of Go, 2026-11-29)
MARK_WORDS = re.compile(
    r"""(?:secret|token|passw|pwd|p(?<![a-z]p)ass(?![a-z])|api[-_]?key|access[-_]?key|private[-_]?key|auth"""
    r"""|credential|bearer)[\w.\-]{0,64}['"\]>]{0,2}(?:\s[\w.\[\]*]{1,32})?\s{0,16}(?::=|=|:|,)"""
    r"""|(?:pwd|password)\s*=[^;'"\s]{1,256};|sshpass|getconnection\(|\.login\(|basicauth\s*\("""
    r"""|set\w{0,32}(?:passw|secret|token|api_?key|credential)\w{0,32}\s*\("""
    r"""|<[\w:\-]{0,64}(?:passw|secret|token|api[-_]?key)[\w:\-]{0,64}>"""
    r"""|name[=:]\s*["']?[\w.\-]{0,64}(?:passw|secret|token|api[-_]?key|pwd)"""
    r"""|basic\s|bearer\s|accountkey=|hooks\.slack\.com/"""
)
MARK_FORMATS = re.compile(
    r"""://[^\s/@]{0,256}[:@]|['"`][A-Za-z0-9+/=_\-.]{20,}['"`\\]"""
    r"""|A[KS]IA|A(?:GP|ID|RO|IP|NP|NV)A|gh[pousr]_|github_pat_|glpat-|xox[abposre]|[sr]k_live"""
    r"""|AIza|SG\.|eyJ|npm_|pypi-|sk-|hf_[A-Za-z]{30}|api_org_|:AA[A-Za-z0-9_\-]{20}|(?:SK|AC)[0-9a-f]{32}"""
    r"""|-us\d|sq0(?:atp|csp)-|AKC[A-Za-z0-9]{10}|[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\."""
    r"""|\s(?:-u|--user|--password|-p\S)|@(?:tcp|unix)\("""
)
ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


# lines the Hyperscan scans are checked on once compiled (prescan: any answer other than re's, and re answers
# alone), each alone and at the end of a short text (where the hyperscan wheel once missed matches)
PROBES = tuple(p for line in (
    'password = "hunter2x9"', 'g = Github("ghp_' + "a1B2c3D4" * 4 + 'e5F6")', "key = 'AKIAIOSFODNN7EXAMPL3'",
    "https://user:p4ss@example.org/x", 'token: "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"',
    "api_key='0123456789abcdef0123456789abcdef'", "-----BEGIN RSA PRIVATE KEY-----",
    "secret = 'Zm9vYmFyYmF6cXV4'",
    "xoxb-1234567890-abcdefghijklmnopqrst", "stripe = 'sk_live_" + "a1" * 12 + "'", "curl -u admin:s3cret http://x",
    'db_pass: "x9!kq2#v"', "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345", "ip = '8.8.4.4'",
) for p in (line, "x = 1; " + line))


@functools.cache
def _marks() -> Starts:
    """The marking patterns' match starts, found by Hyperscan where it runs (prescan.py: the same starts
    as `finditer`; 2.7 -> 0.2 CPU-s on all of Go's standard library, 2026-11-29)."""
    return Starts([MARK_WORDS, MARK_FORMATS], probes=PROBES)


def _marked_lines(text: str) -> list[int]:
    """The 0-based numbers of the lines MARK_WORDS or MARK_FORMATS marks, in order."""
    low = text.lower()
    if len(low) != len(text):  # a character whose lower case is longer (U+0130): positions must stay
        low = text.translate(ASCII_LOWER)
    words, formats = _marks()([low, text])
    starts = sorted(set(words) | set(formats))
    marks, line, at = [], 0, 0  # line numbers counted once through the text
    for s in starts:
        line += text.count("\n", at, s)
        at = s
        if not marks or marks[-1] != line:
            marks.append(line)
    return marks


# formats detect-secrets 1.5.0 has no plugin for (measured: benchmarks/secrets_planted.py), as (kind, pattern
# whose group 1 is the value); the value is replaced exactly, wherever it stands and whatever the line is
FORMATS = [(kind, re.compile(rx)) for kind, rx in (
    ("GitHub Token", r"\b(github_pat_[A-Za-z0-9_]{60,})"),
    ("Slack Webhook", r"hooks\.slack\.com/services/(T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]{16,})"),
    ("Slack Token", r"\b(xox[abposre](?:\.xox[abposr])?-[A-Za-z0-9\-]{20,})"),
    ("NPM Token", r"\b(npm_[A-Za-z0-9]{36})\b"),
    ("NPM Token", r":_authToken=([A-Za-z0-9\-_.+/=]{20,})"),
    ("Slack Token", r"\b(xapp-\d-[A-Za-z0-9\-]{20,})"),
    ("OpenAI Token", r"\b(sk-[A-Za-z0-9_\-]{16,}T3BlbkFJ[A-Za-z0-9_\-]{16,})"),
    ("Hugging Face Token", r"\b(api_org_[A-Za-z]{34})\b"),
    ("Telegram Bot Token", r"\b(\d{8,10}:AA[A-Za-z0-9_\-]{33})\b"),
    ("Azure Storage Account Key", r"AccountKey=([A-Za-z0-9+/]{40,}={0,2})"),
    ("Bearer Token", r"\bBearer\s+([A-Za-z0-9\-._~+/]{20,}=*)"),
    # Anthropic's keys (sk-ant-api03-..., sk-ant-admin01-...), OpenAI's project, service-account and
    # admin keys and its 48-character legacy ones, Hugging Face's user tokens (hf_ and 34 letters), Google's
    # API keys
    ("Anthropic API Key", r"\b(sk-ant-[A-Za-z0-9_\-]{32,})"),
    ("OpenAI Token", r"\b(sk-(?:proj|svcacct|admin)-[A-Za-z0-9_\-]{32,})"),
    ("OpenAI Token", r"\b(sk-[A-Za-z0-9]{48})\b"),
    ("Hugging Face Token", r"\b(hf_[A-Za-z]{34})\b"),
    ("Google API Key", r"\b(AIza[0-9A-Za-z_\-]{35})(?![0-9A-Za-z_\-])"),
)]
# credentials by position, as (kind, pattern with a group named value): the password of a URL (any characters
# but whitespace, quotes and `/`, up to the last `@` before the host: `&`, `!`, `$`, `@` included), a token
# alone before a URL's `@` (`https://TOKEN@github.com`), a Go DSN's `user:pw@tcp(...)`, `curl -u user:pw`
# and `--user`, `--password`, `mysql -pPW`, `sshpass -p PW`, requests' `auth=("user", "pw")` and Go's
# `SetBasicAuth("user", "pw")`, a header given on a command line (`-H "X-Api-Key: ..."`), an HTTP Basic
# header's base64, a connection string's `Password=...;`, an XML element (`<password>...</password>`)
AUTH_PAIR = (r"(?i:\bauth\s*=\s*\(|BasicAuth\s*\()\s*(['\"])[^'\"\n]{0,256}\1\s*,\s*(['\"])"
             r"(?P<value>[^'\"\s\\]{1,256})\2")
CREDENTIALS = [(kind, re.compile(rx)) for kind, rx in (
    ("Basic Auth Credentials",
     r"\b[A-Za-z][A-Za-z0-9+.\-]{1,20}://[^\s:/@'\"`]{0,256}:(?P<value>[^\s/'\"`]{1,256})@(?=[\w\[(])"),
    ("URL Token", r"\b(?:https?|git)://(?P<value>[A-Za-z0-9_\-]{20,256})@(?=[\w\[(])"),
    ("Basic Auth Credentials", r"['\"`][\w.\-]{1,64}:(?P<value>[^\s/'\"`]{1,256})@(?:tcp|unix)\("),
    ("Basic Auth Credentials", r"\s(?:-u|--user)[\s=]+['\"]?[^\s:'\"]{1,256}:(?P<value>[^\s'\"]{1,256})"),
    ("Secret Keyword", r"\s--password[\s=]+['\"]?(?P<value>[^\s'\"]{1,256})"),
    ("Secret Keyword", r"\bmysql(?:dump|admin)?\b[^\n]{0,256}?\s-p(?P<value>[^\s'\"]{1,256})"),
    ("Secret Keyword", r"\bsshpass\s+-p\s*['\"]?(?P<value>[^\s'\"]{1,256})"),
    ("Basic Auth Credentials", AUTH_PAIR),
    ("Secret Keyword",
     r"(?i)(?:-H|--header)\s+['\"][\w\-]{0,64}(?:api[-_]?key|token|secret)[\w\-]{0,64}\s*:\s*"
     r"(?P<value>[^'\"\s]{1,256})['\"]"),
    ("Basic Auth Credentials", r"\bBasic\s+(?P<value>[A-Za-z0-9+/]{12,256}={0,2})(?![A-Za-z0-9+/=])"),
    ("Secret Keyword", r"(?i)(?:^|[;'\"\s])(?:pwd|password)\s*=\s*(?P<value>[^;'\"\s]{1,256})\s*;"),
    ("Basic Auth Credentials",
     r"\bgetConnection\([^,\n]{1,128},\s*(['\"])[^'\"\n]{0,64}\1\s*,\s*(['\"])(?P<value>[^'\"\s\\]{1,256})\2"),
    ("Basic Auth Credentials", r"\.login\([^,\n]{1,128},\s*(['\"])(?P<value>[^'\"\s\\]{1,256})\1\s*\)"),
    ("Secret Keyword",
     r"(?i)\bname=(['\"])[\w.\-]{0,64}(?:passw(?:or)?d|secret|token|api[-_]?key|pwd)[\w.\-]{0,64}\1\s+"
     r"value=(['\"])(?P<value>[^'\"\s]{1,256})\2"),
    ("Secret Keyword",
     r"(?i)<(?P<tag>[\w:\-]{0,64}(?:password|passwd|secret|token|api[-_]?key)[\w:\-]{0,64})>"
     r"(?P<value>[^<\s]{1,256})</(?P=tag)>"),
)]
SECRET_WORD = (r"(?:passw(?:or)?d|passphrase|pwd|(?<![a-z])pass(?![a-z])|secret|token|api[-_]?key|apikey|"
               r"access[-_]?key|private[-_]?key|auth[-_]?key|credentials?)")
# a secret-ish name given a string literal, in any language: an assignment (with a type, `password: str =`),
# a call's keyword argument, a dict entry or struct field (`"X-Api-Key": "..."`, Go's `Password: "..."`,
# Ruby's `:password => "..."`), a comparison (`token == "..."`), a setter's pair (`setenv("API_TOKEN",
# "...")`); the name may be quoted or indexed, the literal prefixed (`f"..."`, `b'...'`) or, inside a JSON
# string (a notebook in a JSONL record), its quotes escaped (`\"...\"`). Names are bounded (linear time)
KEYWORD = re.compile(
    r"(?i)(?<![\w.\-])(?P<nq>\\?['\"]?)(?P<name>[\w.\-]{0,64}" + SECRET_WORD + r"[\w.\-]{0,64})"
    r"[\\'\"\]]{0,4}\s{0,16}(?::\s{0,16}[\w.\[\]&]{1,64}\s{0,16}|\s[\w.\[\]*]{1,32}\s{0,16}(?==))?"
    r"(?P<op>:=|=>|[!=]==?|=|:|,|\()\s{0,16}(?:\S{1,64}\s{0,4}(?:\|\||\?\?|\bor\b)\s{0,4})?"
    r"(?:(?:str|String(?:::from)?|SecretStr|Secret|bytes)\(\s{0,4})?(?:[rbuf]{1,2}(?=['\"]))?(?P<q>\\?['\"`])(?P<value>(?:[^'\"`\s\\]|\\\S){1,512})(?P=q)")
# a config file's unquoted value under a secret-ish name (`ARG NPM_TOKEN=...`, `api_token: ...`)
CONFIG_KEYWORD = re.compile(
    r"(?i)^\s*(?:export\s+|ENV\s+|ARG\s+)?(?P<name>[\w.\-]{0,64}" + SECRET_WORD + r"[\w.\-]{0,64})\s*[:=]\s*"
    r"(?P<value>[^\s'\"]{1,512})(?:\s+#.*)?\s*$")
# a Kubernetes-style pair of lines: `- name: DB_PASSWORD` then `value: "..."`
NAME_LINE = re.compile(r"(?i)^\s*-?\s*name:\s*['\"]?[\w.\-]{0,64}" + SECRET_WORD + r"[\w.\-]{0,64}['\"]?\s*$")
VALUE_LINE = re.compile(r"^\s*value:\s*(['\"]?)(?P<value>[^'\"\s]{1,512})\1\s*$")
# the secret-ish name a value is given, right before it (the end of the text searched)
NAME_BEFORE = re.compile(
    r"(?i)(?P<name>[\w.\-]{0,64}" + SECRET_WORD + r"[\w.\-]{0,64})[\\'\"\]]{0,4}\s{0,16}"
    r"(?::\s{0,16}[\w.\[\]&]{1,64}\s{0,16}|\s[\w.\[\]*]{1,32}\s{0,16}(?==))?(?::=|=>|[!=]==?|=|:|\()\s{0,16}"
    r"(?:export\s+)?(?:[rbuf]{1,2})?\\?['\"`]?$")
# a call that sets a named value, whose quoted name and value are a pair: `setenv("API_TOKEN", "...")`,
# `props.put("password", "...")`, `os.getenv("TOKEN", "default")`
SETTER = re.compile(r"(?i)(?:set\w{0,32}|put\w{0,32}|add\w{0,32}|getenv|get|update|store\w{0,32}|define)"
                    r"\s*\(\s*$")
# a line that ends where its value begins on the next line (`password=` then `"..."`)
OPEN_END = ("=", ":", "(", ",", "=>", "[", "{")
# names whose value is no secret though they hold a secret word: what a secret is called, where it is kept,
# its hash, a check on it, a collection of them (`PASSWORD_HASH`, `TOKEN_TYPE`, `SECRET_KEY_FILE`,
# `api_key_header`, `TOKEN_URL`, `"key.passwd.pem"`, `password_validator`, `"tokens"`)
NOT_A_SECRET_NAME = re.compile(
    r"(?i)^(?:tokens|secrets|passwords)$|(?:pem|crt|json|ya?ml|txt|ini|cfg|conf|hash|digest|sha\d*|md5|"
    r"checksum|salt|fingerprint|type|name|names|field|header|env|var|url|uri|path|file|dir|prefix|suffix|"
    r"format|fmt|len|length|size|regex|regexp|re|pattern|label|msg|message|prompt|text|title|placeholder|"
    r"error|err|policy|validator|rule|algorithm|alg|method|scheme|param|kind|mode|count|attr|column|col|"
    r"endpoint|cmd|command|id|ttl|expiry|expires|timeout|limit|example|sample|char|chars|sep)s?$")
# values that are no secret: words and names (letters, with digits after a separator: `"Accept"`,
# `"refresh_token"`, `"masterSecret"`, `"X-Api-Key"`, `"utf-8-sig"`), a constant's name (`"APP_SECRET"`,
# `"API_KEY_2"`), a template or variable (`${PW}`, `{{ token }}`, `{password}`, `%(password)s`, `<key>`), a
# placeholder (`***`, `xxxx`, `your-api-key`, `example`, `hf_...`), a file name or path (`secret.pem`,
# `/etc/passwd`), a message (`"Error!"`), a command-line flag (`"-aes256"`), a special token (`"[MASK]"`), a
# hash's name (`"sha256:..."`), code (`(`, `)`, a `+` at an end: the literal's own quotes were not found).
# A password of letters only is missed by this: a keyword's value needs a digit or a sign
NOT_A_SECRET_VALUE = re.compile(
    r"^(?:[A-Za-z]+(?:[_.\-]+[A-Za-z0-9]+)*[.!?:,;]*|[A-Z][A-Z0-9]*(?:[_.\-][A-Z0-9]+)*|--?[a-z][\w\-]*"
    r"|.*\.(?:json|pem|key|crt|cer|p12|pfx|txt|ya?ml|cfg|ini|env|conf|toml))$"
    r"|^[$<%{@:\[#/.+\\]|[+]$|[()]|\{\w*\}|\.\.\.|\u2026|\$\{|%s|%\("
    r"|^(?i:sha\d*|md5|blake2\w*|pbkdf2\w*|bcrypt|argon2\w*|scrypt):"
    r"|(?i:example|placeholder|redacted|your[_\-]|xxxx|\*\*\*|changeme|dummy)")
TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-+/.~]+={0,2}")  # a token, with base64 padding at its end
ENTROPY_KINDS = ("Hex High Entropy String", "Base64 High Entropy String")
# kinds that name no format of their own (a keyword's value, a high-entropy string): replaced only where the
# value is a string literal, or a config file's value, never an identifier
# (`hs.masterSecret = hs.session.masterSecret`), and only where it could be a secret (plausible())
LOOSE_KINDS = ENTROPY_KINDS + ("Secret Keyword",)
NAMED = re.compile(r"(?i)(secret|token|passw|pwd|api_?key|access_?key|private_?key|auth|credential|bearer)"
                   r"\w{0,64}['\"]?\s{0,16}(?::=|=|:)")
CONFIG_EXT = (".env", ".ini", ".cfg", ".conf", ".properties", ".yaml", ".yml", ".toml", ".json", ".txt",
              ".sh", ".bash", ".md", ".rst")
# KEY=value text: config files, and the shell scripts and notes a corpus does read
ENV_LIKE = (".env", ".properties", ".cfg", ".conf", ".sh", ".bash", ".txt", ".md", ".rst")
CONFIG_VALUE = re.compile(r"^\s*(?:export\s+|ENV\s+|ARG\s+)?[\w.\-]+\s*[:=]\s*\S+\s*$")
# a record of a JSONL, parquet or hub dataset (`FILE.jsonl:LINE`, `FILE.parquet#ROW`, `hf:NAME#I`): its name
# says nothing of what it holds, so it is scanned as the code its text is
RECORD = re.compile(r"(?:\.jsonl?(?:\.gz|\.zst)?:\d+|#\d+)$")
CODE_LINE = re.compile(r"^\s*(?:def|class|import|from|func|package|return|if|for|while|var|const|type)\b"
                       r"|[({;]$")
@functools.cache
def _detector():
    """detect-secrets, imported on first use: it pulls in `requests` and every plugin (~0.2 s), which every
    `codeforge --help` would pay, since the corpus options import this module. Returns its settings (its
    plugins, with none of its line heuristics: they are applied below to the loose kinds only; its two file
    filters, an unreadable file and a binary extension, stay as they always do), its line scan, its
    heuristics module, and those of its heuristics that judge a value (a run like `abcdefgh`, a UUID, a
    `${template}`, `$VAR`, no letter at all)."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.filters import heuristic
    from detect_secrets.settings import transient_settings
    settings = {"plugins_used": [{"name": plugin.__name__}
                                 for plugin in get_mapping_from_secret_type_to_class().values()],
                "filters_used": []}
    value_heuristics = (heuristic.is_sequential_string, heuristic.is_potential_uuid,
                        heuristic.is_templated_secret, heuristic.is_prefixed_with_dollar_sign,
                        heuristic.is_not_alphanumeric_string)
    return settings, transient_settings, _line_scan, heuristic, value_heuristics


def _plugin_patterns(plugin) -> list[re.Pattern] | None:
    """The patterns one of which a detect-secrets 1.5.0 plugin's finding on a line always matches inside that
    line, or None where that is not known (the plugin then sees every candidate line): a regex plugin's
    denylist (the JWT one keeps only some of its matches), a high-entropy plugin's quoted-string pattern (its
    entropy is judged after), the keyword plugin's patterns for every kind of file."""
    from detect_secrets.plugins import keyword
    from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector
    from detect_secrets.plugins.high_entropy_strings import HighEntropyStringsPlugin
    from detect_secrets.plugins.jwt import JwtTokenDetector
    cls = type(plugin)
    if (isinstance(plugin, RegexBasedDetector) and cls.analyze_line is BasePlugin.analyze_line
            and (cls.analyze_string is RegexBasedDetector.analyze_string or cls is JwtTokenDetector)):
        return list(plugin.denylist)
    entropy = HighEntropyStringsPlugin
    if (isinstance(plugin, entropy) and cls.analyze_line is entropy.analyze_line
            and cls.analyze_string is entropy.analyze_string):
        return [plugin.regex]
    if cls is keyword.KeywordDetector and cls.analyze_string is keyword.KeywordDetector.analyze_string:
        tables = list(keyword.REGEX_BY_FILETYPE.values()) + [keyword.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP]
        return [rx for table in tables for rx in table]
    return None


_GATES: dict[tuple[type, ...], Gate] = {}  # by the plugins' classes: their patterns are their classes'


def _plugin_gate(plugins: list) -> tuple[Gate, list[int]]:
    """The gate of these plugins (built once for a set of classes) and each plugin's group number in it."""
    kinds = sorted({type(p) for p in plugins}, key=lambda c: (c.__module__, c.__qualname__))
    key = tuple(kinds)
    if key not in _GATES:
        first = {type(p): p for p in plugins}
        _GATES[key] = Gate([_plugin_patterns(first[c]) for c in kinds], probes=PROBES)
    return _GATES[key], [kinds.index(type(p)) for p in plugins]


def warm() -> None:
    """The secrets step's Hyperscan databases compiled now (~0.7 CPU-s: the marking patterns' and the gate of
    detect-secrets' plugins), so that no document waits for them: prepare's fork server compiles them once
    for every worker it forks (data/warm_scans.py), a lone worker on a thread of its own while it reads.
    Touches no detect-secrets setting (its plugins are made from their classes)."""
    _marks().warm()
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    plugins = []
    for cls in get_mapping_from_secret_type_to_class().values():
        try:
            plugins.append(cls())
        except TypeError:  # a plugin that needs settings: its gate is made when a scan has it
            return
    _plugin_gate(plugins)[0].warm()


def _line_scan(lines: list[tuple[int, str]], filename: str) -> Iterator:
    """detect-secrets' own line scan (core.scan._process_line_based_plugins, 1.5.0: the same calls, filters
    and order), with each plugin called only on the lines where one of its patterns may match
    (prescan.Gate: one Hyperscan pass a line): every other call finds nothing. 1.43 -> 0.59 CPU-s on the
    10,000 lines marked in Go's standard library (27 plugins a line, each called through detect-secrets'
    argument injection, against ~1 a line), 2026-11-29."""
    from detect_secrets.core.scan import _is_filtered_out, _scan_line
    from detect_secrets.settings import get_plugins
    from detect_secrets.util.code_snippet import get_code_snippet
    plugins = get_plugins()
    gate, group = _plugin_gate(plugins)
    line_content = [line for _, line in lines]
    for (line_number, line), may in zip(lines, gate([line.rstrip() for _, line in lines])):
        line = line.rstrip()
        code_snippet = get_code_snippet(lines=line_content, line_number=line_number)
        if _is_filtered_out(required_filter_parameters=["line"], filename=filename, line=line,
                            context=code_snippet):
            continue
        for k, plugin in enumerate(plugins):
            if group[k] not in may:
                continue
            for secret in _scan_line(plugin=plugin, filename=filename, line=line, line_number=line_number,
                                     context=code_snippet):
                if not _is_filtered_out(required_filter_parameters=["context"], filename=secret.filename,
                                        secret=secret.secret_value, plugin=plugin, line=line,
                                        context=code_snippet):
                    yield secret


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
# at least three colons and a digit, not a call or a template (`dead::beef()` and `ab::cd<T>` are
# C++ and Rust paths)
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


RULES = "3"  # the version of what is replaced (patterns, widening, PEM): in the data's fingerprint


def placeholder(kind: str) -> str:
    return "REDACTED_" + re.sub(r"[^A-Z0-9]+", "_", kind.upper()).strip("_")


def plausible(value: str, least: int = 6) -> bool:
    """Whether a loose finding's value could be a secret: `least` characters or more, three distinct
    characters, and none of what code holds in a secret's place (NOT_A_SECRET_VALUE, detect-secrets' value
    heuristics)."""
    return (len(value) >= least and len(set(value)) > 2 and not NOT_A_SECRET_VALUE.search(value)
            and not any(h(value) for h in _detector()[4]))


def _scan_name(filename: str, text: str) -> tuple[str, bool]:
    """(the name detect-secrets scans a text under, whether its `KEY=value` lines are config values). A
    KEY=value file (.env, .properties, a shell script, notes) is scanned as the .ini file it is (under its own
    name detect-secrets finds nothing in it); a record of a JSONL or parquet file as its language, unless its
    lines are KEY=value lines."""
    name = filename.lower()
    if RECORD.search(name):
        lines = [ln for ln in text.split("\n", 200)[:200] if ln.strip() and not ln.lstrip().startswith("#")]
        config = bool(lines) and not any(CODE_LINE.search(ln) for ln in lines) and (
            sum(bool(CONFIG_VALUE.match(ln)) for ln in lines) >= 0.8 * len(lines))
        if config:
            return "record.ini", True
        return ("record.go" if guess_language(text) == "go" else "record.py"), False
    base = name.rsplit("/", 1)[-1]
    if (base.startswith((".env", "dockerfile", ".npmrc")) or base in ("credentials", "config")
            or base.endswith(ENV_LIKE + (".dockerfile",))):
        return "config.ini", True
    return filename, name.endswith(CONFIG_EXT)


def _widen(line: str, value: str, loose: bool) -> list[tuple[int, int]]:
    """The spans of the whole tokens `value` begins in `line`, every occurrence. A loose value (a high-entropy
    string) found inside a longer token is a chance match in other data, not a secret; a format's value
    (`ghp_...`, `AKIA...`) counts wherever no letter or digit runs into it (`https://ghp_...@github.com`,
    `/keys/AKIA...`): the odds of a format in a base64 blob's run of letters are what the format's length
    makes them. A value that ends in a backslash is not cut (an escaped quote follows)."""
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
        elif not loose and not line[i - 1].isalnum():  # a format after `/`, `-`, `+`, `.`: to its token's end
            out.append((i, max(TOKEN_CHARS.match(line, i).end(), m.end())))
    return out


@functools.lru_cache(maxsize=64)
def _openers(line: str) -> frozenset[int]:
    """The positions of the quotes (' " `) that begin a string literal on the line, in one pass (a backslash
    escapes inside a string): a quote elsewhere ends one (`"?api_key=" + key + "&q=1"`). Kept for the line's
    next questions: one pass a line, not one per finding."""
    out, quote, i, n = [], "", 0, len(line)
    while i < n:
        c = line[i]
        if quote and c == "\\":
            i += 2
            continue
        if c in "'\"`" and (not quote or c == quote):
            if not quote:
                out.append(i)
            quote = "" if quote else c
        i += 1
    return frozenset(out)


def _literal(line: str, span: tuple[int, int], config: bool) -> bool:
    """Whether the span is a whole string literal (quotes on both sides, the closing one not escaped, the
    opening one not the end of another string), or the value of a config file's line."""
    a, b = span
    if (0 < a and b < len(line) and line[a - 1] in "'\"`" and line[b] == line[a - 1] and line[b - 1] != "\\"
            and a - 1 in _openers(line)):
        return True
    return config and bool(CONFIG_VALUE.match(line)) and line.rstrip().endswith(line[a:b])


def _loose_name(line: str, at: int) -> str:
    """The secret-ish name a loose finding's value is given right before it (`api_key = "...`, `TOKEN=...`,
    `"secret": "...`), or "" when the value stands elsewhere on a line that merely mentions one
    (`JobInfo(id='687f...', token=tok)`)."""
    m = NAME_BEFORE.search(line, max(0, at - 256), at)
    return m.group("name") if m else ""


def _keyword_values(line: str) -> Iterator[tuple[int, int]]:
    """The spans of the string literals a secret-ish name is given on a line (KEYWORD), when they could be
    secrets: a real literal (its opening quote not the end of another string), a name that holds a secret
    (NOT_A_SECRET_NAME), a plausible value; a quoted name's pair only in a setter's call."""
    for m in KEYWORD.finditer(line):
        if m.group("op") == "(" and not m.group("name").rsplit(".", 1)[-1].lower().startswith("set"):
            continue  # `get_password("user1")`: an argument; `setPassword("...")` sets one
        if m.group("op") == ",":
            if not m.group("nq") or not SETTER.search(line, max(0, m.start() - 64), m.start()):
                continue  # `f(token, "text")`, `("tokens", "symbol2label")`: arguments, not a key and value
        if not m.group("q").startswith("\\") and m.start("q") not in _openers(line):
            continue  # the keyword is inside a string: `"?api_key=" + key + "&q=1"`
        if plausible(m.group("value")) and not NOT_A_SECRET_NAME.search(m.group("name")):
            yield m.start("value"), m.end("value")


def _joined(lines: list[str], n: int) -> tuple[str, int, int] | None:
    """(line n and the next joined by a space, where the next line's text starts in it, its indent) when
    line n ends where a value begins (`password=`, `auth=("user",`, `"password":`), else None."""
    head = lines[n].rstrip()
    if n + 1 >= len(lines) or not head.endswith(OPEN_END):
        return None
    nxt = lines[n + 1]
    body = nxt.lstrip()
    return head + " " + body, len(head) + 1, len(nxt) - len(body)


def _pattern_findings(lines: list[str], n: int, config: bool) -> Iterator[tuple[int, int, int, str]]:
    """(line index, start, end, kind) of FORMATS, CREDENTIALS and KEYWORD on line n (CONFIG_KEYWORD in a
    config file), and of a value on the next line that a name or position on line n begins (`password=` then
    `"..."`, `- name: DB_PASSWORD` then `value: ...`)."""
    line = lines[n]
    m = CONFIG_KEYWORD.match(line) if config else None
    if m and plausible(m.group("value")) and not NOT_A_SECRET_NAME.search(m.group("name")):
        yield n, m.start("value"), m.end("value"), "Secret Keyword"
    m = VALUE_LINE.match(lines[n + 1]) if n + 1 < len(lines) and NAME_LINE.match(line) else None
    if m and plausible(m.group("value")):
        yield n + 1, m.start("value"), m.end("value"), "Secret Keyword"
    for kind, rx in FORMATS:
        for m in rx.finditer(line):
            yield n, m.start(1), m.end(1), kind
    for kind, rx in CREDENTIALS:
        for m in rx.finditer(line):
            if plausible(m.group("value"), least=4):
                yield n, m.start("value"), m.end("value"), kind
    for a, b in _keyword_values(line):
        yield n, a, b, "Secret Keyword"
    join = _joined(lines, n)
    if join is None:
        return
    text, cut, indent = join
    spans = [(m.start("value"), m.end("value"), "Basic Auth Credentials")
             for m in re.finditer(AUTH_PAIR, text) if plausible(m.group("value"), least=4)]
    spans += [(a, b, "Secret Keyword") for a, b in _keyword_values(text)]
    for a, b, kind in spans:
        if a >= cut:  # only values the join found on the next line; line n's own are found above
            yield n + 1, a - cut + indent, b - cut + indent, kind


_SCANNING = [0]  # scanning() entered: detect-secrets' settings are codeforge's already


@contextlib.contextmanager
def scanning():
    """detect-secrets' settings (our plugins, no line filters) entered once for the redact() calls made
    inside, instead of once per document with a candidate line (0.14 s on 7.3 MB of Go). For one thread's
    run of documents, as prepare's secrets step makes them."""
    settings, transient_settings, *_ = _detector()
    if _SCANNING[0]:
        yield
        return
    with transient_settings(settings):
        _SCANNING[0] += 1
        try:
            yield
        finally:
            _SCANNING[0] -= 1


def _findings(lines: list[str], candidates: list[tuple[int, str]], scan_as: str,
              config: bool) -> Iterator[tuple[int, int, int, str]]:
    """(line index, start, end, kind) of every secret on the candidate lines."""
    settings, transient_settings, line_scan, heuristic, value_heuristics = _detector()
    with contextlib.nullcontext() if _SCANNING[0] else transient_settings(settings):
        for secret in line_scan(candidates, scan_as):
            i = secret.line_number - 1
            line = lines[i]
            if secret.type == "Private Key":
                continue  # whole blocks are replaced above; a lone header line is no key
            loose = secret.type in LOOSE_KINDS
            if loose and secret.type in ENTROPY_KINDS and not NAMED.search(line):
                continue  # a hash constant or test vector, not a credential
            value = secret.secret_value or ""
            if any(h(value) for h in value_heuristics) or (
                    secret.type == "Basic Auth Credentials" and not plausible(value, least=4)):
                continue  # `://{user}:{password}@`, `${PW}`: a template, not a value
            for a, b in _widen(line, value, loose):
                name = _loose_name(line, a) if loose else ""
                if loose and not (_literal(line, (a, b), config) and plausible(line[a:b])
                                  and name and not NOT_A_SECRET_NAME.search(name)
                                  and not heuristic.is_likely_id_string(line[a:b], line)):
                    continue
                if b - a >= 4:
                    yield i, a, b, secret.type
    for n, _ in candidates:
        yield from _pattern_findings(lines, n - 1, config)


def _private_keys(text: str, found: Counter) -> str:
    """The text with the base64 runs of every PEM private key block replaced. Each header is paired with the
    first footer after it (found once for the whole text, so 1 MB of headers costs one pass, not a 16 KB
    scan per header), of the same kind, at most PEM_SPAN characters on, with a body of PEM_BODY characters
    only (no brackets or operators, so it never runs across code)."""
    footers = [(m.start(), m.end(), m.group(1)) for m in PEM_END.finditer(text)]
    out, at, k = [], 0, 0
    for h in PEM_BEGIN.finditer(text):
        if h.start() < at:
            continue  # inside a block already replaced
        while k < len(footers) and footers[k][0] < h.end():
            k += 1
        if k == len(footers):  # no footer after this header: a key cut off, if base64 lines follow at once
            cut = PEM_CUT.match(text, h.end())
            if cut:
                body, n = B64_RUN.subn(placeholder("Private Key"), cut.group(0))
                found["Private Key"] += 1
                out += [text[at:h.end()], body]
                at = cut.end()
            break
        f0, f1, kind = footers[k]
        if kind != h.group(1) or f0 - h.end() > PEM_SPAN or not PEM_BODY.fullmatch(text, h.end(), f0):
            continue
        body, n = B64_RUN.subn(placeholder("Private Key"), text[h.end():f0])
        if not n:
            continue  # a header and a footer with no key between them (PEM constants in code)
        found["Private Key"] += 1
        out += [text[at:h.end()], body]
        at = f0
    return "".join(out) + text[at:] if out else text


def redact(text: str, filename: str = "file") -> tuple[str, Counter]:
    """(the text with each secret replaced by its kind's placeholder, how many of each kind)."""
    found: Counter = Counter()
    if "PRIVATE KEY" in text:
        text = _private_keys(text, found)
    marks = _marked_lines(text)
    if not marks:
        return text, found
    lines = text.split("\n")
    candidates = [(i + 1, lines[i]) for i in marks]
    scan_as, config = _scan_name(filename, text)
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for i, a, b, kind in _findings(lines, candidates, scan_as, config):
        spans.setdefault(i, []).append((a, b, kind))
    for i, got in spans.items():
        line = lines[i]
        got.sort(key=lambda s: (s[0], -(s[1] - s[0]), s[2] in LOOSE_KINDS))  # a format names its kind
        out, at = [], 0
        for a, b, kind in got:
            if a < at:
                continue  # inside a span already replaced (two detectors on a token: the first kind names it)
            out += [line[at:a], placeholder(kind)]
            found[kind] += 1
            at = b
        lines[i] = "".join(out) + line[at:]
    return "\n".join(lines), found
