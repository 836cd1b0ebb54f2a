"""A mixture-of-experts block: router, experts, and (Qwen2-MoE, DeepSeek-V3) a shared expert.

Experts are a layer like `Linear`: each expert is a gated MLP whose projections are `Linear`s,
so they are stored and multiplied in whatever weight format the model's other projections use
(int8, int4, GGUF types). Full-precision experts (and int8 ones in the native layout or on CUDA)
are also stacked at `finalize`, the operands of the grouped and fused products. The block's op
(routing, then the experts over the pairs sorted by expert, or the native fused op) is the
kernels' `moe` (pagoda.kernels.moe), which picks its implementation per device.

Compute therefore scales with the active experts' parameters, not all of them. gpt-oss's
experts add biases and gate with a clamped SwiGLU (pagoda.model.mlp.GatedActivation); its
router has a bias. DeepSeek-V3's router scores with a sigmoid and steers its choice with a learned
correction bias within groups of experts (pagoda.kernels.moe.SigmoidRouting), and its shared
expert is added ungated. Parallelism (see pagoda.model.parallel.ExpertPlacement): a rank computes the
experts it holds (each whole, or its shard of every expert) for all tokens and the partial
outputs meet in one all-reduce.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.kernels.moe import SigmoidRouting
from pagoda.model.layers import Linear
from pagoda.model.mlp import MLP, GatedActivation
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import FullWeight, WeightFormat


class Experts(nn.ModuleDict):
    """The experts this rank holds, keyed by their index in the model ("0", "1", ...), so
    parameters are named like checkpoints' `experts.{i}.gate_up_proj.weight`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
        bias: bool = False,
        gated: GatedActivation | None = None,
    ) -> None:
        placement = tp.experts(num_experts)
        super().__init__(
            {
                str(e): MLP(
                    hidden_size,
                    intermediate_size,
                    bias,
                    activation,
                    dtype,
                    device,
                    weight_format,
                    placement.weight_group,
                    kernels,
                    reduce=False,
                    gated=gated,
                )
                for e in range(placement.experts.start, placement.experts.start + placement.experts.size)
            }
        )
        self.placement = placement
        self.num_experts = num_experts
        self.gated = gated or GatedActivation(activation)
        # Full-precision experts, stacked at `finalize`: [held, 2I, H] and [held, H, I], and
        # their biases [held, 2I] and [held, H] where they have them.
        self.gate_up_weight: torch.Tensor | None = None
        self.down_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None
        # int8 experts in the native layout (CPU) or on CUDA, stacked at `finalize`:
        # [held, 2I, K'] and [held, H, I'] int8 rows (each expert's Linears hold views of them) and
        # their scales per row (the native kernels' float32 ones; on CUDA the format's).
        self.gate_up_qweight: torch.Tensor | None = None
        self.gate_up_scales: torch.Tensor | None = None
        self.down_qweight: torch.Tensor | None = None
        self.down_scales: torch.Tensor | None = None

    def finalize(self, name: str) -> None:
        """After loading. Full-precision experts are stacked into two tensors, the operands of
        the grouped products (and sliced for the loop's F.linear); quantized ones keep their
        Linears, int8 ones in the native layout or on CUDA also stacked (`stack_int8`)."""
        experts = self.held()
        if self.placement.weight_group.rank != 0:
            # Each rank's output is a partial sum of split experts: one rank adds the down bias.
            for expert in experts:
                if expert.down_proj.bias is not None:
                    expert.down_proj.bias.data.zero_()
        if any(
            e.gate_up_proj.weight_format.name != "full" or e.down_proj.weight_format.name != "full" for e in experts
        ):
            for index, expert in zip(self.keys(), experts):
                expert.gate_up_proj.finalize(f"{name}.{index}.gate_up_proj")
                expert.down_proj.finalize(f"{name}.{index}.down_proj")
            self.stack_int8(experts)
            return
        self.gate_up_weight = torch.stack([e.gate_up_proj.weight.detach() for e in experts])
        self.down_weight = torch.stack([e.down_proj.weight.detach() for e in experts])
        if experts[0].down_proj.bias is not None:
            self.gate_up_bias = torch.stack([_bias(e.gate_up_proj) for e in experts])
            self.down_bias = torch.stack([_bias(e.down_proj) for e in experts])
        for expert in experts:
            del expert.gate_up_proj.weight, expert.down_proj.weight
            if expert.down_proj.bias is not None:
                del expert.gate_up_proj.bias, expert.down_proj.bias

    def held(self) -> list[MLP]:
        """The experts this rank holds, in index order (ModuleDict types its values as Module;
        `__init__` puts only MLPs in)."""
        return cast("list[MLP]", list(self.values()))

    def stack_int8(self, experts: list[MLP]) -> None:
        """int8 experts: their rows and scales stacked once for the grouped and fused products (the
        native kernels' on CPU, Triton's on CUDA), the Linears keeping views (one copy in memory),
        biases stacked beside."""
        projections = [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
        if any(p.weight_format.name != "int8" for p in projections):
            return
        # The native layout's float32 scales where every projection has them, else the format's.
        native = all(getattr(p, "native_scales", None) is not None for p in projections)
        scales_name = "native_scales" if native else "scales"
        for kind in ("gate_up", "down"):
            layers = [getattr(e, f"{kind}_proj") for e in experts]
            qweight = torch.stack([layer.qweight for layer in layers])
            scales = torch.stack([getattr(layer, scales_name) for layer in layers])
            for index, layer in enumerate(layers):
                layer.qweight = qweight[index]
                setattr(layer, scales_name, scales[index])
            setattr(self, f"{kind}_qweight", qweight)
            setattr(self, f"{kind}_scales", scales)
            if layers[0].bias is not None:
                setattr(self, f"{kind}_bias", torch.stack([layer.bias.detach() for layer in layers]))

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert (its index in the model) on the rows x."""
        if self.gate_up_weight is None or self.down_weight is None:  # stacked together at `finalize`
            return self[str(expert)](x)
        local = expert - self.placement.experts.start
        module = self[str(expert)]
        # Stacked beside the weights where the experts have biases.
        gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[local]
        down_bias = None if self.down_bias is None else self.down_bias[local]
        gate_up = F.linear(x, self.gate_up_weight[local], gate_up_bias)
        gate, up = gate_up.split(module.intermediate_size, dim=-1)
        return F.linear(self.gated(gate, up), self.down_weight[local], down_bias)


class SparseMoE(nn.Module):
    """A decoder layer's MoE block in place of its MLP: `gate` (the router, kept in full
    precision and whole on every rank), `experts`, and optionally `shared_expert` scaled by
    sigmoid(`shared_expert_gate`(x)); routing and experts run as `kernels.moe`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        moe = config.moe
        assert moe is not None, "a SparseMoE is built only for a model with experts (ModelConfig.moe)"
        hidden = config.hidden_size
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.softmax_over_top_k = moe.softmax_over_top_k
        self.moe_config = moe
        self.tp = tp
        # DeepSeek's router: the bias that steers the choice (float32, as transformers keeps it).
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.sigmoid_routing:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32, device=device), requires_grad=False
            )
        # The router stays full precision, in the layout the model's weights take (native too).
        self.gate = Linear(
            hidden,
            moe.num_experts,
            moe.router_bias,
            dtype,
            device,
            FullWeight(weight_format is not None and weight_format.native_layout),
            kernels=kernels,
        )
        gated = GatedActivation(config.hidden_activation, moe.swiglu_limit, moe.swiglu_alpha)
        self.experts = Experts(
            moe.num_experts,
            hidden,
            moe.intermediate_size,
            config.hidden_activation,
            dtype,
            device,
            weight_format,
            tp,
            kernels,
            bias=moe.expert_bias,
            gated=gated,
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                hidden,
                moe.shared_expert_intermediate_size,
                False,
                config.hidden_activation,
                dtype,
                device,
                weight_format,
                tp,
                kernels,
                reduce=False,
            )
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden, 1, False, dtype, device, kernels=kernels)
        # Tokens routed to each expert since the last `take_expert_counts` (None: not counted).
        self.expert_counts: torch.Tensor | None = None

    def count_experts(self, enabled: bool) -> None:
        self.expert_counts = torch.zeros(self.experts.num_experts, dtype=torch.long) if enabled else None

    def take_expert_counts(self) -> list[int]:
        """Tokens routed to each expert since the last call (zeros when not counting)."""
        if self.expert_counts is None:
            return [0] * self.experts.num_experts
        counts = self.expert_counts.tolist()
        self.expert_counts.zero_()
        return counts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        out, counts = self.kernels.moe(
            self.experts,
            hidden,
            router_logits,
            self.top_k,
            self.renormalize,
            self.softmax_over_top_k,
            self.sigmoid_routing(),
        )
        if self.expert_counts is not None:
            self.expert_counts += counts.to(self.expert_counts.device)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(hidden)) * shared)
        return self.tp.all_reduce(out)  # the experts' (and shared expert's) partial sums

    def sigmoid_routing(self) -> SigmoidRouting | None:
        """DeepSeek's router over this block's correction bias (None: the softmax router)."""
        if self.e_score_correction_bias is None:
            return None
        moe = self.moe_config
        return SigmoidRouting(self.e_score_correction_bias, moe.num_groups, moe.top_k_groups, moe.routed_scaling_factor)


def _bias(layer: Linear) -> torch.Tensor:
    assert layer.bias is not None, "an expert's projections all have biases or none does"
    return layer.bias.detach()
