"""model.fuse_fake_quant's fast fake quantizer against torchao's own: the same forward to the bit,
the same gradients within float rounding, linears that read one input sharing its fake quant, and one
compiled graph per block."""

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as activation_checkpoint


logging.getLogger("torchao").setLevel(logging.ERROR)
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_
from torchao.quantization.qat import QATConfig

import model
from model import ModelArgs, Transformer, TransformerBlock, fuse_fake_quant, rope_tables

def prepared(dtype, config, embedding=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=False)).to(dtype)
    filt = (lambda mod, path: isinstance(mod, nn.Embedding)) if embedding else (lambda mod, path: isinstance(mod, nn.Linear))
    quantize_(m, QATConfig(config, step="prepare"), filter_fn=filt)
    return m


def test_learned_scales_start_in_the_models_dtype():
    # a bfloat16 checkpoint finetuned in float32: the scales of the float32 weights it becomes, not rounded to bfloat16
    m = prepared(torch.float32, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int2, weight_granularity=PerGroup(32)))
    model.learn_scales(m)
    state = {k: v.to(torch.bfloat16) for k, v in m.state_dict().items() if not k.endswith("learned_scale")}
    want, got = model.initial_scales(m, {k: v.float() for k, v in state.items()}), model.initial_scales(m, state)
    assert len(want) == 2 and all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["8da4w", "8da2w", "4w", "embedding 4w"])
def test_fused_fake_quant_matches_torchao(dtype, scheme):
    bits = int(scheme[-2])
    config = (IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(32)) if "8da" not in scheme
              else Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, f"int{bits}"), weight_granularity=PerGroup(32)))
    ref = prepared(dtype, config, embedding=scheme.startswith("embedding"))
    fast = copy.deepcopy(ref)
    fuse_fake_quant(fast)
    swapped = [type(fq).__name__ for mod in fast.modules()
               for fq in (getattr(mod, "activation_fake_quantizer", None), getattr(mod, "weight_fake_quantizer", None)) if fq]
    assert swapped and set(swapped) == {"FusedFakeQuantizer"}
    tokens = torch.randint(50, (4, 16))
    with torch.no_grad():  # outliers, so that some values hit the clamp and lose their gradient
        for m in (ref, fast):
            m[0].weight[:, :3] *= 8
    out_ref, out_fast = ref(tokens), fast(tokens)
    assert torch.equal(out_ref, out_fast)  # the converted model's loss equals this forward's
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_fast.backward(grad)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        # torchao's backward multiplies by the scale and its inverse: equal up to that rounding
        tol = 2 ** -20 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(p_ref.grad, p_fast.grad, rtol=tol, atol=tol * p_ref.grad.abs().max().item()), name
        if dtype == torch.float32:  # the same clamped values pass no gradient (bf16 sums may round to 0 apart)
            assert torch.equal(p_ref.grad == 0, p_fast.grad == 0), name
    with torch.inference_mode():
        assert torch.equal(ref(tokens), fast(tokens))
    # fake quant off: the plain model
    for m in (ref, fast):
        for mod in m.modules():
            for fq in (getattr(mod, "activation_fake_quantizer", None), getattr(mod, "weight_fake_quantizer", None)):
                if fq is not None:
                    fq.enabled = False
    assert torch.equal(ref(tokens), fast(tokens))


NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU (.ci/gpu runs it)")


def prepare_8da2w(m):
    """m's linear layers fake-quantized by torchao, int8 activations and 2-bit weights in groups of 32."""
    quantize_(m, QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int2, weight_granularity=PerGroup(32)),
                           step="prepare"), filter_fn=lambda mod, path: isinstance(mod, nn.Linear))


@pytest.mark.parametrize("device, bool_mask", [("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=NEEDS_GPU)])
def test_compiled_block_is_one_graph_and_computes_what_eager_does(device, bool_mask, monkeypatch):
    # bool_mask: the clamp masks as a GPU keeps them, bools (a CPU keeps the difference); on a GPU,
    # its own choice
    if bool_mask is not None:
        monkeypatch.setattr(model, "_mask_as_difference", lambda x: not bool_mask)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=32)
    torch.manual_seed(0)
    block = TransformerBlock(args)
    prepare_8da2w(block)
    fuse_fake_quant(block)
    block.to(device)
    cos, sin = (t.to(device) for t in rope_tables(args.dim // args.n_heads, 16, args.rope_theta))
    x = torch.randn(2, 16, 64).to(device)
    explained = torch._dynamo.explain(block)(x, cos, sin)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    # compiled too, wq, wk, wv (and w1, w3) share their input's fake quant: 4 inputs and 7 weights
    ranges = [n for n in explained.graphs[0].graph.nodes if n.target == "amax"]  # one per fake quant
    assert len(ranges) == 4 + 7
    # the same output and gradients, the clamp masks included (on CPU the compiled graph hands
    # them to ATen to store): a wrong mask would pass or stop the gradient of whole weights
    compiled = copy.deepcopy(block)
    compiled.compile()
    grad = torch.randn(2, 16, 64).to(device)
    for m in (block, compiled):
        m(x, cos, sin).backward(grad)
    for (name, p), p_compiled in zip(block.named_parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, p_compiled.grad, rtol=1e-4, atol=1e-4 * p.grad.abs().max().item()), name
        stopped = (p.grad == 0).sum()  # in each 2-bit weight, where a group's largest positive value clamps
        assert (p_compiled.grad == 0).sum() == stopped and (stopped > 0 or "norm" in name), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_GPU)])
def test_compiled_bfloat16_fake_quant_rounds_as_eager(device):
    # inductor would keep a bf16 scale in fp32 inside its fused kernel (7% of the int8 activation codes
    # a level off; on torch 2.11 too with emulate_precision_casts); model.py has it round where eager,
    # torchao and the conversion do. The QAT configs' weight scales are in the model's dtype (None)
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    torch.manual_seed(0)
    x, w = torch.randn(64, 256).to(torch.bfloat16), (torch.randn(64, 256) * 0.02).to(torch.bfloat16)
    x, w = x.to(device), w.to(device)
    for config, t in ((IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False), x),
                      (IntxFakeQuantizeConfig(torch.int4, PerGroup(32), is_symmetric=True), w),
                      (IntxFakeQuantizeConfig(torch.int4, PerGroup(32), is_symmetric=True, scale_precision=None), w)):
        fq = model.FusedFakeQuantizer(config)
        assert torch.equal(torch.compile(fq)(t), fq(t)), config


def test_chunked_loss_of_a_fake_quantized_output_equals_unchunked():
    # the chunks share the output weight's fake quant, computed once: the same loss and gradients
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=32)
    torch.manual_seed(0)
    m = Transformer(args)
    prepare_8da2w(m)
    fuse_fake_quant(m)
    tokens = torch.randint(96, (2, 16))
    grads = []
    for chunk in (5, 1024):
        m.zero_grad(set_to_none=True)
        loss = m(tokens, tokens, reduction="sum", loss_chunk=chunk)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for n, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][n], atol=1e-5, rtol=1e-4, msg=n)
    assert grads[0][1]["output.weight"].abs().sum() > 0


@pytest.mark.parametrize("recompute", [False, True])
def test_linears_reading_one_input_share_its_fake_quant(recompute, monkeypatch):
    # a Transformer fake-quantized by torchao against the fused one: wq, wk and wv (and w1, w3) see
    # one input, fake-quantized once (model.project), with the same loss and gradients; with every
    # block's activations recomputed in backward and the loss in chunks (recomputed too) as well
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=32)
    torch.manual_seed(0)
    ref = Transformer(args)
    prepare_8da2w(ref)
    fast = copy.deepcopy(ref)
    fuse_fake_quant(fast)
    if recompute:
        for m in (ref, fast):
            for block in m.layers:
                activation_checkpoint(block)
    calls = []  # one entry per fake quant computed
    apply = model._FakeQuantize.apply
    monkeypatch.setattr(model._FakeQuantize, "apply", lambda *a: calls.append(1) or apply(*a))
    tokens = torch.randint(64, (2, 16))
    chunks = 4 if recompute else 1  # of the loss, each fake-quantizing its input; the output weight once for all
    losses = [m(tokens, tokens, loss_chunk=16 * 2 // chunks) for m in (ref, fast)]
    calls.clear()  # per block 4 inputs fake-quantized (not 7) and 7 weights
    fast(tokens, tokens, loss_chunk=16 * 2 // chunks)
    assert len(calls) == 2 * (4 + 7) + chunks + 1
    assert torch.equal(losses[0], losses[1])
    calls.clear()
    losses[0].backward()
    losses[1].backward()  # the recomputation of each block and chunk shares as its forward did
    assert len(calls) == (2 * (4 + 7) + chunks if recompute else 0)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        assert torch.allclose(p_ref.grad, p_fast.grad, rtol=2 ** -20, atol=2 ** -20 * p_ref.grad.abs().max().item()), name
