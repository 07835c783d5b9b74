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


# ------------------------------------------------ rotary attention (transformers' Llama, trimmed)
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # transformers' signature, untyped
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rotary_tables(positions: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (batch, seq, dim) for positions (batch, seq), as LlamaRotaryEmbedding."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    """transformers' LlamaAttention.forward without cache and attention-interface dispatch: q and k
    are transposed views of the projections, rotated by the module-level apply_rotary_pos_emb."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.num_key_value_groups = heads // kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class LlamaBlock(nn.Module):
    """Attention and gated MLP with residuals (no norms): x (batch, seq, 32) -> same."""

    def __init__(self, hidden: int = 32, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden)
        self.mlp = LlamaMLP(hidden, 48, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        cos, sin = rotary_tables(positions, self.self_attn.head_dim)
        x = x + self.self_attn(x, (cos.to(x.dtype), sin.to(x.dtype)))
        return x + self.mlp(x)


# --------------------------------------------------------- RMSNorms (transformers' Llama and Gemma)
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)
