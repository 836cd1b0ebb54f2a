"""LLaVA's image path: a CLIP vision transformer read at `vision_feature_layer` (the CLS row
dropped under the "default" selection) and a two-layer MLP projector, as transformers'
LlavaModel computes them. Its transformer layer is SigLIP's too (pagoda.model.vision.siglip)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.layers import Linear
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.vision.encoder import VisionEncoder, activation
from pagoda.model.vision_config import VisionConfig


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches."""

    def __init__(self, hidden: int, num_heads: int, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        tp = TensorParallelGroup()
        heads = tp.attention_heads(num_heads, num_heads, self.head_dim)
        self.qkv_proj = Linear(
            hidden, 3 * hidden, True, dtype, device, shard=tp.qkv(hidden, heads, num_heads, num_heads), kernels=kernels
        )
        self.out_proj = Linear(hidden, hidden, True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        qkv = self.qkv_proj(x.reshape(batch * length, hidden)).view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch * length, hidden)).view(batch, length, hidden)


class _ClipMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        self.fc1 = Linear(hidden, inner, True, dtype, device, kernels=kernels)
        self.act = activation(act)
        self.fc2 = Linear(inner, hidden, True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1])))).view(shape)


class ClipLayer(nn.Module):
    def __init__(self, tower: VisionConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        hidden, eps = tower.tower_int("hidden_size"), float(tower.tower.get("layer_norm_eps", 1e-5))
        self.layer_norm1 = nn.LayerNorm(hidden, eps, dtype=dtype, device=device)
        self.self_attn = VisionAttention(hidden, tower.tower_int("num_attention_heads"), dtype, device, kernels)
        self.layer_norm2 = nn.LayerNorm(hidden, eps, dtype=dtype, device=device)
        act = str(tower.tower.get("hidden_act", "quick_gelu"))
        self.mlp = _ClipMLP(hidden, tower.tower_int("intermediate_size"), act, dtype, device, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _ClipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden, patch = config.tower_int("hidden_size"), config.tower_int("patch_size")
        self.num_patches = (config.tower_int("image_size") // patch) ** 2
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.tower_int("num_channels", 3), hidden, patch, patch, bias=False, dtype=dtype, device=device
        )
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer (checkpoint names under `vision_tower.`, transformers 5's saved
    spelling; `vision_tower.vision_model.` is renamed to it by the family). Runs only the layers
    up to the one read."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        hidden, eps = config.tower_int("hidden_size"), float(config.tower.get("layer_norm_eps", 1e-5))
        self.embeddings = _ClipEmbeddings(config, dtype, device)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps, dtype=dtype, device=device)  # sic: CLIP's name
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            ClipLayer(config, dtype, device, kernels) for _ in range(config.tower_int("num_hidden_layers"))
        )
        # Loaded with the checkpoint; LLaVA reads a hidden layer, never the pooled output.
        self.post_layernorm = nn.LayerNorm(hidden, eps, dtype=dtype, device=device)

    def hidden_state(self, pixel_values: torch.Tensor, layer: int) -> torch.Tensor:
        """transformers' `hidden_states[layer]`: 0 the embeddings (after the pre-norm), i the
        output of layer i; negative counts from the last."""
        layers = cast("nn.ModuleList", self.encoder.layers)
        if layer < 0:
            layer += len(layers) + 1
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for block in list(layers)[:layer]:
            x = block(x)
        return x


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, config: VisionConfig, dtype, device, kernels: Kernels):
        super().__init__()
        bias = bool(config.options.get("projector_bias", True))
        self.linear_1 = Linear(vision_hidden, text_hidden, bias, dtype, device, kernels=kernels)
        self.act = activation(str(config.options.get("projector_act", "gelu")))
        self.linear_2 = Linear(text_hidden, text_hidden, bias, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaEncoder(VisionEncoder):
    """CLIP tower + MLP projector (checkpoint names `vision_tower.*`, `multi_modal_projector.*`)."""

    def __init__(
        self, config: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device, kernels: Kernels
    ):
        super().__init__()
        self.feature_layer = int(config.options.get("feature_layer", -2))
        self.keep_cls = config.options.get("select_strategy", "default") == "full"
        self.vision_tower = ClipVisionTower(config, dtype, device, kernels)
        self.multi_modal_projector = LlavaProjector(
            config.tower_int("hidden_size"), text_hidden, config, dtype, device, kernels
        )

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        pixels = pixel_values if pixel_values.dim() == 4 else pixel_values.unsqueeze(0)
        features = self.vision_tower.hidden_state(pixels, self.feature_layer)
        if not self.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features.reshape(-1, features.shape[-1]))
