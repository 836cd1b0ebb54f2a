"""A mixture-of-experts block: router, experts, and (Qwen2-MoE) a shared expert.

Experts are a layer like `Linear`: each expert is a gated MLP whose projections are `Linear`s,
so they are stored and multiplied in whatever weight format the model's other projections use
(int8, int4, GGUF types). The block's op:

1. router logits [T, E] -> softmax -> top-k experts per token (weights renormalized over the
   chosen ones where the model says so; gpt-oss: top-k logits, then a softmax over those);
2. the T * k (token, expert) pairs sorted by expert with one stable argsort, giving each expert a
   contiguous segment (its offsets from one bincount), and the tokens gathered in that order once;
3. one gate/up and one down product per expert over its segment: on CPU, with full-precision
   experts (or int8 ones on the native kernels), two grouped products over the stacked weights
   and the segment lengths, one op each for all experts: pagoda's native kernel (pagoda.native)
   when the model has them, which visits only the experts hit (float32 ones while segments are
   decode-sized), else `torch._grouped_mm` when enough experts are hit to pay its per-expert
   cost; otherwise a loop over the hit experts only (other quantized formats, a single
   sequence's few experts), never over tokens; on CUDA (with triton installed), the Triton
   fused-MoE kernel (pagoda.kernels.triton.fused_moe: grouped GEMMs over expert-sorted blocks of rows)
   for full-precision and int8 experts, the loop for other formats;
4. each row scaled by its routing weight and scattered back with one `index_add_` (summing in
   expert order for each token, as transformers does; the Triton path sums each token's rows,
   also in expert order, without atomics).

On the native kernels, float32 inputs to int8 experts, and decode-sized ones (up to
FUSED_MAX_TOKENS tokens) to float32 experts, skip steps 2-4 in Python: the routing is one native
op and the experts another (`Experts.run_fused`, the native fused-MoE op: it groups the pairs by
expert itself, reads each hit expert's rows once for all its tokens and sums in expert order),
float32 or int8 experts, SiLU or the clamped SwiGLU.

Compute therefore scales with the active experts' parameters, not all of them. gpt-oss's
experts add biases and gate with a clamped SwiGLU (pagoda.model.mlp.GatedActivation); its
router has a bias. Parallelism (see pagoda.model.parallel.ExpertPlacement): a rank computes the
experts it holds (each whole, or its shard of every expert) for all tokens and the partial
outputs meet in one all-reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.layers import Linear
from pagoda.model.mlp import MLP, GatedActivation
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.native import MAX_ROWS as NATIVE_MAX_ROWS
from pagoda.quant.weight_formats import FullWeight, WeightFormat

# The grouped products (one op per projection over all held experts) pay a small fixed cost per
# held expert, hit or not; a loop over the hit experts pays a larger one per hit expert. Grouped
# wins once at least 1/this of the held experts are hit (decode batches beyond a few sequences).
GROUPED_MIN_ACTIVE_SHARE = 6
# Inputs of up to this many tokens (decode steps) run the native fused-MoE op on the native
# kernels; larger ones (prefill chunks, float32 experts) sort and run the grouped products, left
# to torch's blocked GEMM once every expert has many rows (benchmarks/moe.py's block rows).
FUSED_MAX_TOKENS = 128


@dataclass(frozen=True)
class Routing:
    """A step's (token, expert) pairs sorted by expert."""

    token_index: torch.Tensor  # [T * k] the token of each pair
    weights: torch.Tensor  # [T * k] float32 routing weight of each pair
    counts: torch.Tensor  # [E] pairs per expert: the segment lengths, in expert order


def top_k_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  softmax_over_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routing weights [T, k] (float32) and experts [T, k] from router logits [T, E]
    (softmax in float32 as transformers)."""
    if softmax_over_top_k:
        logits, experts = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(logits, dim=-1, dtype=torch.float32), experts
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, softmax_over_top_k: bool = False) -> Routing:
    """Top-k experts per token from router logits [T, E], the pairs sorted by expert."""
    weights, experts = top_k_experts(router_logits, top_k, renormalize, softmax_over_top_k)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Not bincount, which sizes its output from the largest id: a host sync on CUDA.
    counts = torch.zeros(router_logits.shape[-1], dtype=torch.long, device=flat.device)
    return Routing(order // top_k, weights.reshape(-1)[order], counts.scatter_add_(0, flat, torch.ones_like(flat)))


class Experts(nn.ModuleDict):
    """The experts this rank holds, keyed by their index in the model ("0", "1", ...), so
    parameters are named like checkpoints' `experts.{i}.gate_up_proj.weight`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 dtype: torch.dtype, device: torch.device, weight_format: WeightFormat | None,
                 tp: TensorParallelGroup, bias: bool = False, gated: GatedActivation | None = None) -> None:
        placement = tp.experts(num_experts)
        super().__init__({str(e): MLP(hidden_size, intermediate_size, bias, activation, dtype, device, weight_format,
                                      placement.weight_group, reduce=False, gated=gated)
                          for e in range(placement.experts.start, placement.experts.start + placement.experts.size)})
        self.placement = placement
        self.num_experts = num_experts
        self.gated = gated or GatedActivation(activation)
        self.native = getattr(weight_format, "native", None)  # the native CPU kernels, where the format has them
        # Full-precision experts, stacked at `finalize`: [held, 2I, H] and [held, H, I], and
        # their biases [held, 2I] and [held, H] where they have them.
        self.gate_up_weight: torch.Tensor | None = None
        self.down_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None
        # int8 experts on the native kernels (CPU) or Triton (CUDA), stacked at `finalize`:
        # [held, 2I, K'] and [held, H, I'] int8 rows (each expert's Linears hold views of them) and
        # their scales per row (the native kernels' float32 ones; on CUDA the format's).
        self.gate_up_qweight: torch.Tensor | None = None
        self.gate_up_scales: torch.Tensor | None = None
        self.down_qweight: torch.Tensor | None = None
        self.down_scales: torch.Tensor | None = None

    def finalize(self, name: str) -> None:
        """After loading. Full-precision experts are stacked into two tensors, the operands of
        the grouped products (and sliced for the loop's F.linear); quantized ones keep their
        Linears and format kernels, int8 ones on the native kernels also stacked
        (`stack_native_int8`)."""
        experts = list(self.values())
        if self.placement.weight_group.rank != 0:
            # Each rank's output is a partial sum of split experts: one rank adds the down bias.
            for expert in experts:
                if expert.down_proj.bias is not None:
                    expert.down_proj.bias.data.zero_()
        if any(e.gate_up_proj.weight_format.name != "full" or e.down_proj.weight_format.name != "full"
               for e in experts):
            for index, expert in zip(self.keys(), experts):
                expert.gate_up_proj.finalize(f"{name}.{index}.gate_up_proj")
                expert.down_proj.finalize(f"{name}.{index}.down_proj")
            self.stack_int8(experts)
            return
        self.gate_up_weight = torch.stack([e.gate_up_proj.weight.detach() for e in experts])
        self.down_weight = torch.stack([e.down_proj.weight.detach() for e in experts])
        if experts[0].down_proj.bias is not None:
            self.gate_up_bias = torch.stack([e.gate_up_proj.bias.detach() for e in experts])
            self.down_bias = torch.stack([e.down_proj.bias.detach() for e in experts])
        for expert in experts:
            del expert.gate_up_proj.weight, expert.down_proj.weight
            if expert.down_proj.bias is not None:
                del expert.gate_up_proj.bias, expert.down_proj.bias

    def stack_int8(self, experts: list[MLP]) -> None:
        """int8 experts with native products (CPU) or on CUDA (the Triton kernel): their rows and
        scales stacked once for the grouped product, the Linears keeping views (one copy in
        memory), biases stacked beside."""
        projections = [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
        if all(getattr(p, "native_scales", None) is not None for p in projections):
            scales_name = "native_scales"
        elif all(p.weight_format.name == "int8" and p.qweight.device.type == "cuda" for p in projections):
            scales_name = "scales"
        else:
            return
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

    def path(self, hidden: torch.Tensor, rows: int, active: int) -> str:
        """How this step's `rows` (token, expert) pairs over `active` hit experts run: "native"
        (pagoda's grouped kernel: int8 experts always, float32 ones while the segments are
        decode-sized, as `FullWeight` picks its native product), "grouped_mm", or "loop"."""
        if hidden.device.type != "cpu":
            return "loop"
        if self.gate_up_qweight is not None:  # int8 experts on the native kernels
            return "native" if hidden.dtype == torch.float32 else "loop"
        if self.gate_up_weight is None:
            return "loop"
        if self.native is not None and hidden.dtype == torch.float32 and rows <= NATIVE_MAX_ROWS * active:
            return "native"
        return "grouped_mm" if active * GROUPED_MIN_ACTIVE_SHARE >= self.placement.experts.size else "loop"

    def fuses(self, hidden: torch.Tensor) -> bool:
        """Whether these rows run through the native fused-MoE op (`run_fused`): float32 inputs on
        the native kernels with SiLU or gpt-oss's clamped SwiGLU, int8 experts at every row count
        (one arithmetic however a step is batched, as their other products), float32 ones while
        the input is decode-sized."""
        if (self.native is None or hidden.device.type != "cpu" or hidden.dtype != torch.float32
                or (self.gated.swiglu_limit is None and self.gated.activation != "silu")):
            return False
        if self.gate_up_qweight is not None:
            return True
        return self.gate_up_weight is not None and hidden.shape[0] <= FUSED_MAX_TOKENS

    def run_fused(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) in one native op, from each token's
        top-k routing weights and experts [T, k] (no sort or gather here: the op groups the pairs)."""
        quantized = self.gate_up_qweight is not None
        return self.native.fused_moe(
            hidden, experts, weights,
            self.gate_up_qweight if quantized else self.gate_up_weight, self.gate_up_scales, self.gate_up_bias,
            self.down_qweight if quantized else self.down_weight, self.down_scales, self.down_bias,
            self.placement.experts.start, self.gated.swiglu_limit, self.gated.swiglu_alpha)

    def forward(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) for every token (zeros for tokens
        none of its experts serve)."""
        if self.runs_triton(hidden):  # no host sync: CUDA graphs capture it
            return self.run_triton(hidden, routing)
        out = torch.zeros_like(hidden)
        held = self.placement.experts
        counts = routing.counts.tolist()  # the step's one host sync: segment offsets
        start = sum(counts[:held.start])
        held_counts = counts[held.start:held.start + held.size]
        stop = start + sum(held_counts)
        if stop == start:
            return out
        token_index = routing.token_index[start:stop]
        sorted_hidden = hidden[token_index]
        weights = routing.weights[start:stop].to(hidden.dtype).unsqueeze(-1)
        active = sum(1 for count in held_counts if count)
        path = self.path(hidden, stop - start, active)
        if path != "loop":
            rows = self.run_grouped(sorted_hidden, routing.counts[held.start:held.start + held.size], stop - start,
                                    path == "native")
        else:
            pieces = []
            offset = 0
            for expert, count in enumerate(held_counts, start=held.start):
                if count:
                    pieces.append(self.run_expert(expert, sorted_hidden[offset:offset + count]))
                    offset += count
            rows = torch.cat(pieces)
        return out.index_add_(0, token_index, rows * weights)

    def run_grouped(self, sorted_hidden: torch.Tensor, counts: torch.Tensor, rows: int, native: bool) -> torch.Tensor:
        """Every held expert on its segment of the expert-sorted rows, in two grouped products
        (one op each over all experts): the native kernel's, or torch._grouped_mm's."""
        if self.gate_up_qweight is not None:
            gate_up = self.native.grouped_linear_int8(sorted_hidden, self.gate_up_qweight, self.gate_up_scales, counts,
                                                      self.gate_up_bias)
            gate, up = gate_up.split(self.gate_up_qweight.shape[1] // 2, dim=-1)
            return self.native.grouped_linear_int8(self.gated(gate, up), self.down_qweight, self.down_scales, counts,
                                                   self.down_bias)
        if native:
            gate_up = self.native.grouped_linear_f32(sorted_hidden, self.gate_up_weight, counts, self.gate_up_bias)
            gate, up = gate_up.split(self.gate_up_weight.shape[1] // 2, dim=-1)
            return self.native.grouped_linear_f32(self.gated(gate, up), self.down_weight, counts, self.down_bias)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(sorted_hidden, self.gate_up_weight.transpose(1, 2), offs=offsets)
        expert_of_row = None
        if self.gate_up_bias is not None:
            expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                                    output_size=rows)
            gate_up = gate_up + self.gate_up_bias[expert_of_row]
        gate, up = gate_up.split(self.gate_up_weight.shape[1] // 2, dim=-1)
        down = torch._grouped_mm(self.gated(gate, up), self.down_weight.transpose(1, 2), offs=offsets)
        return down if expert_of_row is None else down + self.down_bias[expert_of_row]

    def runs_triton(self, hidden: torch.Tensor) -> bool:
        """On CUDA, stacked experts (full precision, int8) run through the Triton kernel where
        triton is installed; other formats loop over the hit experts."""
        stacked = self.gate_up_weight is not None or self.gate_up_qweight is not None
        return hidden.device.type == "cuda" and stacked and triton_moe() is not None

    def run_triton(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every pair through the Triton kernel (two launches), weighted and summed per token
        (each token's experts in expert order, no atomics); experts this rank does not hold add
        nothing."""
        kernels = triton_moe()
        if self.gate_up_qweight is not None:
            first = next(iter(self.values()))
            weights = kernels.ExpertWeights(self.gate_up_qweight, self.down_qweight, self.gate_up_bias, self.down_bias,
                                            self.gate_up_scales, self.down_scales,
                                            first.gate_up_proj.in_features, first.down_proj.in_features)
        else:
            weights = kernels.ExpertWeights(self.gate_up_weight, self.down_weight, self.gate_up_bias, self.down_bias)
        return kernels.grouped_experts(hidden, routing.token_index, routing.weights, routing.counts, weights,
                                       self.gated, self.placement.experts.start)

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert (its index in the model) on the rows x."""
        if self.gate_up_weight is None:
            return self[str(expert)](x)
        local = expert - self.placement.experts.start
        module = self[str(expert)]
        biased = self.down_bias is not None
        gate_up = F.linear(x, self.gate_up_weight[local], self.gate_up_bias[local] if biased else None)
        gate, up = gate_up.split(module.intermediate_size, dim=-1)
        return F.linear(self.gated(gate, up), self.down_weight[local], self.down_bias[local] if biased else None)


@functools.cache
def triton_moe() -> ModuleType | None:
    """The Triton fused-MoE kernels, or None where triton is not installed (experts on CUDA then
    loop over the hit experts)."""
    try:
        from pagoda.kernels.triton import fused_moe as kernels
    except ImportError:
        return None
    return kernels


class SparseMoE(nn.Module):
    """A decoder layer's MoE block in place of its MLP: `gate` (the router, kept in full
    precision and whole on every rank), `experts`, and optionally `shared_expert` scaled by
    sigmoid(`shared_expert_gate`(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 weight_format: WeightFormat | None, tp: TensorParallelGroup) -> None:
        super().__init__()
        moe = config.moe
        hidden = config.hidden_size
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.softmax_over_top_k = moe.softmax_over_top_k
        self.tp = tp
        # The router stays full precision but takes the full format's kernels (native ones too).
        self.gate = Linear(hidden, moe.num_experts, moe.router_bias, dtype, device,
                           FullWeight(getattr(weight_format, "native", None)))
        gated = GatedActivation(config.hidden_activation, moe.swiglu_limit, moe.swiglu_alpha)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, config.hidden_activation, dtype,
                               device, weight_format, tp, bias=moe.expert_bias, gated=gated)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, moe.shared_expert_intermediate_size, False, config.hidden_activation,
                                     dtype, device, weight_format, tp, reduce=False)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype, device)
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
        if self.experts.fuses(hidden):
            weights, experts = self.experts.native.route_top_k(router_logits, self.top_k, self.renormalize,
                                                               self.softmax_over_top_k)
            if self.expert_counts is not None:
                self.expert_counts += torch.bincount(experts.reshape(-1), minlength=self.experts.num_experts)
            out = self.experts.run_fused(hidden, weights, experts)
        else:
            routing = route(router_logits, self.top_k, self.renormalize, self.softmax_over_top_k)
            if self.expert_counts is not None:
                self.expert_counts += routing.counts.to(self.expert_counts.device)
            out = self.experts(hidden, routing)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.tp.all_reduce(out)  # the experts' (and shared expert's) partial sums
