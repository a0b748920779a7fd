"""`codeforge import --adapter` against hostile adapters (issue 55, item 7): a rank that does not match the
tensors is refused before anything is allocated (r = 50,000,000 asked for 12.8 GB), so are a non-finite
lora_alpha and non-finite weights; unreadable safetensors, JSON and LoRA settings are ExportErrors naming
the file, the field and the fix; an adapter with no readable record of its base is refused, not merged
unchecked."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from codeforge.checkpoint import find_checkpoint, load_model, weights_sha256
from codeforge.cli import main
from codeforge.export import ExportError
from codeforge.export.adapter import RECORD, import_adapter
from codeforge.models import lora
from test_export import make_run

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    return make_run(tmp_path_factory.mktemp("adapter") / "base", tokenizer_dir)


def write_adapter(d, base, rank: int = 4, alpha=8.0, record: bool = True):
    """An adapter directory as `export --format adapter` writes it, for `base`'s weights (random B)."""
    ck = find_checkpoint(base, "auto")
    model, _, _, cfg = load_model(ck, torch.device("cpu"))
    lora.attach(model, rank, 8.0)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    d.mkdir(parents=True, exist_ok=True)
    save_file(lora.adapter_state(model), str(d / lora.ADAPTER_FILE))
    conf = json.loads(lora.adapter_json(model))
    conf["lora_alpha"] = alpha
    (d / lora.ADAPTER_CONFIG).write_text(json.dumps(conf))
    if record:
        (d / RECORD).write_text(json.dumps({"base": {"checkpoint": str(ck), "sha256": weights_sha256(ck)},
                                            "model": cfg["model"], "from": "test"}))
    return d


def edit_config(d, **fields):
    conf = json.loads((d / lora.ADAPTER_CONFIG).read_text())
    conf.update(fields)
    # allow_nan: json writes NaN and Infinity, as a careless or hostile writer would
    (d / lora.ADAPTER_CONFIG).write_text(json.dumps(conf))


def test_a_sound_adapter_still_comes_in(base, tmp_path):
    r = import_adapter(write_adapter(tmp_path / "a", base), base, tmp_path / "m")
    assert r["rank"] == 4 and (tmp_path / "m").is_dir()


def test_a_rank_the_tensors_do_not_have_is_refused_before_allocating(base, tmp_path, monkeypatch):
    d = write_adapter(tmp_path / "a", base)
    edit_config(d, r=50_000_000)
    real = lora.attach

    def attach(model, rank, *a, **k):  # the old way: adapters of rank r made, then found not to fit
        assert rank < 1000, f"rank {rank} adapters allocated"
        return real(model, rank, *a, **k)
    monkeypatch.setattr(lora, "attach", attach)
    with pytest.raises(ExportError, match=r"adapter_config\.json: r = 50000000.*lora_A.*rank 4"):
        import_adapter(d, base, tmp_path / "m")
    for bad in (0, -3, 2.5, True, "4", None):
        edit_config(d, r=bad)
        with pytest.raises(ExportError, match=r"adapter_config\.json: r "):
            import_adapter(d, base, tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, "8", None, 1e308])
def test_a_lora_alpha_that_is_not_a_finite_number_is_refused(base, tmp_path, alpha):
    d = write_adapter(tmp_path / "a", base)
    edit_config(d, lora_alpha=alpha)
    # 1e308 is finite, but scales the adapters past what a float holds: the merged weights say so
    match = "not finite" if alpha == 1e308 else r"adapter_config\.json: lora_alpha"
    with pytest.raises(ExportError, match=match):
        import_adapter(d, base, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_non_finite_or_unreadable_weights_are_refused_by_name(base, tmp_path):
    d = write_adapter(tmp_path / "a", base)
    from safetensors.torch import load_file
    tensors = load_file(str(d / lora.ADAPTER_FILE))
    name = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[name][0, 0] = math.nan
    save_file(tensors, str(d / lora.ADAPTER_FILE))
    with pytest.raises(ExportError, match=f"adapter_model.safetensors: {name} holds values that are not "
                                          f"finite"):
        import_adapter(d, base, tmp_path / "m")
    (d / lora.ADAPTER_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    with pytest.raises(ExportError, match=r"adapter_model\.safetensors: not readable safetensors"):
        import_adapter(d, base, tmp_path / "m")
    (d / lora.ADAPTER_FILE).write_bytes(b"junk")
    with pytest.raises(ExportError, match=r"adapter_model\.safetensors: not readable safetensors"):
        import_adapter(d, base, tmp_path / "m")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int32"])
def test_weights_of_a_type_codeforge_does_not_merge_are_refused_by_name(base, tmp_path, dtype):
    """Only float16, bfloat16, float32 and float64 tensors come in: a float8_e4m3fn one (safetensors'
    F8_E4M3) crashed the finiteness check with NotImplementedError ("isfinite" is not implemented for it)
    instead of being refused; float8_e5m2 went through to the merge."""
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    d = write_adapter(tmp_path / "a", base)
    from safetensors.torch import load_file
    tensors = load_file(str(d / lora.ADAPTER_FILE))
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name] = tensors[name].to(getattr(torch, dtype))
    save_file(tensors, str(d / lora.ADAPTER_FILE))
    floats = r"torch\.float16, torch\.bfloat16, torch\.float32, torch\.float64"
    match = rf"adapter_model\.safetensors: {name} is torch\.{dtype}, not one of {floats}"
    with pytest.raises(ExportError, match=match):
        import_adapter(d, base, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_unreadable_settings_name_the_file_and_field(base, tmp_path, capsys):
    d = write_adapter(tmp_path / "a", base)
    good = (d / lora.ADAPTER_CONFIG).read_text()
    (d / lora.ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(ExportError, match=r"adapter_config\.json: not readable JSON"):
        import_adapter(d, base, tmp_path / "m")
    (d / lora.ADAPTER_CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ExportError, match=r"adapter_config\.json: not readable JSON"):
        import_adapter(d, base, tmp_path / "m")
    (d / lora.ADAPTER_CONFIG).write_text(good)
    edit_config(d, target_modules="c_attn")
    with pytest.raises(ExportError, match=r"adapter_config\.json: target_modules"):
        import_adapter(d, base, tmp_path / "m")
    edit_config(d, target_modules=["c_attn", "nope"])
    with pytest.raises(ExportError, match=r"adapter_config\.json: target_modules.*nope"):
        import_adapter(d, base, tmp_path / "m")
    # a PEFT setting that changes what the merge must compute, which codeforge's merge does not do
    (d / lora.ADAPTER_CONFIG).write_text(good)
    edit_config(d, use_rslora=True)
    with pytest.raises(ExportError, match=r"adapter_config\.json: use_rslora = True.*with PEFT"):
        import_adapter(d, base, tmp_path / "m")
    # through the command: exit 2 and the message, no traceback
    (d / lora.ADAPTER_CONFIG).write_text("{not json")
    assert main(["import", "--adapter", str(d), "--base", str(base), "--out", str(tmp_path / "m")]) == 2
    assert "not readable JSON" in capsys.readouterr().err


def test_an_adapter_without_a_record_of_its_base_is_refused(base, tmp_path):
    d = write_adapter(tmp_path / "a", base, record=False)
    with pytest.raises(ExportError, match=f"{RECORD} is missing.*export --run RUN --format adapter"):
        import_adapter(d, base, tmp_path / "m")
    for text in ("{broken", "[]", json.dumps({"base": None}), json.dumps({"base": {"sha256": 5}})):
        (d / RECORD).write_text(text)
        with pytest.raises(ExportError, match=f"{RECORD}"):
            import_adapter(d, base, tmp_path / "m")
    assert not (tmp_path / "m").exists()
