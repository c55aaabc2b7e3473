"""memfit.chunked_cross_entropy: parity with the plain head + loss, and the memory it saves."""

import pytest
import torch
from torch import nn

import memfit


def plain(hidden, weight, labels, bias=None):
    return nn.functional.cross_entropy(nn.functional.linear(hidden, weight, bias).flatten(0, -2), labels.flatten())


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_parity_with_the_plain_loss(chunk, with_bias):
    torch.manual_seed(0)
    h = torch.randn(3, 20, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if with_bias else None
    y = torch.randint(0, 50, (3, 20))
    y[0, :5] = -100  # ignored positions
    ref = plain(h, w, y, b)
    ref_grads = torch.autograd.grad(ref, [t for t in (h, w, b) if t is not None])
    got = memfit.chunked_cross_entropy(h, w, y, bias=b, chunk_size=chunk)
    got_grads = torch.autograd.grad(got, [t for t in (h, w, b) if t is not None])
    # float64, default tolerance: the same sums in chunks of rows, rounding order only
    torch.testing.assert_close(got, ref)
    for a, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, r)


def test_the_full_logits_never_exist():
    n, hid, vocab, chunk = 1024, 32, 8192, 128
    torch.manual_seed(0)
    w = torch.randn(vocab, hid, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    peaks = {}
    for name, loss in (("plain", plain), ("chunked", memfit.chunked_cross_entropy)):
        h = torch.randn(n, hid, requires_grad=True)
        kw = {"chunk_size": chunk} if name == "chunked" else {}
        with memfit.MemoryMeter() as meter:
            loss(h, w, y, **kw).backward()
        peaks[name] = meter.peak_bytes
        w.grad = None
    logits = n * vocab * 4  # 32 MiB in fp32
    inputs = (n * hid + vocab * hid) * 4 * 2 + n * 8  # hidden, weight and their gradients; labels
    # Chunked: the inputs, their gradients, the N logsumexps and a chunk's logits and temporaries.
    assert peaks["chunked"] <= inputs + n * 4 + 3 * chunk * vocab * 4, peaks
    assert peaks["plain"] >= inputs + 2 * logits  # the logits and their log-softmax (or gradient)
    assert peaks["plain"] - peaks["chunked"] > 1.5 * logits


def test_shapes_must_agree():
    with pytest.raises(ValueError, match=r"hidden \[4, 8\] and labels \[5\] must agree"):
        memfit.chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))
