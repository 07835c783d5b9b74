"""Local copies of the Hugging Face transformers and timm blocks that ``cukit.nn.patch`` recognises
(same class names, attribute names and forwards), so the patch tests run where neither library is
installed; plus two small models built from them."""

from __future__ import annotations

import torch

nn = torch.nn
F = torch.nn.functional


# ------------------------------------------------------- local copies of transformers' and timm's
class GELUActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class NewGELUActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class GELUTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class FastGELUActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with weight (nx, nf) = (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int = 8, inter: int = 12, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GPT2MLP(nn.Module):
    def __init__(self, embed: int = 8, inter: int = 16, act: type[nn.Module] = NewGELUActivation) -> None:
        super().__init__()
        self.c_fc = Conv1D(inter, embed)
        self.c_proj = Conv1D(embed, inter)
        self.act = act()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = self.act(x)
        x = self.c_proj(x)
        return self.dropout(x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int = 8, inter: int = 16) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inter)
        self.intermediate_act_fn = GELUActivation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int = 8, inter: int = 16) -> None:
        super().__init__()
        self.activation_fn = GELUTanh()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class Mlp(nn.Module):
    """timm.layers.Mlp."""

    def __init__(self, dim: int = 8, hidden: int = 16, norm: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = norm(hidden) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


class GluMlp(Mlp):
    """timm.layers.GluMlp: Mlp's submodules, but act is applied to half of fc1's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.fc1(x).chunk(2, dim=-1)
        x = self.drop1(x1 * self.act(x2))
        return self.drop2(self.fc2(torch.cat([x, x], -1)))


class Blocks(nn.Module):
    """One of each known block, chained: x (.., 8) -> (.., 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = nn.ModuleList([LlamaMLP(), LlamaMLP()])
        self.gpt2 = GPT2MLP()
        self.bert = BertIntermediate()
        self.out = nn.Linear(16, 8)
        self.timm = Mlp()
        self.siglip = SiglipMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.llama:
            x = x + m(x)
        x = x + self.gpt2(x)
        return self.siglip(self.timm(self.out(self.bert(x))))


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.0),
        nn.Linear(16, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 4),
    )
