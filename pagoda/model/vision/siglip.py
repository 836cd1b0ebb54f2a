"""Gemma 3's image path: a SigLIP vision transformer (CLIP's layers, no class token, a
post-norm) and the projector that average-pools its patch grid to mm_tokens_per_image rows."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.vision.clip import ClipLayer
from pagoda.model.vision.encoder import VisionEncoder
from pagoda.model.vision_config import VisionConfig


class _SiglipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden, patch = config.tower_int("hidden_size"), config.tower_int("patch_size")
        num_patches = (config.tower_int("image_size") // patch) ** 2
        self.patch_embedding = nn.Conv2d(
            config.tower_int("num_channels", 3), hidden, patch, patch, bias=True, dtype=dtype, device=device
        )
        self.position_embedding = nn.Embedding(num_patches, hidden, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer (no class token, no pre-norm, a post-norm; the pooling head,
    unused by Gemma 3, is not built)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        hidden, eps = config.tower_int("hidden_size"), float(config.tower.get("layer_norm_eps", 1e-6))
        self.embeddings = _SiglipEmbeddings(config, dtype, device)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            ClipLayer(config, dtype, device, kernels) for _ in range(config.tower_int("num_hidden_layers"))
        )
        self.post_layernorm = nn.LayerNorm(hidden, eps, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for block in cast("nn.ModuleList", self.encoder.layers):
            x = block(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to mm_tokens_per_image rows, Gemma's (1 + w) RMSNorm, then a
    plain matrix into the decoder's width."""

    def __init__(self, config: VisionConfig, text_hidden: int, dtype, device):
        super().__init__()
        hidden = config.tower_int("hidden_size")
        self.eps = float(config.tower.get("layer_norm_eps", 1e-6))
        self.patches_per_side = config.tower_int("image_size") // config.tower_int("patch_size")
        self.kernel = self.patches_per_side // int(int(config.options["mm_tokens_per_image"]) ** 0.5)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(hidden, text_hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.mm_soft_emb_norm.weight
        assert isinstance(weight, torch.Tensor)
        normed = (x * (1.0 + weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(features)


class Gemma3Encoder(VisionEncoder):
    """SigLIP tower + Gemma 3's pooling projector (names `vision_tower.*`, `multi_modal_projector.*`)."""

    def __init__(
        self, config: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device, kernels: Kernels
    ):
        super().__init__()
        self.vision_tower = SiglipVisionTower(config, dtype, device, kernels)
        self.multi_modal_projector = Gemma3Projector(config, text_hidden, dtype, device)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        pixels = pixel_values if pixel_values.dim() == 4 else pixel_values.unsqueeze(0)
        return self.multi_modal_projector(self.vision_tower(pixels)).reshape(
            -1, self.multi_modal_projector.mm_input_projection_weight.shape[1]
        )
