#!/usr/bin/env bash
# Issue 58: drive the real llama.vim plugin in vim under tmux against
# `codeforge serve`, with a logging proxy on 8012 (llama.vim's default
# endpoint) forwarding to codeforge on 8013.
# usage: benchmarks/llama_vim_session.sh PLUGIN_DIR RUN_DIR [SCRATCH]
#   PLUGIN_DIR: a llama.vim checkout (autoload/llama.vim, plugin/llama.vim)
#   RUN_DIR:    a codeforge run directory (e.g. /tmp/lat/small)
#   SCRATCH:    scratch folder (default /tmp/vim58)
# Run from the repository root with the venv active.
set -u
PLUGIN=${1:?plugin dir}; RUN=${2:?run dir}; S=${3:-/tmp/vim58}
mkdir -p "$S/pack/x/start/llama.vim"
[ "$PLUGIN" -ef "$S/pack/x/start/llama.vim" ] || cp -r "$PLUGIN/autoload" "$PLUGIN/plugin" "$S/pack/x/start/llama.vim/"
: > "$S/proxy.log"

cat > "$S/proxy.py" <<'PY'
import http.server, json, sys, urllib.request, urllib.error
LOG = open(sys.argv[1], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _do(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        entry = {"method": self.command, "path": self.path}
        try:
            j = json.loads(body) if body else {}
            entry["req_keys"] = sorted(j)
            for k in ("n_predict", "n_indent", "t_max_predict_ms", "t_max_prompt_ms",
                      "samplers", "response_fields", "cache_prompt", "top_k", "top_p"):
                if k in j: entry[k] = j[k]
            entry["n_input_extra"] = len(j.get("input_extra", []))
            entry["input_prefix_tail"] = j.get("input_prefix", "")[-60:]
            entry["prompt"] = j.get("prompt")
        except Exception as e:
            entry["req_err"] = repr(e)
        hdr = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        req = urllib.request.Request("http://127.0.0.1:8013" + self.path, data=body,
                                     headers=hdr, method=self.command)
        try:
            r = urllib.request.urlopen(req, timeout=60); status, data, rh = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, data, rh = e.code, e.read(), e.headers
        entry["status"] = status
        try:
            rj = json.loads(data); entry["resp_keys"] = sorted(rj) if isinstance(rj, dict) else type(rj).__name__
            if isinstance(rj, dict):
                entry["content"] = rj.get("content"); entry["timings"] = rj.get("timings")
                for k in ("tokens_cached", "truncated", "error"):
                    if k in rj: entry[k] = rj[k]
        except Exception:
            entry["resp_raw"] = data[:200].decode("utf-8", "replace")
        LOG.write(json.dumps(entry) + "\n")
        self.send_response(status)
        for k, v in rh.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    do_GET = do_POST = do_OPTIONS = _do
http.server.ThreadingHTTPServer(("127.0.0.1", 8012), H).serve_forever()
PY

cat > "$S/vimrc" <<EOF2
set nocompatible
set packpath=$S
set runtimepath^=$S/pack/x/start/llama.vim
filetype plugin indent on
syntax on
set expandtab shiftwidth=4 softtabstop=4 autoindent
set noswapfile
packloadall
EOF2

cat > "$S/work.py" <<'PY'
import os


def load_config(path):
    """Read a key=value config file into a dict."""
    result = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result


def main():
    cfg = load_config(os.environ.get("CFG", "app.cfg"))
    print(cfg)
PY
cp "$S/work.py" "$S/work.py.orig"

python -m codeforge serve --run "$RUN" --port 8013 > "$S/serve.log" 2>&1 &
SERVE=$!; echo "$SERVE" > "$S/serve.pid"
python "$S/proxy.py" "$S/proxy.log" > "$S/proxy.out" 2>&1 &
PROXY=$!; echo "$PROXY" > "$S/proxy.pid"
cleanup() { tmux kill-session -t v 2>/dev/null; kill "$PROXY" "$SERVE" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
for i in $(seq 120); do curl -sf http://127.0.0.1:8013/health >/dev/null && break; sleep 1; done
echo "health: $(curl -s http://127.0.0.1:8013/health)"

tmux kill-session -t v 2>/dev/null
tmux new-session -d -s v -x 160 -y 50 "vim -N -u $S/vimrc $S/work.py"
sleep 3
# cursor to the 'return result' line (line 14), open a line above it at the
# function-body indent (4 spaces) and type a few characters
tmux send-keys -t v ':14' Enter
sleep 0.5
tmux send-keys -t v 'O' ; sleep 0.3
tmux send-keys -t v 'if not res'
sleep 4
tmux capture-pane -t v -p > "$S/pane_ghost.txt"
echo "=== pane with ghost text ==="; cat "$S/pane_ghost.txt"
tmux send-keys -t v Tab
sleep 1
tmux capture-pane -t v -p > "$S/pane_after_tab.txt"
echo "=== pane after Tab ==="; cat "$S/pane_after_tab.txt"
tmux send-keys -t v Escape; sleep 0.3
tmux send-keys -t v ':w' Enter; sleep 0.5
tmux send-keys -t v ':qa!' Enter; sleep 0.5
echo "=== diff of the file ==="; diff "$S/work.py.orig" "$S/work.py"
echo "=== requests ==="; cat "$S/proxy.log"
