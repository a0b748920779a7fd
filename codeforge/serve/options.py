"""`codeforge serve`'s options, declared once with `fields.setting`: cli/run.py makes the flags and their
range checks from `ServeOptions`, server.py starts from the object, and the app and the guard read it while
serving. A new option is a field here. No torch, FastAPI or uvicorn is imported, so `codeforge serve --help`
answers at once (the package's __init__ imports lazily for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..evaluation.options import BIG, RunOnDevice
from ..fields import setting

# connections.MAX_DEFAULT_CONNECTIONS, for the help (connections.py imports uvicorn); a test holds them equal
MAX_DEFAULT_CONNECTIONS = 1024
HOUR, DAY = 3600.0, 86_400.0


def split_list(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A flag's comma-separated list as a tuple: "a, b,c" -> ("a", "b", "c"); a tuple stays as it is."""
    if isinstance(value, tuple):
        return value
    return tuple(x.strip() for x in (value or "").split(",") if x.strip())


@dataclass
class ServeOptions(RunOnDevice):
    """How a run is served. Fields with cli=False are what the server learns when it loads the run."""

    host: str = setting("127.0.0.1", metavar="HOST",
                        help="address to listen on (127.0.0.1: this machine only; 0.0.0.0 for "
                             "every interface)")
    port: int = setting(8000, range=(0, 65535), zero_means="a free one", help="TCP port")
    precision: str = setting("auto", choices=("auto", "fp32", "bf16", "fp16"),
                             help="the numbers the model computes in; auto: bf16 on a GPU that has it, fp16 "
                                  "on one that has not, fp32 on the CPU (said on the device line)")
    api_key: str | None = setting(None, metavar="KEY",
                                  help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                       "and / (default: none; the key shows in `ps`: prefer --api-key-file "
                                       "or $CODEFORGE_API_KEY)")
    api_key_file: str | None = setting(None, metavar="PATH",
                                       help="read the API key from this file (one line); the "
                                            "CODEFORGE_API_KEY environment variable is read when neither "
                                            "option is given")
    # the flag takes one comma-separated string; __post_init__ makes it the tuple the guard reads
    allowed_hosts: tuple[str, ...] = setting((), type=str, metavar="HOST,...",
                                             help="Host header names (NAME or NAME:PORT) answered besides "
                                                  "localhost, 127.0.0.1, ::1, --host and the address "
                                                  "connected to, on the server's port; '*' for any (default: "
                                                  "those only, which stops DNS rebinding)")
    allowed_origins: tuple[str, ...] = setting((), type=str, metavar="ORIGIN,...",
                                               help="web pages (scheme://host[:port]) allowed to call the "
                                                    "API from a browser, with CORS; '*' for any (default: "
                                                    "only the server's own playground page)")
    # the slot KV cache holds every row's whole context at once (batcher.SlotCache)
    max_batch: int = setting(8, range=(1, 256), metavar="N", help="rows decoded together")
    max_queue: int = setting(64, range=(1, BIG), metavar="N",
                             help="rows waiting for a batch slot before requests get 429")
    max_prompt_tokens: int = setting(0, range=(1, BIG), zero_means="the model's context minus one",
                                     metavar="N", help="longest prompt accepted")
    max_tokens_cap: int = setting(0, range=(1, BIG), zero_means="the model's context", metavar="N",
                                  help="largest max_tokens accepted")
    infill_batch: int = setting(0, range=(1, BIG), zero_means="half the context", metavar="N",
                                help="/infill keeps what llama-server keeps with -b N (3/4 of N prefix "
                                     "tokens, N/4 suffix, the context less N less twice n_predict of other "
                                     "files), so the two build the same prompt (run llama-server with -c "
                                     "CONTEXT -b N -ub N)")
    infill_predict: int = setting(-1, range=(-1, BIG), metavar="N",
                                  help="/infill leaves other files the context less --infill-batch less 2 x "
                                       "N tokens, as llama-server does with -n N (default -1, llama-server's "
                                       "default; give both the same N, e.g. 16, so a request with long other "
                                       "files still fits the context)")
    request_timeout: float = setting(600.0, range=(0.0, DAY), open_low=True, zero_means="none", metavar="S",
                                     help="seconds from arrival to the last token before a request is "
                                          "stopped with 504")
    # below 1 KiB not even a short chat request fits
    max_body_bytes: int = setting(1 << 20, range=(1024, 1 << 30), metavar="N",
                                  help="largest request body; larger ones get 413")
    # more than 0: a client may not hold a connection for ever
    header_timeout: float = setting(10.0, range=(0.0, HOUR), open_low=True, metavar="S",
                                    help="seconds a connection has to send a request's head before "
                                         "it is closed")
    body_timeout: float = setting(30.0, range=(0.0, DAY), open_low=True, metavar="S",
                                  help="seconds from a request's head to the end of its body before "
                                       "it is closed")
    keep_alive: float = setting(5.0, range=(0.0, HOUR), zero_means="close after each response", metavar="S",
                                help="seconds an idle connection is kept open between requests")
    max_connections: int = setting(0, range=(1, BIG), metavar="N",
                                   zero_means=f"what the file limit, ulimit -n, leaves room for, at most "
                                              f"{MAX_DEFAULT_CONNECTIONS}",
                                   help="open connections at most; a new one over it displaces the one "
                                        "waiting longest on its client")
    model_name: str | None = setting(None, metavar="NAME",
                                     help="the model's id in the API (default: the run directory's name)")
    access_log: bool = setting(False, help="log every request (default: warnings only)")
    threads: int = setting(0, range=(1, 4096), zero_means="the cores other work leaves free at start",
                           metavar="N", help="CPU threads for the model ($CODEFORGE_THREADS does the same)")
    stage: str = setting("pretrain", cli=False, help="the stage that trained the run")
    checkpoint_name: str = setting("", cli=False,
                                   help="the checkpoint's name (step_000100), never its path: "
                                        "/v1/models shows it")
    chat_note: str | None = setting(None, cli=False,
                                    help="a run no chat stage trained: said at start and on "
                                         "every chat answer")
    language: str | None = setting(None, cli=False,
                                   help="the language the run was trained on (the playground's "
                                        "examples follow it)")

    def __post_init__(self) -> None:
        self.allowed_hosts = split_list(self.allowed_hosts)
        self.allowed_origins = split_list(self.allowed_origins)
