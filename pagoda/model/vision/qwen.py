"""Qwen2.5-VL's and Qwen3-VL's vision transformers: 3-D patch embeddings, 2-D rope over each
patch's (row, column), attention within windows or whole images, and patch mergers into one
decoder row per spatial_merge_size^2 patches (Qwen3-VL: also its DeepStack rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.layers import Linear
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.vision.encoder import VisionEncoder, activation
from pagoda.model.vision_config import VisionConfig


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm: in float32, the weight applied after the cast back."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


class _VisionRMSNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _QwenVisionAttention(nn.Module):
    """Attention within segments (windows, or the whole image), with 2-D rope on q and k."""

    def __init__(self, hidden: int, num_heads: int, dtype, device, kernels: Kernels):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = Linear(hidden, 3 * hidden, True, dtype, device, kernels=kernels)
        self.proj = Linear(hidden, hidden, True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        q, k, v = self.qkv(x).reshape(length, 3, self.num_heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            outs.append(out.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(length, -1))


class _QwenVisionMLP(nn.Module):
    """The gated MLP with biases (gate and up fused, as the decoder's)."""

    def __init__(self, hidden: int, inner: int, act: str, dtype, device, kernels: Kernels):
        super().__init__()
        self.inner = inner
        self.gate_up_proj = Linear(
            hidden,
            2 * inner,
            True,
            dtype,
            device,
            shard=TensorParallelGroup().column(hidden, inner, inner),
            kernels=kernels,
        )
        self.act = activation(act)
        self.down_proj = Linear(inner, hidden, True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act(gate_up[:, : self.inner]) * gate_up[:, self.inner :])


class _QwenVisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype, device, kernels: Kernels):
        super().__init__()
        hidden = config.tower_int("hidden_size")
        self.norm1 = _VisionRMSNorm(hidden, dtype, device)
        self.norm2 = _VisionRMSNorm(hidden, dtype, device)
        self.attn = _QwenVisionAttention(hidden, config.tower_int("num_heads"), dtype, device, kernels)
        act = str(config.tower.get("hidden_act", "silu"))
        self.mlp = _QwenVisionMLP(hidden, config.tower_int("intermediate_size"), act, dtype, device, kernels)

    def forward(self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """Each spatial_merge_size^2 neighbouring patches into one decoder row."""

    def __init__(self, config: VisionConfig, dtype, device, kernels: Kernels):
        super().__init__()
        hidden, merge = config.tower_int("hidden_size"), config.tower_int("spatial_merge_size")
        self.merged = hidden * merge * merge
        self.ln_q = _VisionRMSNorm(hidden, dtype, device)
        self.mlp = nn.Sequential(
            Linear(self.merged, self.merged, True, dtype, device, kernels=kernels),
            nn.GELU(),
            Linear(self.merged, config.tower_int("out_hidden_size"), True, dtype, device, kernels=kernels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class Qwen25VLEncoder(VisionEncoder):
    """Qwen2.5-VL's vision transformer (checkpoint names `visual.*`): 3-D patch embedding, 2-D
    rope over each patch's (row, column), window attention on every block but the
    `fullatt_block_indexes` ones (windows of window_size pixels, taken over groups of merged
    patches), and the patch merger into one decoder row per spatial_merge_size^2 patches."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        tower = config.tower
        self.channels = config.tower_int("in_channels", 3)
        self.temporal_patch, self.patch = config.tower_int("temporal_patch_size"), config.tower_int("patch_size")
        self.merge, self.window = config.tower_int("spatial_merge_size"), config.tower_int("window_size")
        self.full_attention = set(tower.get("fullatt_block_indexes") or [])
        hidden = config.tower_int("hidden_size")
        self.hidden = hidden
        kernel = (self.temporal_patch, self.patch, self.patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.channels, hidden, kernel, kernel, bias=False, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            _QwenVisionBlock(config, dtype, device, kernels) for _ in range(config.tower_int("depth"))
        )
        self.merger = _PatchMerger(config, dtype, device, kernels)
        head_dim = hidden // config.tower_int("num_heads")
        theta = float((tower.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        # not a parameter of the checkpoint: recomputed, as transformers does
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        t, h, w = grid
        proj = self.patch_embed.proj
        assert isinstance(proj, nn.Conv3d)
        patches = pixel_values.reshape(-1, self.channels, self.temporal_patch, self.patch, self.patch)
        x = proj(patches.to(proj.weight.dtype)).reshape(-1, self.hidden)
        unit = self.merge * self.merge
        order, windows = self._window_order(t, h, w)
        x = x.reshape(-1, unit, self.hidden)[order].reshape(-1, self.hidden)
        angles = self._rope_angles(t, h, w).reshape(-1, unit, self.inv_freq.numel() * 2)[order]
        angles = angles.reshape(x.shape[0], -1)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        whole = [h * w] * t
        for index, block in enumerate(self.blocks):
            x = block(x, whole if index in self.full_attention else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]

    def _rope_angles(self, t: int, h: int, w: int) -> torch.Tensor:
        """Each patch's (row, column) angles, patches in merge-block-major order."""
        device = self.inv_freq.device
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        shape = (h // self.merge, self.merge, w // self.merge, self.merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten().repeat(t)
        cols = cols.reshape(shape).transpose(1, 2).flatten().repeat(t)
        return torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)

    def _window_order(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merged groups window by window, and each window's length in patches."""
        size = self.window // self.merge // self.patch
        gh, gw = h // self.merge, w // self.merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = size - gh % size, size - gw % size
        nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        unit = self.merge * self.merge
        return flat[flat != -100], [int(c) * unit for c in counts if c > 0]


def qwen_vl_tokens_per_image(grid: tuple[int, ...], config: VisionConfig) -> int:
    """One `<|image_pad|>` per merged patch."""
    t, h, w = grid
    merge = config.tower_int("spatial_merge_size")
    return t * h * w // (merge * merge)


class _Qwen3VisionMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str, dtype, device, kernels: Kernels):
        super().__init__()
        self.linear_fc1 = Linear(hidden, inner, True, dtype, device, kernels=kernels)
        self.act = activation(act)
        self.linear_fc2 = Linear(inner, hidden, True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Qwen3VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype, device, kernels: Kernels):
        super().__init__()
        hidden = config.tower_int("hidden_size")
        self.norm1 = nn.LayerNorm(hidden, 1e-6, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(hidden, 1e-6, dtype=dtype, device=device)
        self.attn = _QwenVisionAttention(hidden, config.tower_int("num_heads"), dtype, device, kernels)
        act = str(config.tower.get("hidden_act", "gelu_pytorch_tanh"))
        self.mlp = _Qwen3VisionMLP(hidden, config.tower_int("intermediate_size"), act, dtype, device, kernels)

    def forward(self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Qwen3PatchMerger(nn.Module):
    """spatial_merge_size^2 patches into one row; the norm before (main merger) or after the
    shuffle (deepstack mergers)."""

    def __init__(self, config: VisionConfig, after_shuffle: bool, dtype, device, kernels: Kernels):
        super().__init__()
        hidden, merge = config.tower_int("hidden_size"), config.tower_int("spatial_merge_size")
        self.merged, self.after_shuffle = hidden * merge * merge, after_shuffle
        self.norm = nn.LayerNorm(self.merged if after_shuffle else hidden, 1e-6, dtype=dtype, device=device)
        self.linear_fc1 = Linear(self.merged, self.merged, True, dtype, device, kernels=kernels)
        self.act = nn.GELU()
        self.linear_fc2 = Linear(self.merged, config.tower_int("out_hidden_size"), True, dtype, device, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.after_shuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLEncoder(VisionEncoder):
    """Qwen3-VL's vision transformer (checkpoint names `visual.*`): 3-D patch embedding with a
    bias, a learned position table resampled (bilinear, corners aligned) to each image's grid,
    2-D rope, full attention per image, the patch merger, and the DeepStack mergers whose rows
    the decoder adds to its hidden states after its first layers. `encode` returns the main
    rows and the DeepStack rows side by side ([n, (1 + k) x hidden])."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device, kernels: Kernels):
        super().__init__()
        tower = config.tower
        self.channels = config.tower_int("in_channels", 3)
        self.temporal_patch, self.patch = config.tower_int("temporal_patch_size"), config.tower_int("patch_size")
        self.merge = config.tower_int("spatial_merge_size")
        hidden = config.tower_int("hidden_size")
        self.hidden = hidden
        kernel = (self.temporal_patch, self.patch, self.patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.channels, hidden, kernel, kernel, bias=True, dtype=dtype, device=device)
        positions = config.tower_int("num_position_embeddings")
        self.pos_embed = nn.Embedding(positions, hidden, dtype=dtype, device=device)
        self.side = int(positions**0.5)
        self.blocks = nn.ModuleList(
            _Qwen3VisionBlock(config, dtype, device, kernels) for _ in range(config.tower_int("depth"))
        )
        self.merger = _Qwen3PatchMerger(config, False, dtype, device, kernels)
        self.deepstack_indexes = [int(i) for i in tower.get("deepstack_visual_indexes") or []]
        self.deepstack_merger_list = nn.ModuleList(
            _Qwen3PatchMerger(config, True, dtype, device, kernels) for _ in self.deepstack_indexes
        )
        head_dim = hidden // config.tower_int("num_heads")
        theta = float((tower.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        t, h, w = grid
        proj = self.patch_embed.proj
        assert isinstance(proj, nn.Conv3d)
        patches = pixel_values.reshape(-1, self.channels, self.temporal_patch, self.patch, self.patch)
        x = proj(patches.to(proj.weight.dtype)).reshape(-1, self.hidden)
        x = x + self._positions(t, h, w).to(x.dtype)
        rows, cols = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
        shape = (h // self.merge, self.merge, w // self.merge, self.merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten().repeat(t)
        cols = cols.reshape(shape).transpose(1, 2).flatten().repeat(t)
        angles = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        frames = [h * w] * t
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if index in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(index)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned table resampled to the image's grid, in merge-block order, per frame."""
        table = self.pos_embed.weight.reshape(1, self.side, self.side, self.hidden).permute(0, 3, 1, 2)
        resized = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
        grid = resized.permute(1, 2, 0).reshape(h // self.merge, self.merge, w // self.merge, self.merge, -1)
        return grid.permute(0, 2, 1, 3, 4).reshape(h * w, -1).repeat(t, 1)
