"""model.quantize=nf4 on a CPU: an evaluation never changes the base weights the later training steps use (issue 31,
D7), on either CPU kind. bitsandbytes 0.50 decides per layer, at construction, from `has_avx512bf16()` whether an
eval-mode forward repacks the weight for its bf16 kernel; the "avx512bf16" kind patches that check to True, so its
real packing code runs as on such a CPU. Only the packed kernel itself needs the instruction set (without it the
packed forward's numbers are meaningless here; none is compared)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")

from glmtune.config import LoraConfig  # noqa: E402
from glmtune.models.presets import ensure_tiny  # noqa: E402
from glmtune.models.quantize import load_quantized  # noqa: E402
from glmtune.train.lora import apply_lora  # noqa: E402

ALL_LINEARS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def this_cpu_packs() -> bool:
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


@pytest.fixture(params=["this cpu", "avx512bf16"])
def cpu_kind(request, monkeypatch):
    if request.param == "avx512bf16":
        from bitsandbytes.nn import modules

        monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)
    return request.param


def packs(cpu_kind: str) -> bool:
    return cpu_kind == "avx512bf16" or this_cpu_packs()


def test_the_cpu_kind_decides_whether_bitsandbytes_packs(cpu_kind):
    """The emulation reaches the real code: a plain bitsandbytes Linear4bit (outside glmtune) repacks its weight
    at a no-grad eval forward exactly when the CPU kind has AVX512-BF16."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(64, 128, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(128, 64), requires_grad=False, quant_type="nf4", module=layer)
    layer = layer.to("cpu").eval()
    codes = layer.weight.data.clone()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    packed = bool(getattr(layer.weight.quant_state, "packing_format_for_cpu", False))
    assert packed == packs(cpu_kind)
    assert (layer.weight.shape != codes.shape) == packed  # [N, K/2] tiles instead of [N*K/2, 1] codes


def _qlora(double_quant: bool):
    model = load_quantized(ensure_tiny("glm4"), "nf4", torch.float32, double_quant=double_quant)
    torch.manual_seed(0)  # the same LoRA A matrices in every model
    return apply_lora(model, LoraConfig(target_modules=ALL_LINEARS, dropout=0.0))


def _base_state(model) -> list:
    """Everything a quantized layer's weight is made of, as stored: 4-bit codes, block scales (nested or not),
    code tables, dtypes and the packing flag."""
    from bitsandbytes.nn import Linear4bit

    out = []
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear4bit):
            continue
        weight = layer.weight
        state = weight.quant_state
        nested = getattr(state, "state2", None)
        out.append(
            (
                name,
                weight.data.clone(),
                state.absmax.clone(),
                state.code.clone(),
                state.dtype,
                tuple(state.shape),
                bool(state.nested),
                getattr(state, "offset", None),
                None if nested is None else (nested.absmax.clone(), nested.code.clone()),
                bool(getattr(state, "packing_format_for_cpu", False)),
            )
        )
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_training_step_after_an_evaluation_equals_the_step_on_a_fresh_model(cpu_kind, double_quant):
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fresh, evaluated = _qlora(double_quant), _qlora(double_quant)
    # The tiny model's query_key_value (128 x 64) and dense (64 x 64) are widths bitsandbytes' packing takes.
    pristine = _base_state(evaluated)

    evaluated.eval()  # what an evaluation does: the loss under no_grad, and generation with a KV cache
    with torch.no_grad():
        evaluated(**batch, labels=ids)
        evaluated.generate(input_ids=ids[:1, :8], max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    after = _base_state(evaluated)
    assert not any(entry[-1] for entry in after), "a layer was repacked"
    assert all(_same(a, b) for a, b in zip(after, pristine)) and len(after) == len(pristine) == 8

    want_loss, want_grads = _step(fresh, batch)
    got_loss, got_grads = _step(evaluated, batch)
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) == 2 * 2 * len(ALL_LINEARS)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert all(_same(a, b) for a, b in zip(_base_state(evaluated), pristine))  # and after the step too


# Emulates the CPU kind for a whole process: bitsandbytes.functional's check answers True from its first import
# on, so the import itself takes the AVX512-BF16 branch (where it logs the 'kernels' hint).
EMULATE = """
import importlib.abc, importlib.machinery, sys

class AVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, AVX512BF16())
"""


def test_the_kernels_hint_of_bitsandbytes_never_reaches_the_console_of_a_quantized_run():
    path = ensure_tiny("glm4")
    plain = EMULATE + "import bitsandbytes\n"
    glmtune = EMULATE + (
        "import torch\nfrom glmtune.models.quantize import load_quantized\n"
        f"model = load_quantized({str(path)!r}, 'nf4', torch.float32)\n"
        "from bitsandbytes.functional import has_avx512bf16\nassert has_avx512bf16()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for code in (plain, glmtune)
    ]
    (plain_out, plain_err), (out, err) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, plain_err[-2000:] + err[-2000:]
    if importlib.util.find_spec("kernels") is None:  # with it installed bitsandbytes may load its kernel quietly
        assert "kernels" in plain_err  # the emulation reaches the branch that logs the hint
    assert "kernels" not in out + err, err
