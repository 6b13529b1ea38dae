"""Deployment: a converted 8da4w model exported to an ExecuTorch program lowered to XNNPACK and run
by ExecuTorch's own runtime gives the converted PyTorch model's logits and greedy text; schemes
XNNPACK cannot run are refused before any export work."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

logging.getLogger("torchao").setLevel(logging.ERROR)
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_

from checkpoint import ExecuTorchModel, export_executorch
from conftest import corpus
from model import ModelArgs, Transformer

ARGS = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64, vocab_size=128)


@pytest.fixture(scope="module")
def trained():
    """A one-layer model trained for a few seconds on repeated patterns, so that greedy decoding
    has clear winners (a random model's near-uniform logits would flip on any rounding)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**ARGS))
    model.init_weights(seed=0)
    data = torch.from_numpy(corpus(8192, vocab_size=128, n_patterns=8)).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        i = torch.randint(0, len(data) - 33, (16,), generator=g)
        batch = torch.stack([data[j:j + 33] for j in i.tolist()])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), data


def converted(model, config):
    q = Transformer(model.args)
    q.load_state_dict(model.state_dict())
    quantize_(q, config)
    return q.eval()


def config_8da(bits):
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, f"int{bits}"), weight_granularity=PerGroup(32))


@pytest.mark.parametrize("bits", [4, 2])
def test_pte_matches_converted_model(trained, tmp_path, bits):
    fp, data = trained
    q = converted(fp, config_8da(bits))
    path = str(tmp_path / "model.pte")
    export_executorch(q, path)
    assert b"XnnpackBackend" in open(path, "rb").read()  # the linears were delegated, not left to portable ops
    et = ExecuTorchModel(path)
    assert (et.max_seq_len, et.vocab_size) == (64, 128)
    x = data[:64][None]
    with torch.no_grad():
        ref, full = q(x), fp(x)
    out = et(x, torch.arange(64))
    # XNNPACK quantizes the activations to int8 itself: a rounding apart from torchao can move a
    # code by one step. That error must stay far below what quantization itself changes
    # XNNPACK quantizes activations to int8 with its own rounding: it may differ from torchao's
    # by about as much as torchao's int8 rounding differs from none (same weights, float activations)
    with torch.no_grad():
        wo = converted(fp, IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(32)))(x)
    assert (out - ref).norm() < 1.5 * (ref - wo).norm() < 0.5 * (ref - full).norm()
    ce = lambda logits: F.cross_entropy(logits[0, :-1], x[0, 1:]).item()
    assert abs(ce(out) - ce(ref)) < 0.01
    # the cache: a prompt prefilled and then fed one token at a time gives the same logits
    steps = [et(x[:, :40], torch.arange(40))] + [et(x[:, i:i + 1], torch.tensor([i])) for i in range(40, 48)]
    torch.testing.assert_close(torch.cat(steps, 1), out[:, :48], atol=1e-5, rtol=1e-5)
    prompt = data[100:108][None]
    assert et.generate(prompt, 40).tolist() == q.generate(prompt, 40, temperature=0).tolist()


def test_refusals(trained, tmp_path):
    fp, _ = trained
    path = str(tmp_path / "model.pte")
    with pytest.raises(ValueError, match="no quantized weights"):
        export_executorch(fp, path)
    with pytest.raises(ValueError, match="without int8 activations"):
        export_executorch(converted(fp, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))), path)
    with pytest.raises(ValueError, match="8-bit weights in groups of 32"):
        export_executorch(converted(fp, config_8da(8)), path)
    q = converted(fp, config_8da(4))
    quantize_(q, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
              filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    with pytest.raises(ValueError, match="quantized embedding"):
        export_executorch(q, path)
    with pytest.raises(ValueError, match="max_seq_len=65"):
        export_executorch(converted(fp, config_8da(4)), path, max_seq_len=65)
