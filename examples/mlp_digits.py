"""Drop ``cukit.nn.BiasAct`` into your own model: ``Linear(bias=False) + BiasAct`` replaces
``Linear + activation`` and fuses the bias add with the activation (one kernel on CUDA, forward
and backward). Trains a small MLP on scikit-learn's digits; ``cukit demo`` times it against torch.

    python examples/mlp_digits.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import cukit
import cukit.nn
from cukit.demo import device_label, load_digits

device = torch.device("cuda" if torch.cuda.is_available() and cukit.is_available() else "cpu")
torch.manual_seed(0)
data = load_digits(device, seed=0)  # standardised 8x8 digits, 80/20 split, as tensors on `device`

model = nn.Sequential(
    nn.Linear(64, 256, bias=False),  # the bias lives in BiasAct ...
    cukit.nn.BiasAct(256, "gelu"),  # ... y = gelu(x + bias), one fused kernel
    nn.Linear(256, 256, bias=False),
    cukit.nn.BiasAct(256, "gelu"),
    nn.Linear(256, 10),
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)

for epoch in range(10):
    model.train()
    for idx in torch.randperm(len(data.x_train), device=device).split(64):
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    print(f"epoch {epoch + 1:2d}  train loss {loss.item():.4f}  test accuracy {accuracy:.2%}")

print(f"trained on {device_label(device)}")
