"""cukit.nn modules: Linear takes torch's positional arguments (activation is keyword only),
Conv1D is transformers' GPT-2 Conv1D with cukit's fused linear, and activations are checked with
errors that name the module. Every test here runs on the CPU (the torch reference path)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hf_blocks import Conv1D as HFConv1D  # noqa: E402  (transformers' Conv1D, as defined there)

import cukit.nn  # noqa: E402  (after the torch skip)

nn = torch.nn
F = torch.nn.functional


def test_linear_takes_torch_positional_arguments():
    m = cukit.nn.Linear(4, 5, True, "cpu")
    assert m.weight.device.type == "cpu" and m.bias is not None and m.activation is None
    m = cukit.nn.Linear(4, 5, False, "cpu", torch.float64, activation="gelu")
    assert m.bias is None and m.weight.dtype == torch.float64 and m.activation == "gelu"
    assert type(m).__mro__[1] is nn.Linear
    ref = nn.Linear(4, 5, False, "cpu", torch.float64)
    assert m.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(m(x), F.gelu(F.linear(x, m.weight)), rtol=1e-12, atol=1e-12)


def test_linear_bad_activation_names_module_argument_values_and_value():
    with pytest.raises(ValueError, match="activation must be one of") as e:
        cukit.nn.Linear(2, 2, activation="tanh")
    msg = str(e.value)
    assert msg.startswith("cukit.nn.Linear: ")
    assert all(a in msg for a in ("None", "'relu'", "'gelu'", "'gelu_tanh'", "'silu'", "got 'tanh'"))
    with pytest.raises(TypeError):  # activation is keyword only: a 6th positional argument is an error
        cukit.nn.Linear(2, 2, True, None, None, "relu")
    with pytest.raises(ValueError, match=r"cukit.nn.Conv1D: activation must be one of .*got 'gelu_new'"):
        cukit.nn.Conv1D(2, 2, activation="gelu_new")


def test_bias_act_bad_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'tanh'"):
        cukit.nn.BiasAct(3, "tanh")
    with pytest.raises(ValueError, match=r"activation must be one of .*got None"):
        cukit.nn.BiasAct(3, None)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_conv1d_matches_transformers_conv1d(activation):
    torch.manual_seed(0)
    hf = HFConv1D(6, 4).double()
    ours = cukit.nn.Conv1D(6, 4, activation=activation, dtype=torch.float64)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    act = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    y_ref, y = act(hf(x)), ours(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    (gx_ref, gw_ref), (gx, gw) = (torch.autograd.grad(t.sum(), (x, w)) for t, w in ((y_ref, hf.weight),
                                                                                        (y, ours.weight)))
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)
    assert f"activation={activation!r}" in repr(ours) and "nf=6, nx=4" in repr(ours)
    hf.load_state_dict(ours.state_dict())  # and back
    assert cukit.nn.Conv1D(3, 2, bias=False).bias is None
