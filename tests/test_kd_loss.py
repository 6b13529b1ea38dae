"""kd_train.StudentLogProbs, the student's log-probs with a hand-written gradient, against autograd
through log_softmax, gather and the CE in float64: every case the script can reach (online and
stored, the rest bucket with and without its floor, k = vocabulary, T != 1, padding rows, ignored
labels), and the forward KL it returns online when given the teacher's log-probs. The class is read out of kd_train.py's source: the script itself runs on import."""

import ast
import math
import os

import pytest
import torch
import torch.nn.functional as F

from model import IGNORE_INDEX

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def student_log_probs(n_vocab):
    with open(os.path.join(HERE, "kd_train.py")) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StudentLogProbs")
    scope = dict(torch=torch, F=F, math=math, IGNORE_INDEX=IGNORE_INDEX, n_vocab=n_vocab)
    exec(compile(ast.Module([cls], type_ignores=[]), "kd_train.py", "exec"), scope)
    return scope["StudentLogProbs"]


def reference(z, y, ids, T, n_vocab, t_logp=None):
    """What the script computed before: log_softmax, gather and a rest bucket, and the forward KL
    through autograd."""
    label = -F.cross_entropy(z, y, ignore_index=IGNORE_INDEX, reduction="none")
    lpt = F.log_softmax(z[:, :n_vocab] / T, -1)
    if t_logp is not None:
        return (t_logp.exp() * (t_logp - lpt)).sum(-1), label
    if ids is None:
        return lpt, label
    top = lpt.gather(1, ids)
    if ids.shape[1] == n_vocab:
        return top, label
    eps = torch.finfo(torch.float32).eps
    rest = torch.log(-torch.expm1(top.logsumexp(-1, keepdim=True).clamp(max=math.log1p(-eps))))
    return torch.cat((top, rest), 1), label


CASES = {  # name: (rows V, tokenizer's vocabulary, k or None for online, T); "fkl": the teacher's log-probs given
    "online": (64, 64, None, 1.0), "online-T2-padded": (72, 64, None, 2.0),
    "online-fkl": (64, 64, None, 1.0), "online-fkl-T2-padded": (72, 64, None, 2.0),
    "top8": (64, 64, 8, 1.0), "top8-T2": (64, 64, 8, 2.0), "top8-padded": (72, 64, 8, 1.0),
    "top-all": (64, 64, 64, 1.0), "top-all-T0.5-padded": (72, 64, 64, 0.5),
}


@pytest.mark.parametrize("name", CASES)
def test_gradient_equals_autograd(name):
    V, n_vocab, k, T = CASES[name]
    gen = torch.Generator().manual_seed(0)
    N = 40
    z = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    z[0, :n_vocab] = -30.0
    z[0, 5] = 30.0  # one token holds all the mass: the rest bucket is floored, and takes no gradient
    y = torch.randint(0, n_vocab, (N,), generator=gen)
    y[[3, 7]] = IGNORE_INDEX
    ids = None if k is None else torch.argsort(torch.randn(N, n_vocab, generator=gen), 1)[:, :k]
    if ids is not None:
        ids[0, 0] = 5
    t_logp = F.log_softmax(torch.randn(N, n_vocab, generator=gen, dtype=torch.float64) * 2, -1) if "fkl" in name else None
    out_shape = (N,) if t_logp is not None else (N, n_vocab if k is None else k + (k < n_vocab))
    g_out, g_label = torch.randn(out_shape, generator=gen, dtype=torch.float64), torch.randn(N, generator=gen, dtype=torch.float64)
    fn = student_log_probs(n_vocab)
    a = z.clone().requires_grad_()
    out_a, label_a = fn.apply(a, y, ids, T, t_logp)
    ((out_a * g_out).sum() + (label_a * g_label).sum()).backward()
    b = z.clone().requires_grad_()
    out_b, label_b = reference(b, y, ids, T, n_vocab, t_logp)
    ((out_b * g_out).sum() + (label_b * g_label).sum()).backward()
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(label_a, label_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    if V > n_vocab:
        assert a.grad[:, n_vocab:].abs().sum() > 0  # padding rows: the CE's gradient only
    if k is not None and k < n_vocab:
        assert out_a[0, -1].item() == pytest.approx(math.log(torch.finfo(torch.float32).eps))  # floored


@pytest.mark.parametrize("used", ["label", "out"])
@pytest.mark.parametrize("name", ["online-T2-padded", "top8-T2"])
def test_gradient_when_one_output_is_outside_the_loss(name, used):
    # kd_ratio 0 logs the KD term detached: its output gets no gradient (None), and the CE's
    # gradient is all there is; and the other way round
    V, n_vocab, k, T = CASES[name]
    gen = torch.Generator().manual_seed(1)
    N = 24
    z = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, n_vocab, (N,), generator=gen)
    y[2] = IGNORE_INDEX
    ids = None if k is None else torch.argsort(torch.randn(N, n_vocab, generator=gen), 1)[:, :k]
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    out_a, label_a = student_log_probs(n_vocab).apply(a, y, ids, T, None)
    out_b, label_b = reference(b, y, ids, T, n_vocab)
    (label_a.sum() if used == "label" else out_a.sum()).backward()
    (label_b.sum() if used == "label" else out_b.sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
