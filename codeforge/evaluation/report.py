"""What `codeforge eval --repo` saw, case by case: the scores per kind, per file and over files, which file
dominates them, and the two files a person reads (docs/pipeline.md, "A score on your own code").

  cases.jsonl  one record per case and pass: file, line, kind, expected, got, exact, edit_similarity,
               parses, with_context, data_like, and the lines around the gap (prefix_tail, suffix_head)
  report.html  the same side by side, one section per case under its file: the context dimmed, the
               expected and the generated middle highlighted; self-contained (no network, no script: a
               Content-Security-Policy forbids both), every character of code escaped

The case average weighs each case alike, so a file that gives most of the cases (a table of numbers, the
frames of a spinner: every line a case, each as easy or as hopeless as the next) decides it; the file average
weighs each file alike, and `dominant` names a file that holds more than its share.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

from ..atomic import write_jsonl

KINDS = ("line", "span", "block")
REPORT_DIR = "eval_repo"  # RUN/eval_repo/: where `eval --repo --run RUN` writes the two files by default
CASES_FILE = "cases.jsonl"
HTML_FILE = "report.html"
# A file dominates when it holds more than this share of the cases (or of the expected text) and more than
# half again its even share (1 / files): with 3 files each holds a third, which is no one's fault.
DOMINANT_SHARE = 0.25
CONTEXT_LINES = 8  # lines of prefix and of suffix kept around each gap (the record and the page)
LINE_CHARS = 240  # a context line longer than this is cut on the page (corpus lines run to 1,000)
MIDDLE_CHARS = 4_000  # of an expected or generated middle shown on the page; cases.jsonl has all of it

_SURROGATE = re.compile("[\ud800-\udfff]")


def _lines(text: str) -> list[str]:
    """Lines ending in "\n" (kept), as the cases are cut: no other character breaks a line."""
    return [x for x in re.split(r"(?<=\n)", text) if x]


def clean(text: str) -> str:
    """`text` with lone surrogates (a file name's undecodable bytes, a server's "\\ud800") as U+FFFD, so it
    can be written as UTF-8."""
    return _SURROGATE.sub("\ufffd", text)


def around(prefix: str, suffix: str) -> dict:
    """The lines next to a gap: the last CONTEXT_LINES of the prefix and the first of the suffix, and how
    many lines each leaves out."""
    before, after = _lines(prefix), _lines(suffix)
    tail, head = before[-CONTEXT_LINES:], after[:CONTEXT_LINES]
    return {"prefix_tail": clean("".join(tail)), "suffix_head": clean("".join(head)),
            "lines_above": len(before) - len(tail), "lines_below": len(after) - len(head)}


def _mean(rows: list[dict]) -> dict:
    k = len(rows)
    return {"cases": k, "exact_match": sum(r["exact"] for r in rows) / k,
            "edit_similarity": sum(r["edit_similarity"] for r in rows) / k,
            "syntax_valid": sum(r["parses"] for r in rows) / k}


def by_file(records: list[dict]) -> dict[str, dict]:
    """Cases, exact match, edit similarity and syntax validity of each file (one pass's records), by path."""
    files: dict[str, list[dict]] = {}
    for r in records:
        files.setdefault(r["file"], []).append(r)
    return {p: {**_mean(rows), "data_like": any(r["data_like"] for r in rows)}
            for p, rows in sorted(files.items())}


def summarize(records: list[dict]) -> dict:
    """One pass's scores: per kind, "all" (each case alike) and "by_file" (each file alike: the mean of the
    files' means, which a file of many cases cannot tip)."""
    out: dict = {}
    for kind in KINDS:
        rows = [r for r in records if r["kind"] == kind]
        if rows:
            out[kind] = _mean(rows)
    if records:
        out["all"] = _mean(records)
        files = by_file(records).values()
        out["by_file"] = {"files": len(files), "cases": len(records),
                          **{m: sum(f[m] for f in files) / len(files)
                             for m in ("exact_match", "edit_similarity", "syntax_valid")}}
    return out


def dominant(records: list[dict], share: float = DOMINANT_SHARE) -> list[dict]:
    """The files that hold more than `share` of the cases or of the expected middles' characters, and more
    than 1.5 times their even share; most first."""
    if not records:
        return []
    n, chars = len(records), sum(len(r["expected"]) for r in records) or 1
    files: dict[str, list[dict]] = {}
    for r in records:
        files.setdefault(r["file"], []).append(r)
    limit = max(share, 1.5 / len(files))
    out = []
    for p, rows in files.items():
        cases, text = len(rows) / n, sum(len(r["expected"]) for r in rows) / chars
        if cases > limit or text > limit:
            out.append({"file": p, "cases_share": cases, "text_share": text, "limit": limit,
                        "data_like": any(r["data_like"] for r in rows)})
    return sorted(out, key=lambda d: (-max(d["cases_share"], d["text_share"]), d["file"]))


# -- the files -----------------------------------------------------------------------------------------------

def write_report(out_dir: str | Path, result: dict, records: list[dict]) -> tuple[Path, Path]:
    """cases.jsonl and report.html in out_dir (made if missing), each written aside and renamed into place:
    an interrupted run leaves the previous pair or none, never half a file. Returns their paths."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OSError(
            f"--repo-report {out} is a file: give a directory ({CASES_FILE} and {HTML_FILE} go in it)")
    out.mkdir(parents=True, exist_ok=True)
    cases, page = out / CASES_FILE, out / HTML_FILE
    write_jsonl(cases, records)
    tmp = page.with_name(f".{page.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(render_html(result, records), encoding="utf-8")
        os.replace(tmp, page)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return cases, page


# Shown as a visible escape, never as itself: C0/C1 controls (an ESC, a NUL the parser would turn into
# U+FFFD, a form feed), a carriage return not ending a line (the page would break the line there) and the
# bidirectional overrides that make code read differently from what it is ("trojan source").
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def esc(text: str) -> str:
    """`text` as HTML text: markup characters escaped (so `</pre><script>` or `<!--` is only text), lone
    surrogates as U+FFFD, control and bidi characters as a marked \\xNN / \\uNNNN."""
    text = clean(text).replace("\r\n", "\n")
    parts, last = [], 0
    for m in _CONTROL.finditer(text):
        parts.append(html.escape(text[last:m.start()]))
        c = ord(m.group())
        code = f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
        parts.append(f'<span class="ctl" title="U+{c:04X}">{code}</span>')
        last = m.end()
    parts.append(html.escape(text[last:]))
    return "".join(parts)


def _context_lines(text: str) -> str:
    """Context lines, each cut to LINE_CHARS, escaped and dimmed."""
    out = []
    for line in _lines(text):
        body = line.rstrip("\r\n")
        end = line[len(body):]
        if len(body) > LINE_CHARS:
            out.append(esc(body[:LINE_CHARS]) + f'<span class="cut">… {len(body) - LINE_CHARS:,} more</span>'
                       + esc(end))
        else:
            out.append(esc(line))
    return f'<span class="ctx">{"".join(out)}</span>' if out else ""


def _middle(text: str, cls: str) -> str:
    """A middle highlighted: cut to MIDDLE_CHARS; one that is empty says so (by CSS: no text of its own)."""
    if not text:
        return f'<mark class="{cls} none" title="nothing"></mark>'
    shown = esc(text[:MIDDLE_CHARS])
    if len(text) > MIDDLE_CHARS:
        shown += f'<span class="cut">… {len(text) - MIDDLE_CHARS:,} more characters in {CASES_FILE}</span>'
    return f'<mark class="{cls}">{shown}</mark>'


def _code(r: dict, middle: str, cls: str) -> str:
    above = (f'<span class="cut">… {_n(r["lines_above"], "line")} above</span>\n' if r["lines_above"] else "")
    below = (f'<span class="cut">… {_n(r["lines_below"], "line")} below</span>' if r["lines_below"] else "")
    # the newline right after <pre> is the one the HTML parser drops, so a blank first line stays
    return (f'<pre class="code">\n{above}{_context_lines(r["prefix_tail"])}{_middle(middle, cls)}'
            f'{_context_lines(r["suffix_head"])}{below}</pre>')


def _n(k: int, what: str) -> str:
    return f"{k:,} {what}{'' if k == 1 else 's'}"


def _yes(ok: bool, yes: str, no: str) -> str:
    return f'<span class="{"ok" if ok else "bad"}">{yes if ok else no}</span>'


def _verdict(r: dict) -> str:
    return (f'{_yes(r["exact"], "exact", "not exact")} · edit similarity {r["edit_similarity"]:.3f} · '
            f'{_yes(r["parses"], "parses", "does not parse")}')


def _scores_table(scores: dict) -> str:
    rows = []
    for kind, v in scores.items():
        name = {"all": "all (each case alike)", "by_file": f"all ({v.get('files', 0)} files, each alike)"}
        rows.append(f"<tr><td>{esc(name.get(kind, kind))}</td><td>{v['cases']}</td>"
                    f"<td>{v['exact_match']:.1%}</td><td>{v['edit_similarity']:.3f}</td>"
                    f"<td>{v['syntax_valid']:.1%}</td></tr>")
    return ("<table><tr><th>kind</th><th>cases</th><th>exact</th><th>edit sim</th><th>parses</th></tr>"
            + "".join(rows) + "</table>")


def _anchor(i: int) -> str:
    return f"file-{i}"


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1500px;padding:0 1em;color:#1b1b1b;
background:#fff}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:2em;border-bottom:2px solid #ccc}
table{border-collapse:collapse;margin:.5em 0} td,th{padding:.15em .7em;border-bottom:1px solid #e3e3e3;
text-align:right} td:first-child,th:first-child{text-align:left}
.note{background:#fff4d6;border-left:4px solid #e0a800;padding:.4em .8em;margin:.6em 0}
.case{border:1px solid #d5d5d5;border-radius:6px;margin:1em 0;padding:.4em .9em .8em}
.case h3{font-size:1em;font-weight:normal;margin:.2em 0 .5em} .case h3 code{font-weight:bold}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:.8em}
.cols h4{margin:.2em 0;font-size:.9em;color:#444}
pre.code{white-space:pre-wrap;overflow-wrap:anywhere;font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace;
background:#fafafa;border:1px solid #eee;padding:.5em;margin:0;tab-size:4}
.ctx{color:#9a9a9a}
mark{color:#111;padding:1px 0} mark.expected{background:#c9f0c9} mark.got{background:#ffd9a8}
mark.got.exact{background:#c9f0c9} mark.none::before{content:"(nothing)";font-style:italic;color:#a00}
.ctl{color:#b00000;background:#ffe3e3;border:1px dotted #b00000}
.cut{color:#8a8a8a;font-style:italic}
.ok{color:#0a7a0a} .bad{color:#b00000} .data{color:#8a5a00}
"""


def render_html(result: dict, records: list[dict]) -> str:
    """The page: the scores, the per-file table, then each file's cases side by side. It works without
    JavaScript and fetches nothing: the policy in its head allows inline styles and nothing else."""
    # the pass the scores lead with (with the other files, when sent); --repo-both's second pass beside it
    lead = bool(result.get("context_files"))
    main = [r for r in records if r["with_context"] == lead]
    other = {r["case"]: r for r in records if r["with_context"] != lead}
    files = by_file(main)
    index = {p: i for i, p in enumerate(files)}
    head = (f"{result.get('cases', len(main))} cases from {result.get('held_out_files', len(files))} "
            f"held-out files of {result.get('files', len(files))}; {result.get('backend', '')}; "
            f"{result.get('context_files', 0)} other file(s) as context; seed {result.get('seed', 0)}")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
             "style-src 'unsafe-inline'\">",
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>eval --repo {esc(str(result.get('repo', '')))}</title><style>{_STYLE}</style></head>",
             f"<body><h1>eval --repo <code>{esc(str(result.get('repo', '')))}</code></h1>",
             f"<p>{esc(head)}</p>"]
    both = bool(result.get("scores_without_context"))
    for title, key in (("with context", "scores"), ("without context", "scores_without_context")):
        if result.get(key):
            parts.append(f"<h2>Scores{' ' + title if both else ''}</h2>{_scores_table(result[key])}")
    for d in result.get("dominant_files", []):
        parts.append(f'<p class="note">{_link(d["file"], index)} holds {d["cases_share"]:.0%} of the cases '
                     f'and {d["text_share"]:.0%} of the expected text (more than {d["limit"]:.0%}): the case '
                     f"average leans on it; the average over files weighs each file alike.</p>")
    data = result.get("data_like_files") or {}
    if data:
        what = ("scored, and marked below" if result.get("data_files") == "scored"
                else "left out of the cases (--repo-data-files scores them)")
        parts.append(f'<p class="note">{len(data)} data-like file(s) (mostly literals: tables, lists, '
                     f"frames), {what}: " + ", ".join(f"<code>{esc(p)}</code> ({s:.0%} literal lines)"
                                                     for p, s in data.items()) + "</p>")
    parts.append("<h2>Per file</h2><table><tr><th>file</th><th>cases</th><th>exact</th><th>edit sim</th>"
                 "<th>parses</th></tr>")
    for p, v in files.items():
        flag = ' <span class="data">data-like</span>' if v["data_like"] else ""
        parts.append(f"<tr><td>{_link(p, index)}{flag}</td><td>{v['cases']}</td>"
                     f"<td>{v['exact_match']:.1%}</td><td>{v['edit_similarity']:.3f}</td><td>{v['syntax_valid']:.1%}</td></tr>")
    parts.append("</table><h2>Cases</h2>")
    for p in files:
        v = files[p]
        parts.append(f'<h2 id="{_anchor(index[p])}"><code>{esc(p)}</code></h2><p>{v["cases"]} case(s): exact '
                     f'{v["exact_match"]:.1%}, edit similarity {v["edit_similarity"]:.3f}, '
                     f'{v["syntax_valid"]:.1%} parse</p>')
        for r in sorted((r for r in main if r["file"] == p), key=lambda r: (r["line"], r["case"])):
            parts.append(_case(r, other.get(r["case"])))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _link(path: str, index: dict[str, int]) -> str:
    if path not in index:
        return f"<code>{esc(path)}</code>"
    return f'<a href="#{_anchor(index[path])}"><code>{esc(path)}</code></a>'


def _case(r: dict, alt: dict | None) -> str:
    lines = r["expected"].count("\n") or 1
    data = ' · <span class="data">data-like file</span>' if r["data_like"] else ""
    got = "got exact" if r["exact"] else "got"
    cols = [("expected", _code(r, r["expected"], "expected")),
            (f"generated{' with context' if alt else ''}: {_verdict(r)}", _code(r, r["got"], got))]
    if alt:
        cols.append((f"generated without context: {_verdict(alt)}",
                     _code(alt, alt["got"], "got exact" if alt["exact"] else "got")))
    body = "".join(f"<div><h4>{title}</h4>{code}</div>" for title, code in cols)
    return (f'<section class="case" id="case-{r["case"]}" data-kind="{esc(r["kind"])}">'
            f'<h3><a href="#case-{r["case"]}">#{r["case"]}</a> <code>{esc(r["file"])}</code> '
            f'line {r["line"]} · {esc(r["kind"])} ({_n(lines, "line")}) · '
            f'{_verdict(r)}{data}</h3>'
            f'<div class="cols">{body}</div></section>')
