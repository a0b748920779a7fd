"""`codeforge eval --repo` shows its fills (issue 56, items 3 and 4): every case a record of cases.jsonl and a
section of report.html, which headless Chromium shows with the middles highlighted and hostile code as text;
per-file scores, an average over files beside the one over cases, the file that dominates named, and
data-like files (tables, frames) kept from outweighing the code."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from codeforge.cli import main
from codeforge.evaluation.repo import (data_like, fill_cases, parses, repo_cases, repo_files, run_repo_eval,
                                       summarize)
from codeforge.evaluation.report import CASES_FILE, HTML_FILE, REPORT_DIR, dominant, esc, write_report
from test_export import make_run
from test_repo_eval import Stub, py_file, repo, stub  # noqa: F401 (fixtures)

FIELDS = {"file", "line", "kind", "expected", "got", "exact", "edit_similarity", "parses", "with_context",
          "data_like", "prefix_tail", "suffix_head"}

HOSTILE = '</pre><script>alert(1)</script><img src=x onerror="document.title=\'pwned\'">'
# a file whose code holds markup, a comment opener, a terminal escape and a bidi override: all shown as text
HOSTILE_PY = ("import os\n\n\ndef page(title):\n"
              f"    html = {HOSTILE!r}\n"
              "    note = '<!-- not a comment --> \x1b[31m red \u202e txt.exe'\n"
              "    if title:\n        return html + note + title\n    return os.sep\n")

SMALL_PY = ("import os\n\n\ndef load(path):\n    with open(path) as f:\n        return f.read()\n\n\n"
            "def size(path):\n    return os.path.getsize(path)\n")


def spinners(n: int = 60) -> str:
    """A data file: the frames of n spinners, one a line (what dominated a real held-out set)."""
    glyphs = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏◐◓◑◒▁▂▃▄▅▆▇█"
    rows = []
    for i in range(n):
        frames = ", ".join(f'"{glyphs[(i * 7 + k * 3) % len(glyphs)]}"' for k in range(4))
        rows.append(f'    "spin{i}": [{frames}],\n')
    return "SPINNERS = {\n" + "".join(rows) + "}\n"


@pytest.fixture()
def dominated(tmp_path):
    """One data-like file of many lines beside two small code files."""
    root = tmp_path / "dominated"
    root.mkdir()
    (root / "frames.py").write_text(spinners())
    (root / "a.py").write_text(SMALL_PY)
    (root / "b.py").write_text(SMALL_PY.replace("load", "read").replace("size", "stat"))
    return root


def test_every_case_is_a_record_next_to_the_run_and_the_page_beside_it(repo, tmp_path, tokenizer_dir,  # noqa: F811
                                                                      capsys):
    run = make_run(tmp_path / "run", tokenizer_dir)
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "2", "--repo-both"]) == 0
    printed = capsys.readouterr().out
    cases, page = run / REPORT_DIR / CASES_FILE, run / REPORT_DIR / HTML_FILE
    assert f"every case: {cases}; side by side: {page}" in printed
    assert "all (each case)" in printed and "all (each of" in printed and "per file (" in printed
    records = [json.loads(x) for x in cases.read_text().splitlines()]
    # --repo-both: one record per case and pass
    assert len(records) == 12 and sum(r["with_context"] for r in records) == 6
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert isinstance(r["exact"], bool) and isinstance(r["parses"], bool)
        assert 0 <= r["edit_similarity"] <= 1
        text = (repo / r["file"]).read_text()
        assert r["expected"] in text and text.splitlines()[r["line"] - 1] == r["expected"].splitlines()[0]
        assert r["kind"] in ("line", "span", "block") and r["got"].count("\n") <= r["expected"].count("\n")
    rec = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])["repo_eval"]
    assert rec["report"] == {"cases": str(cases), "html": str(page)} and "records" not in rec
    assert set(rec["scores_by_file"]) == {r["file"] for r in records}
    # the scores are the records' means
    lead = [r for r in records if r["with_context"]]
    assert rec["scores"]["all"]["exact_match"] == pytest.approx(sum(r["exact"] for r in lead) / 6)
    assert "<mark class=\"expected\">" in page.read_text()

    # --out FILE leaves the run alone: the cases go beside it; --repo-report DIR anywhere; or nowhere
    out = tmp_path / "scores.json"
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "1", "--out", str(out)]) == 0
    assert len((tmp_path / "scores_report" / CASES_FILE).read_text().splitlines()) == 3
    assert json.loads(out.read_text())["report"]["html"] == str(tmp_path / "scores_report" / HTML_FILE)
    capsys.readouterr()
    there = tmp_path / "elsewhere"
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "1", "--repo-report",
                 str(there), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["report"]["cases"] == str(there / CASES_FILE)
    assert (there / HTML_FILE).exists()
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-cases", "1", "--no-repo-report",
                 "--json"]) == 0
    assert "report" not in json.loads(capsys.readouterr().out)
    (tmp_path / "afile").write_text("x")
    assert main(["eval", "--run", str(run), "--repo", str(repo), "--repo-report",
                 str(tmp_path / "afile")]) == 2
    assert "is a file: give a directory" in capsys.readouterr().err


def test_a_hostile_case_is_escaped_and_written(tmp_path):
    assert "<" not in esc(HOSTILE) and "&lt;/pre&gt;&lt;script&gt;" in esc(HOSTILE)
    assert esc("a\x1bb") == 'a<span class="ctl" title="U+001B">\\x1b</span>b'
    assert "\u202e" not in esc("x\u202ey") and "\\u202e" in esc("x\u202ey")
    assert esc("\ud800") == "\ufffd" and esc("a\r\nb\rc").startswith("a\nb<span")
    # a fill with a lone surrogate (JSON's "\ud800") parses in no language, and raises in none
    assert not parses('package a\n\nfunc f() { x := "\ud800" }\n', "go")
    assert not parses('x = "\ud800"\n', "python")
    files = [("page.py", HOSTILE_PY), ("m0.py", py_file(0))]
    cases = repo_cases(files, 2)
    # a server's fill can hold anything, a lone surrogate included
    records = fill_cases(lambda p, s, extra, n: f"    x = {HOSTILE!r}  # \x1b \ud800\n", cases)
    cases_path, page = write_report(tmp_path / "r", {"repo": "<b>x</b>", "context_files": 4,
                                                     "scores": summarize(records)}, records)
    back = [json.loads(x) for x in cases_path.read_text(encoding="utf-8").splitlines()]
    assert len(back) == len(cases) and all("\ufffd" in r["got"] for r in back)
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text and "<img" not in text and "\x1b" not in text and "<b>x" not in text


CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
needs_browser = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs a headless browser: apt-get install chromium chromium-driver"),
    pytest.mark.skipif(importlib.util.find_spec("selenium") is None,
                       reason="needs selenium: pip install -e '.[dev]'"),
]


@pytest.fixture()
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--lang=en-US"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@needs_browser[0]
@needs_browser[1]
def test_the_report_in_chromium_highlights_the_middles_and_runs_no_script(tmp_path, browser):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    files = [("page.py", HOSTILE_PY)] + [(f"pkg/m{i}.py", py_file(i)) for i in range(3)]
    cases = repo_cases(files, 4)
    want = {(c["prefix"], c["suffix"]): c["middle"] for c in cases}
    # exact on the line cases, hostile markup elsewhere: both kinds of generated middle are on the page
    records = fill_cases(lambda p, s, extra, n: (want[(p, s)] if want[(p, s)].count("\n") == 1
                                                 else f"    x = {HOSTILE!r}\n"), cases)
    result = {"repo": "myrepo", "cases": len(cases), "context_files": 4, "scores": summarize(records),
              "dominant_files": dominant(records)}
    _, page = write_report(tmp_path / "report", result, records)
    browser.get(page.as_uri())
    sections = browser.find_elements(By.CSS_SELECTOR, "section.case")
    assert len(sections) == len(cases)
    assert {s.find_element(By.CSS_SELECTOR, "h3 code").text for s in sections} == {p for p, _ in files}

    def style(el, prop: str) -> str:
        return browser.execute_script(f"return getComputedStyle(arguments[0]).{prop}", el)
    for s in sections:
        expected = s.find_element(By.CSS_SELECTOR, "mark.expected")
        got = s.find_element(By.CSS_SELECTOR, "mark.got")
        context = s.find_element(By.CSS_SELECTOR, ".ctx")
        assert expected.is_displayed() and got.is_displayed() and context.is_displayed()
        plain = style(context, "backgroundColor")
        assert style(expected, "backgroundColor") != plain and style(got, "backgroundColor") != plain
        assert style(context, "color") != style(expected, "color")  # the context dimmed
        if "not exact" in s.find_element(By.CSS_SELECTOR, "h3").text:  # a wrong fill: another colour
            assert style(got, "backgroundColor") != style(expected, "backgroundColor")
    # what the page shows is the text of the middles, as written (a control character as its escape)
    shown = {s.find_element(By.CSS_SELECTOR, "mark.expected").text for s in sections}
    visible = str.maketrans({"\x1b": "\\x1b", "\u202e": "\\u202e"})
    assert shown >= {r["expected"].strip("\n").translate(visible) for r in records if r["kind"] == "line"}
    # the hostile code is text: no script element, no alert, no handler ran, nothing fetched
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "</pre><script>alert(1)</script>" in body and "<!-- not a comment -->" in body
    assert "\\x1b" in body and "\\u202e" in body
    assert browser.find_elements(By.TAG_NAME, "script") == []
    assert browser.find_elements(By.TAG_NAME, "img") == []
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert browser.title == "eval --repo myrepo"
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    browser.save_screenshot(str(tmp_path / "report.png"))


def test_data_like_files_are_found_and_project_code_is_not():
    assert data_like(spinners()) is not None
    go_frames = ("package spin\n\nvar Frames = map[int][]string{\n"
                 + "".join(f'\t{i}: {{"⠋", "⠙", "⠹", "{i}"}},\n' for i in range(40)) + "}\n")
    assert data_like(go_frames) is not None
    table = "TABLE = [\n" + "".join(f"    [{i}, {i * i}, 0x{i:02x}],\n" for i in range(30)) + "]\n"
    assert data_like(table) is not None
    assert data_like(py_file(0)) is None and data_like(SMALL_PY) is None and data_like(spinners(10)) is None
    # prose strings (help texts, messages) are not data: the CLI's parsers are code
    root = Path(__file__).resolve().parent.parent / "codeforge"
    for path in ("cli/run.py", "evaluation/repo.py", "evaluation/report.py", "corpus.py"):
        assert data_like((root / path).read_text()) is None, path


def test_a_dominated_corpus_is_named_and_weighed_by_file(dominated, stub, capsys):  # noqa: F811
    files = repo_files(str(dominated))
    # by default the data file gives no case, and is said to be left out
    assert "frames.py" not in {c["path"] for c in repo_cases(files, 20)}
    Stub.reply = (200, {"content": "    return None\n"})
    r = run_repo_eval(str(dominated), endpoint=stub, n=20)
    assert r["data_like_files"].keys() == {"frames.py"} and r["data_files"] == "left out"
    assert set(r["scores_by_file"]) == {"a.py", "b.py"} and r["dominant_files"] == []

    # scored anyway: it holds most of the cases, so the case average is mostly its
    cases = repo_cases(files, 20, data_files=True)
    assert cases == repo_cases(files, 20, data_files=True)  # reproducible
    share = sum(c["path"] == "frames.py" for c in cases) / len(cases)
    assert share > 0.5 and all(c["data_like"] == (c["path"] == "frames.py") for c in cases)
    # a model that recalls the data file and writes nothing else
    want = {(c["prefix"], c["suffix"]): c for c in cases}
    records = fill_cases(lambda p, s, extra, n: want[(p, s)]["middle"] if want[(p, s)]["data_like"] else "",
                         cases)
    scores = summarize(records)
    assert scores["all"]["exact_match"] == pytest.approx(share)
    assert scores["by_file"]["files"] == 3 and scores["by_file"]["exact_match"] == pytest.approx(1 / 3)
    top = dominant(records)
    assert [d["file"] for d in top] == ["frames.py"] and top[0]["cases_share"] == pytest.approx(share)
    assert top[0]["data_like"] and top[0]["limit"] == 0.5

    r = run_repo_eval(str(dominated), endpoint=stub, n=20, data_files=True)
    assert r["data_files"] == "scored" and set(r["scores_by_file"]) == {"a.py", "b.py", "frames.py"}
    per = r["scores_by_file"]["frames.py"]
    assert per["data_like"] and per["cases"] == sum(c["path"] == "frames.py" for c in cases)
    assert {"cases", "exact_match", "edit_similarity", "syntax_valid"} <= set(per)
    assert r["dominant_files"][0]["file"] == "frames.py"

    # the CLI says so in a line, and the page too
    capsys.readouterr()
    assert main(["eval", "--repo", str(dominated), "--endpoint", stub, "--repo-cases", "20",
                 "--repo-data-files", "--repo-report", str(dominated.parent / "rep")]) == 0
    printed = capsys.readouterr().out
    assert "note: frames.py (data-like) holds" in printed and "the file average does not" in printed
    assert "1 data-like file(s)" in printed and "scored, marked in the report" in printed
    page = (dominated.parent / "rep" / HTML_FILE).read_text()
    assert "frames.py</code></a> holds" in page and page.count('class="data"') > 1
    assert main(["eval", "--repo", str(dominated), "--endpoint", stub, "--no-repo-report"]) == 0
    assert "left out of the cases; --repo-data-files scores them: frames.py" in capsys.readouterr().out
