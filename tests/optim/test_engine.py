"""The host side of the multi-tensor engine: the int64 table layout the kernels read
(raw_kernels/include/cukit/multi_tensor.cuh), checked on the CPU by decoding it."""

from __future__ import annotations

import numpy as np
import pytest
from cukit.optim import _engine as eng

torch = pytest.importorskip("torch")


def decode(host: np.ndarray, L: int, T: int, chunk: int) -> list[tuple[int, int, int]]:
    """(tensor, start, n) of every work item, as the kernel's for_each_chunk derives them."""
    sizes = host[L * T : (L + 1) * T]
    begin = host[(L + 2) * T : (L + 3) * T + 1]
    work = host[(L + 3) * T + 1 :]
    assert len(work) == begin[-1]
    out = []
    for w in work:
        t, j = int(w) >> 32, int(w) & 0xFFFFFFFF
        start = j * chunk
        out.append((t, start, int(min(sizes[t] - start, chunk))))
    return out


@pytest.mark.parametrize("chunk", [4, 8, 16384])
def test_work_list_covers_every_element_once_and_skips_size_zero(chunk: int) -> None:
    sizes = np.array([5, 0, 17, 16, 1, 0, 40000], dtype=np.int64)
    T, L = len(sizes), 3
    addr = np.arange(L * T, dtype=np.int64).reshape(L, T) * 4096
    host, C, aligned = eng.host_layout(addr, sizes, [4, 4, 2], [0, 1, 2, 0, 7, 3, 1], chunk)
    items = decode(host, L, T, chunk)
    assert len(items) == C == sum(-(-int(s) // chunk) for s in sizes)
    covered = {t: np.zeros(int(s), dtype=int) for t, s in enumerate(sizes)}
    for t, start, n in items:
        assert n > 0 and sizes[t] > 0
        covered[t][start : start + n] += 1
    assert all((c == 1).all() for c in covered.values())
    begin = host[(L + 2) * T : (L + 3) * T + 1]
    for t in range(T):  # chunks of a tensor are consecutive, in order
        assert [i for i, (tt, _, _) in enumerate(items) if tt == t] == list(range(begin[t], begin[t + 1]))
    info = host[(L + 1) * T : (L + 2) * T]
    assert list(info & 0xFF) == [0, 1, 2, 0, 7, 3, 1]
    assert aligned.all() and ((info & eng.ALIGNED_BIT) != 0).all()


def test_alignment_is_per_tensor_and_per_list_itemsize() -> None:
    addr = np.array([[0, 16, 32, 48], [0, 8, 16, 20]], dtype=np.int64)
    # list 1 holds 2-byte elements: aligned when the address is a multiple of 4 * 2 = 8
    _, _, aligned = eng.host_layout(addr, np.full(4, 10, np.int64), [4, 2], [0, 0, 0, 0], 16)
    assert aligned.tolist() == [True, True, True, False]
    _, _, aligned = eng.host_layout(addr, np.full(4, 10, np.int64), [4, 4], [0, 0, 0, 0], 16)
    assert aligned.tolist() == [True, False, True, False]


def test_layout_offsets_match_the_header() -> None:
    addr = np.array([[111, 222], [333, 444]], dtype=np.int64)
    host, C, _ = eng.host_layout(addr, np.array([3, 9], np.int64), [4, 4], [0, 1], 4)
    L, T = 2, 2
    assert host[:4].tolist() == [111, 222, 333, 444]  # addr[l * T + t]
    assert host[L * T : L * T + 2].tolist() == [3, 9]  # size
    assert host[(L + 2) * T : (L + 3) * T + 1].tolist() == [0, 1, 4]  # chunk_begin
    assert C == 4 and len(host) == (L + 3) * T + 1 + C


def test_bad_groups_raise() -> None:
    addr = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match="group"):
        eng.host_layout(addr, np.ones(2, np.int64), [4], [0, eng.MAX_GROUPS], 4)
    with pytest.raises(ValueError, match="groups has"):
        eng.host_layout(addr, np.ones(2, np.int64), [4], [0], 4)


def test_table_needs_cuda_tensors() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        eng.TensorTable([[torch.zeros(4)]], [0])


def test_every_declared_kernel_exists_for_every_combo() -> None:
    from cukit.optim import _kernels as k

    from cukit.cli import all_modules

    mods = all_modules()
    for m in (k.ADAM, k.SGD, k.LION, k.LAMB, k.ADAGRAD, k.L2NORM):
        assert m.key in mods
    lowbit = sum(len(k.LOWBIT_BITS) * len(k.lowbit_masters(p)) for p in k.LOWBIT_DTYPES)
    assert len(k.ADAM.all_instantiations()) == 4 * len(k.COMBOS) + 2 * lowbit + 1
    assert len(k.SGD.all_instantiations()) == 2 * len(k.COMBOS) + lowbit + 1
    assert len(k.LION.all_instantiations()) == len(k.COMBOS) + lowbit
    # the quantised groups are named by their parameter dtype, so `--dtypes` selects them
    from cukit._warmup import plan

    groups = {(j.module, j.group) for j in plan("sm_90", ["adam"], ["bfloat16"])}
    assert ("adam.cu", "bfloat16/lowbit") in groups and ("adam.cu", "float32/lowbit") not in groups


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_set_list_takes_only_tensors_that_fit() -> None:
    """New gradients must match what they replace in element count, dtype (not just itemsize:
    float16 bits read as bfloat16 would be silently wrong), device and layout."""
    ps = [torch.zeros(5, 3, device="cuda", dtype=torch.bfloat16), torch.zeros(7, device="cuda", dtype=torch.bfloat16)]
    table = eng.TensorTable([ps, [torch.zeros_like(p) for p in ps]], [0, 0])
    good = [torch.ones_like(p) for p in ps]
    assert table.fits(1, good)
    misaligned = torch.ones(8, device="cuda", dtype=torch.bfloat16)[1:]  # 7 elements, 2-byte aligned
    table.set_list(1, [good[0], misaligned])
    torch.cuda.synchronize()
    assert table.table.cpu().tolist() == table.host.tolist()  # the copied span and the untouched rest
    assert int(table.host[(2 + 1) * 2 + 1]) & eng.ALIGNED_BIT == 0  # tensor 1 lost its aligned flag
    table.set_list(1, good)
    torch.cuda.synchronize()
    assert table.host[2:4].tolist() == [g.data_ptr() for g in good]
    assert table.table.cpu().tolist() == table.host.tolist()
    bad = {
        "count": good[:1],
        "numel": [good[0], torch.ones(8, device="cuda", dtype=torch.bfloat16)],
        "dtype": [good[0], torch.ones(7, device="cuda", dtype=torch.float16)],
        "layout": [torch.ones(3, 5, device="cuda", dtype=torch.bfloat16).t(), good[1]],
        "device": [good[0], torch.ones(7, dtype=torch.bfloat16)],
    }
    for what, tensors in bad.items():
        assert not table.fits(1, tensors), what
        with pytest.raises(ValueError, match="do not fit the table"):
            table.set_list(1, tensors)
    assert table.host[2:4].tolist() == [g.data_ptr() for g in good]  # untouched by the refusals


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_optimizers_launches_are_prepared_once_per_table() -> None:
    """The update and step-count launches are built on the first step and reused (a step costs a
    struct pack per launch), also when the gradients move; the result stays the reference's."""
    import cukit.optim

    torch.manual_seed(0)
    ps = [torch.randn(n, device="cuda", requires_grad=True) for n in (1000, 33, 4096)]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = cukit.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    built = []
    for _ in range(4):
        for p, r in zip(ps, ref, strict=True):
            g = torch.randn_like(p)
            p.grad, r.grad = g.clone(), g.clone()  # new addresses every step: the table is repointed
        opt.step()
        ref_opt.step()
        (plan,) = opt._plans
        built.append({k: id(v) for k, v in plan.table.launches.items()})
        for group in opt.param_groups:
            group["lr"] *= 0.5
        for group in ref_opt.param_groups:
            group["lr"] *= 0.5
    assert built[0] and all(b == built[0] for b in built), built
    assert all(v is not None for v in plan.table.launches.values())
    for p, r in zip(ps, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
