"""models/cpu_linear.py: few-row float32 inference products on the CPU go to numpy's OpenBLAS, and give what
F.linear gives (to float32 rounding); training, many rows and other dtypes stay with PyTorch; a decoding step
runs PyTorch on one thread and OpenBLAS on the pool's count, and puts the count back; the engine's greedy
text and the server's do not depend on which library multiplied."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from codeforge.models import cpu_linear
from codeforge.models.cpu_linear import Linear, decode_threads, linear

pytestmark = pytest.mark.skipif(cpu_linear.backend() != "openblas", reason="numpy has no OpenBLAS here")


@pytest.fixture(autouse=True)
def small_weights_too(monkeypatch):
    """The tests' matrices are small; the size floor has its own test."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)


@pytest.fixture
def decoding():
    """A decoding step's context with a 2-thread pool (the products go to OpenBLAS only inside one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(), decode_threads():
            yield
    finally:
        torch.set_num_threads(before)


def spy(monkeypatch) -> list:
    """Count the products that reach OpenBLAS."""
    calls = []
    np, ctl = cpu_linear._openblas()

    class Spy:
        def __getattr__(self, k):
            return getattr(np, k)

        def matmul(self, a, b, out=None):
            calls.append(a.shape)
            return np.matmul(a, b, out=out)
    monkeypatch.setitem(cpu_linear._state, "blas", (Spy(), ctl))
    return calls


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("bias", [True, False])
def test_few_rows_go_to_openblas_and_equal_torch(monkeypatch, rows, bias):
    calls = spy(monkeypatch)
    torch.manual_seed(0)
    m = Linear(96, 200, bias=bias)
    x = torch.randn(rows, 1, 96)
    with torch.inference_mode():
        m(x)  # outside a decoding step: PyTorch
        assert calls == []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(), decode_threads():
            got = m(x)
    finally:
        torch.set_num_threads(before)
    assert calls == [(rows, 96)]
    want = F.linear(x, m.weight, m.bias)
    assert got.shape == (rows, 1, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_many_rows_and_other_dtypes_stay_with_torch(monkeypatch):
    calls = spy(monkeypatch)
    m = Linear(32, 48)
    x = torch.randn(2, 32, requires_grad=True)
    with decode_threads():
        y = m(x)  # gradients recorded: autograd must see the product
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    with torch.no_grad(), decode_threads():
        m(torch.randn(cpu_linear.MAX_ROWS + 1, 32))  # a prompt's prefill
        m.to(torch.bfloat16)(torch.randn(2, 32, dtype=torch.bfloat16))
        linear(torch.randn(0, 32), m.weight.float(), None)  # nothing to multiply
    torch.set_num_threads(before)
    assert calls == []


def test_small_matrices_stay_with_torch(monkeypatch, decoding):
    calls = spy(monkeypatch)
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1 << 20)
    if True:
        Linear(256, 768)(torch.randn(1, 256))  # 196,608 weights: PyTorch
        Linear(256, 4096)(torch.randn(1, 256))  # 1,048,576: OpenBLAS
    assert calls == [(1, 256)]


def test_decode_threads_runs_torch_on_one_thread_and_puts_the_count_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, ctl = cpu_linear._openblas()
        with decode_threads():
            assert torch.get_num_threads() == 1
            with torch.inference_mode():
                Linear(16, 16)(torch.randn(1, 16))  # inside: OpenBLAS keeps the pool's count
            assert {c.num_threads for c in ctl.lib_controllers} == {2}
            with decode_threads():  # nested: no change
                assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        with decode_threads():  # a one-thread pool: nothing changes, and PyTorch multiplies
            assert torch.get_num_threads() == 1 and not getattr(cpu_linear._local, "decoding", False)
    finally:
        torch.set_num_threads(before)


GEN = ("import sys; from codeforge.cli import main; sys.exit(main(['generate', '--run', {out!r}, '--prompt', "
       "'def ', '--max-new-tokens', '40', '--temperature', '0', '--device', 'cpu']))")
TRAIN = ("import sys; from codeforge.cli import main; "
         "sys.exit(main(['train', '--data', {data!r}, '--out', {out!r}, "
         "'--n-layer', '2', '--n-head', '2', '--n-embd', '64', '--block-size', '64', '--batch-size', '4', "
         "'--max-iters', '30', '--eval-every', '30', '--eval-tokens', '256', '--no-progress', '--device', "
         "'cpu', '--learning-rate', '3e-3', '--warmup-steps', '2']))")


def test_greedy_text_is_the_same_with_either_library(data_dir, tmp_path):
    def run(code, **env):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env})
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout
    out = str(tmp_path / "run")
    run(TRAIN.format(data=str(data_dir), out=out))
    texts = {lib: run(GEN.format(out=out), CODEFORGE_CPU_MATMUL=lib, CODEFORGE_THREADS="2")
             for lib in ("torch", "openblas")}
    assert texts["torch"] == texts["openblas"] and len(texts["torch"]) > len("def ")


def test_a_wrong_setting_is_named(monkeypatch):
    monkeypatch.setitem(cpu_linear._state, "blas", None)
    del cpu_linear._state["blas"]
    monkeypatch.setenv(cpu_linear.MATMUL_ENV, "mkl")
    with pytest.raises(ValueError, match="CODEFORGE_CPU_MATMUL='mkl'.*auto.*openblas.*torch"):
        cpu_linear.backend()
    monkeypatch.setenv(cpu_linear.MATMUL_ENV, "torch")
    assert cpu_linear.backend() == "torch"


def test_decode_threads_with_many_rows_only_for_models_mostly_in_large_matrices(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = torch.nn.Sequential(Linear(8, 8), Linear(8, 8), Linear(40, 40))  # 1,600 of 1,728 large
        tiny = torch.nn.Sequential(Linear(8, 8), Linear(8, 8))  # none large
        assert cpu_linear.openblas_share(small) == pytest.approx(1600 / 1728)
        for model, rows, one in ((small, 8, True), (tiny, 8, False), (tiny, 1, True)):
            with decode_threads(model, rows):
                assert (torch.get_num_threads() == 1) == one, (rows, one)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
