"""cukit.nn.forward_with_chunking / cukit.nn.Chunked: equal (float64 values and gradients) to one
call on the whole batch for torch's and cukit's losses, with ignore_index, class weights, label
smoothing, a last partial chunk, chunk_size >= N, N = 1 and N = 0; one chunk's graph alive at a
time in backward; state_dict keys; torch.compile; errors. GPU tests: peak memory, bf16, no sync."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import cukit  # noqa: E402
import cukit.nn as cnn  # noqa: E402

nn = torch.nn
F = torch.nn.functional
F64 = torch.float64


def torch_cuda() -> bool:
    return cukit.is_available() and torch.cuda.is_available()


class Head(nn.Module):
    """A language-model head and its loss: (N, T, H) hidden, (N, T) labels -> CE over V classes."""

    def __init__(self, h: int = 8, v: int = 11, reduction: str = "mean", **ce: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(h, v)
        self.loss = nn.CrossEntropyLoss(reduction=reduction, **ce)
        self.reduction = reduction
        self.ignore_index = self.loss.ignore_index
        self.weight = self.loss.weight
        self.logits: list[torch.Tensor] = []  # kept for the tests' inspection unless keep_logits is False
        self.keep_logits = True
        self.events: list[str] = []

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.events.append("run")
        self.loss.reduction = self.reduction  # (the chunked call sets self.reduction on a copy)
        z = self.proj(x)
        if self.keep_logits:
            self.logits.append(z)
        return self.loss(z.flatten(0, -2), t.flatten())


def labels(shape: tuple[int, ...], v: int, ignore: int | None = -100, frac: float = 0.3) -> torch.Tensor:
    t = torch.randint(0, v, shape)
    if ignore is not None:
        t[torch.rand(shape) < frac] = ignore
    return t


def run(fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    out = fn()
    (out.sum() if out.ndim else out).backward()
    return out.detach(), [p.grad.clone() for p in params]


def assert_same(a: tuple[torch.Tensor, list], b: tuple[torch.Tensor, list], tol: float = 1e-12) -> None:
    torch.testing.assert_close(b[0], a[0], rtol=tol, atol=tol)
    for ga, gb in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(gb, ga, rtol=tol, atol=tol)


CE_SETTINGS = [
    {},
    {"ignore_index": -100},
    {"ignore_index": 3},
    {"weight": "rand"},
    {"weight": "rand", "ignore_index": 2},
    {"weight": "rand", "label_smoothing": 0.1, "ignore_index": -100},
    {"label_smoothing": 0.2},
]


@pytest.mark.parametrize("settings", CE_SETTINGS, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("n", "chunk"), [(10, 3), (10, 1), (10, 10), (10, 64), (1, 4), (7, 2)])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_cross_entropy_equals_one_call(settings, reduction, n, chunk, checkpoint):
    torch.manual_seed(n * 100 + chunk)
    c = 11
    kw = dict(settings)
    if kw.get("weight") == "rand":
        kw["weight"] = torch.rand(c, dtype=F64) + 0.1
    loss = nn.CrossEntropyLoss(reduction=reduction, **kw)
    x = torch.randn(n, c, dtype=F64, requires_grad=True)
    t = labels((n,), c, kw.get("ignore_index", -100))
    ref = run(lambda: loss(x, t), [x])
    ours = run(lambda: cnn.forward_with_chunking(loss, x, t, chunk, checkpoint=checkpoint), [x])
    assert_same(ref, ours)
    assert loss.reduction == reduction  # the caller's module is not changed


@pytest.mark.parametrize("settings", [{}, {"ignore_index": 0}, {"weight": "rand"}, {"weight": "rand", "label_smoothing": 0.1}],
                         ids=str)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_lm_head_with_parameters_equals_one_call(settings, chunk):
    torch.manual_seed(chunk)
    kw = dict(settings)
    if kw.get("weight") == "rand":
        kw["weight"] = torch.rand(11, dtype=F64) + 0.1
    head = Head(**kw).double()
    x = torch.randn(5, 4, 8, dtype=F64, requires_grad=True)
    t = labels((5, 4), 11, kw.get("ignore_index", -100))
    params = [x, *head.parameters()]
    ref = run(lambda: head(x, t), params)
    ours = run(lambda: cnn.forward_with_chunking(head, x, t, chunk), params)
    assert_same(ref, ours)
    assert head.reduction == "mean"


def test_classic_helper_is_wrong_and_ours_is_not():
    """The motivating bug: a partial last chunk and ignored targets skew the classic mean."""
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss()
    x, t = torch.randn(10, 5, dtype=F64), labels((10,), 5, frac=0.5)

    def classic(module: Any, input: torch.Tensor, target: torch.Tensor, chunk_size: int) -> torch.Tensor:
        n, total = input.shape[0], 0.0
        for i in range(0, n, chunk_size):
            total += module(input[i:i + chunk_size], target[i:i + chunk_size])
        return total / (n / chunk_size)

    assert not torch.allclose(classic(loss, x, t, 4), loss(x, t))
    torch.testing.assert_close(cnn.forward_with_chunking(loss, x, t, 4), loss(x, t), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_cukit_linear_cross_entropy(chunk):
    torch.manual_seed(chunk)
    w = torch.rand(13, dtype=F64) + 0.1
    loss = cnn.LinearCrossEntropy(6, 13, bias=True, dtype=F64, weight=w, ignore_index=4, z_loss=1e-3)
    x = torch.randn(7, 6, dtype=F64, requires_grad=True)
    t = labels((7,), 13, ignore=4)
    params = [x, *loss.parameters()]
    assert_same(run(lambda: loss(x, t), params), run(lambda: cnn.forward_with_chunking(loss, x, t, chunk), params))


def test_cukit_modules_inside_the_chunk():
    torch.manual_seed(0)
    body = nn.Sequential(cnn.RMSNorm(8), cnn.Linear(8, 16, activation="gelu"), cnn.Linear(16, 5)).double()

    def module(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # a plain callable: returns the SUM
        return F.cross_entropy(body(x), t, reduction="sum", ignore_index=1)

    x = torch.randn(9, 8, dtype=F64, requires_grad=True)
    t = labels((9,), 5, ignore=1)
    params = [x, *body.parameters()]
    ref = run(lambda: F.cross_entropy(body(x), t, ignore_index=1), params)
    ours = run(lambda: cnn.forward_with_chunking(module, x, t, 4, ignore_index=1), params)
    assert_same(ref, ours)


@pytest.mark.parametrize("make", [nn.MSELoss, nn.L1Loss, nn.BCEWithLogitsLoss, nn.SmoothL1Loss])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_floating_target_losses(make, reduction):
    torch.manual_seed(0)
    loss = make(reduction=reduction)
    x = torch.randn(7, 3, dtype=F64, requires_grad=True)
    t = torch.rand(7, 3, dtype=F64)
    assert_same(run(lambda: loss(x, t), [x]), run(lambda: cnn.forward_with_chunking(loss, x, t, 3), [x]))


def test_class_probability_targets():
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(7, 5, 2, dtype=F64, requires_grad=True)
    t = torch.softmax(torch.randn(7, 5, 2, dtype=F64), dim=1)
    assert_same(run(lambda: loss(x, t), [x]), run(lambda: cnn.forward_with_chunking(loss, x, t, 2), [x]))


def test_denominator_override_and_empty_batch():
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss()
    x, t = torch.randn(6, 4, dtype=F64), labels((6,), 4)
    total = F.cross_entropy(x, t, reduction="sum")
    torch.testing.assert_close(cnn.forward_with_chunking(loss, x, t, 4, denominator=32), total / 32)
    torch.testing.assert_close(cnn.forward_with_chunking(loss, x, t, 4, denominator=torch.tensor(3.0, dtype=F64)),
                               total / 3)
    empty = cnn.forward_with_chunking(loss, x[:0], t[:0], 4)
    assert torch.isnan(empty) and torch.isnan(loss(x[:0], t[:0]))
    assert cnn.forward_with_chunking(loss, x[:0], t[:0], 4, reduction="sum") == 0


def test_low_precision_accumulates_in_float32():
    torch.manual_seed(0)
    x, t = torch.randn(4096, 7), labels((4096,), 7, ignore=None)
    loss = nn.CrossEntropyLoss(reduction="sum")
    out = cnn.forward_with_chunking(loss, x.bfloat16(), t, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), loss(x, t), rtol=8e-3, atol=0)


def test_one_chunk_graph_alive_at_a_time():
    """Checkpointed: the chunks' logits are freed after forward, and backward reruns chunk k and
    finishes its logits' gradient before rerunning chunk k - 1. Not checkpointed: all kept."""
    torch.manual_seed(0)
    events: list[str] = []
    head = Head().double()
    head.events = events
    x = torch.randn(6, 3, 8, dtype=F64, requires_grad=True)
    t = labels((6, 3), 11)
    loss = cnn.forward_with_chunking(head, x, t, 2)
    refs = [weakref.ref(z) for z in head.logits]
    nodes = [z.grad_fn for z in head.logits]
    head.logits.clear()
    assert all(r() is None for r in refs)  # nothing of the chunks' graphs kept
    assert events == ["run", "run", "run"]
    for k, node in enumerate(nodes):
        node.register_hook(lambda gi, go, k=k: events.append(f"grad{k}"))
    events.clear()
    loss.backward()
    assert events == ["run", "grad2", "run", "grad1", "run", "grad0"]  # rerun a chunk, its backward, the next
    head.logits.clear()
    saved = {ckpt: saved_bytes(lambda c=ckpt: cnn.forward_with_chunking(head, x, t, 2, checkpoint=c))
             for ckpt in (True, False)}
    inputs_bytes = x.numel() * 8 + t.numel() * 8  # the chunks' inputs: views of x and t, no new memory
    logits_bytes = 6 * 3 * 11 * 8
    assert saved[True] <= inputs_bytes + 64, saved
    assert saved[False] >= inputs_bytes + logits_bytes, saved  # the classic keeps every chunk's graph


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes that autograd saves for backward outside any checkpointed region while fn runs."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_no_grad_does_not_checkpoint():
    from unittest import mock

    loss = nn.CrossEntropyLoss()
    x, t = torch.randn(6, 4), labels((6,), 4)
    with mock.patch("torch.utils.checkpoint.checkpoint") as ckpt, torch.no_grad():
        torch.testing.assert_close(cnn.forward_with_chunking(loss, x, t, 4), loss(x, t))
    ckpt.assert_not_called()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_under_compile(fullgraph):
    """A module with a reduction attribute is copied per call, which dynamo does not trace (a graph
    break: fullgraph=False); a callable returning the sum compiles in one graph."""
    torch.manual_seed(0)
    w = torch.rand(11, dtype=F64) + 0.1
    head = Head(weight=w).double()
    x = torch.randn(5, 4, 8, dtype=F64, requires_grad=True)
    t = labels((5, 4), 11)
    params = [x, *head.parameters()]
    ref = run(lambda: head(x, t), params)

    def summed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head.proj(a).flatten(0, 1), b.flatten(), weight=w, reduction="sum")

    module = summed if fullgraph else head
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: cnn.forward_with_chunking(module, a, b, 2, weight=w if fullgraph else head.weight),
                      backend="aot_eager", fullgraph=fullgraph)
    assert_same(ref, run(lambda: f(x, t), params))
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------- Chunked
def test_chunked_module_equals_and_keeps_state_dict_keys():
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(8, 8), "loss": Head(ignore_index=2)}).double()
    keys = list(model.state_dict())
    ref_state = copy.deepcopy(model.state_dict())
    x = torch.randn(5, 4, 8, dtype=F64, requires_grad=True)
    t = labels((5, 4), 11, ignore=2)
    params = [x, *model.parameters()]
    ref = run(lambda: model["loss"](model["body"](x), t), params)
    model["loss"] = cnn.Chunked(model["loss"], 2)
    assert list(model.state_dict()) == keys
    ours = run(lambda: model["loss"](model["body"](x), t), params)
    assert_same(ref, ours)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(ref_state)  # the unwrapped model's keys load into the wrapped one
    assert_same(ref, run(lambda: model["loss"](model["body"](x), t), params))
    assert "chunk_size=2" in repr(model)
    total = F.cross_entropy(model["loss"].module.proj(model["body"](x)).flatten(0, 1), t.flatten(), ignore_index=2,
                            reduction="sum")
    torch.testing.assert_close(model["loss"](model["body"](x), t, denominator=7.0), total / 7)


def test_chunked_reduction_override():
    loss = nn.CrossEntropyLoss()
    x, t = torch.randn(6, 4, dtype=F64), labels((6,), 4)
    torch.testing.assert_close(cnn.Chunked(loss, 4, reduction="sum")(x, t),
                               F.cross_entropy(x, t, reduction="sum"), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("args", "kwargs", "exc", "match"), [
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(5, dtype=torch.long), 2), {}, ValueError,
     r"input and target must have the same first dimension; got input \(4, 3\), target \(5,\)"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 0), {}, ValueError,
     "chunk_size must be >= 1; got 0"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2.0), {}, TypeError,
     "chunk_size must be an int; got float"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), True), {}, TypeError,
     "chunk_size must be an int; got bool"),
    ((nn.CrossEntropyLoss(), [1.0], torch.zeros(4, dtype=torch.long), 2), {}, TypeError,
     "input must be a torch.Tensor; got list"),
    ((nn.CrossEntropyLoss(), torch.tensor(1.0), torch.tensor(1), 2), {}, ValueError, "input must have a batch"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2), {"reduction": "avg"},
     ValueError, "reduction must be one of"),
    ((nn.KLDivLoss(reduction="batchmean"), torch.randn(4, 3), torch.rand(4, 3), 2), {}, ValueError,
     "module's reduction must be one of"),
    ((nn.CrossEntropyLoss(ignore_index=3), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2),
     {"ignore_index": 1}, ValueError, r"ignore_index must match the module's \(3\)"),
    ((nn.CrossEntropyLoss(weight=torch.ones(3)), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2),
     {"weight": torch.ones(3)}, ValueError, "weight must be the module's own"),
    ((lambda x, t: (x.sum(), x), torch.randn(4, 3), torch.zeros(4), 2), {}, TypeError,
     "module must return a tensor .* got tuple"),
    ((lambda x, t: x, torch.randn(4, 3), torch.zeros(4), 2), {}, ValueError,
     r"module must return the chunk's summed loss \(0-d\) .* got shape \(2, 3\)"),
    ((3, torch.randn(4, 3), torch.zeros(4), 2), {}, TypeError, "module must be callable"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2), {"checkpoint": 1},
     TypeError, "checkpoint must be True or False"),
    ((nn.CrossEntropyLoss(), torch.randn(4, 3), torch.zeros(4, dtype=torch.long), 2), {"denominator": "n"},
     TypeError, "denominator must be"),
])
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match) as e:
        cnn.forward_with_chunking(*args, **kwargs)
    assert str(e.value).startswith("cukit.nn.forward_with_chunking: ")


def test_chunked_errors():
    with pytest.raises(TypeError, match=r"^cukit.nn.Chunked: module must be a torch.nn.Module; got function"):
        cnn.Chunked(lambda x, t: x, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^cukit.nn.Chunked: chunk_size must be >= 1; got -1"):
        cnn.Chunked(nn.CrossEntropyLoss(), -1)
    with pytest.raises(ValueError, match=r"^cukit.nn.Chunked: reduction must be one of"):
        cnn.Chunked(nn.CrossEntropyLoss(), 4, reduction="batchmean")
    with pytest.raises(ValueError, match=r"^cukit.nn.Chunked: input and target"):
        cnn.Chunked(nn.CrossEntropyLoss(), 4)(torch.randn(3, 2), torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------------------- GPU
def _peak(fn: Callable[[], torch.Tensor]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
def test_gpu_big_vocab_head_peak_memory_and_bf16_grads():
    torch.manual_seed(0)
    T, H, V = 4096, 512, 32000
    head = Head(H, V).cuda().bfloat16()
    head.keep_logits = False
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (T,), device="cuda")
    t[::7] = -100
    params = [x, *head.parameters()]

    def step(fn: Callable[[], torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        head.logits.clear()
        peak = _peak(lambda: fn())
        head.logits.clear()
        return peak, [p.grad.float() for p in params]

    peak_ref, g_ref = step(lambda: head(x, t))
    peak_ours, g_ours = step(lambda: cnn.forward_with_chunking(head, x, t, 512))
    peak_plain, _ = step(lambda: cnn.forward_with_chunking(head, x, t, 512, checkpoint=False))
    logits = T * V * 2  # bytes of the bf16 logits (and of their log-probabilities, which CE saves)
    assert peak_ours < 0.4 * peak_ref and peak_ours < 0.75 * logits, (peak_ours, peak_ref, logits)
    assert peak_plain >= logits  # not checkpointed: every chunk's log-probabilities kept until backward
    for a, b in zip(g_ref, g_ours, strict=True):
        torch.testing.assert_close(b, a, rtol=3e-2, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
def test_gpu_no_host_sync():
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss(weight=torch.rand(50, device="cuda") + 0.1)
    x = torch.randn(300, 50, device="cuda", requires_grad=True)
    t = torch.randint(0, 50, (300,), device="cuda")
    t[::5] = -100
    cnn.forward_with_chunking(loss, x, t, 64).backward()  # warm-up (lazy inits may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        cnn.forward_with_chunking(loss, x, t, 64).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
def test_gpu_cukit_linear_cross_entropy_chunked():
    torch.manual_seed(0)
    loss = cnn.LinearCrossEntropy(256, 5000, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 5000, (2048,), device="cuda")
    params = [x, *loss.parameters()]
    ref = run(lambda: loss(x, t), params)
    ours = run(lambda: cnn.forward_with_chunking(loss, x, t, 500), params)
    torch.testing.assert_close(ours[0].float(), ref[0].float(), rtol=1e-3, atol=1e-3)
    for a, b in zip(ref[1], ours[1], strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-3)
