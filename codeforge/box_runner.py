"""The runner: the program the sandbox's Python executes (sandbox.py starts it in the box).

It sets the limits given on its command line (RLIMIT_AS, CPU, NPROC, NOFILE, FSIZE; no core files), moves the
per-run nonce off fd 0 (it stays in the stdin pipe, in no Python object, while the program runs), then runs
the program as __main__. Only if the program's last statement returned does it write the nonce to the report
pipe, followed, when it was given calls (`calls.bin`: each call's arguments, marshalled by
sandbox.encode_calls), by one line: repr() of a list with, per call,

    ["ok", encoded value] | ["error", "Type: message"] | ["not_data", "Type"]

the value encoded as plain data by box_values.ENCODE_CODE, which this text includes. Every function it needs
after the program ran (os.read, os.write, marshal.loads, the encoder, type, repr ...) is bound as a default
argument of _run before the program starts, so a program that replaces them changes nothing the runner does.

Its command line: the program's path, the report pipe's fd, the five limits, then (with calls) the entry
function's name and the path of calls.bin. Exit status 0 after a report, 1 after an exception (its traceback
on stderr), 3 after SystemExit before the end.
"""

from __future__ import annotations

from .box_values import ENCODE_CODE, MAX_VALUE_DEPTH, MAX_VALUE_ITEMS, REPORT_CAP

RUNNER = r"""
import marshal, os, resource, sys
MAX_VALUE_ITEMS, MAX_VALUE_DEPTH, REPORT_CAP = %d, %d, %d
""" % (MAX_VALUE_ITEMS, MAX_VALUE_DEPTH, REPORT_CAP) + ENCODE_CODE + r"""
def _limits(mem, cpu, nproc, nofile, fsize):
    for what, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_NPROC, nproc),
                    (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (v, v))
def _say(text):
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except BaseException:
        pass
def _run(report, _exit=os._exit, _read=os.read, _write=os.write, _dup=os.dup, _dup2=os.dup2,
         _loads=marshal.loads, _encode=encode_value, _type=type, _str=str, _repr=repr, _len=len):
    # os functions bound here, before the program can replace them; the nonce stays in the stdin pipe
    # (moved off fd 0) until the program has returned, so it is in no Python object while the program runs
    held = _dup(0)
    devnull = os.open("/dev/null", os.O_RDONLY)
    _dup2(devnull, 0)
    os.close(devnull)
    _limits(*[int(a) for a in sys.argv[3:8]])
    path = sys.argv[1]
    entry, calls = None, None
    if len(sys.argv) > 9:
        entry = sys.argv[8]
        with open(sys.argv[9], "rb") as f:
            calls = f.read()  # decoded afresh for each call, after the program ran
    with open(path, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [path]
    main = type(sys)("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main
    results = []
    try:
        exec(compile(source, path, "exec"), main.__dict__)
        if entry is not None:
            fn = main.__dict__.get(entry)
            if not callable(fn):
                raise NameError("the program defines no function " + repr(entry))
            for i in range(_len(_loads(calls))):
                args, kwargs = _loads(calls)[i]
                try:
                    value = fn(*args, **kwargs)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as e:
                    try:
                        why = _type(e).__name__ + ": " + _str(e)[:300]
                    except BaseException:
                        why = "an exception that cannot be shown"
                    results.append(["error", why])
                    continue
                try:
                    results.append(["ok", _encode(value)])
                except TypeError:
                    results.append(["not_data", _type(value).__qualname__])
                except (ValueError, RecursionError):
                    results.append(["error", "ValueError: the returned value is too large or too deep"])
    except SystemExit as e:
        try:
            _say(f"sandbox: the program exited (SystemExit({e.code!r})) before its end")
        finally:
            _exit(3)
    except BaseException as e:
        try:
            import traceback
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            sys.stderr.flush()
        finally:
            _exit(1)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    data = _read(held, 64)
    if entry is not None:
        text = _repr(results)
        if _len(text) > REPORT_CAP - 64:
            text = _repr([["error", "ValueError: the return values are larger than %d bytes" % REPORT_CAP]]
                         * _len(results))
        data += (text + "\n").encode("utf-8")
    while data:
        data = data[_write(report, data):]
    _exit(0)
os.set_inheritable(int(sys.argv[2]), False)
_run(int(sys.argv[2]))
"""
