"""The MoE op: top-k routing and a block's experts, per device.

The block (pagoda.model.moe.SparseMoE) holds the router and the experts' storage; this op runs
them:

1. router logits [T, E] -> softmax -> top-k experts per token (weights renormalized over the
   chosen ones where the model says so; gpt-oss: top-k logits, then a softmax over those;
   DeepSeek-V3 and GLM-4.5: `SigmoidRouting`, sigmoid scores chosen with a correction bias
   within the best groups of experts, then scaled);
2. the T * k (token, expert) pairs sorted by expert with one stable argsort, giving each expert a
   contiguous segment (its offsets from one scatter-add), and the tokens gathered in that order once;
3. one gate/up and one down product per expert over its segment: on CPU, with full-precision
   experts (or int8 ones in the native layout), two grouped products over the stacked weights
   and the segment lengths, one op each for all experts: pagoda's native kernel (pagoda.native)
   where the engine runs them, which visits only the experts hit (float32 ones while segments are
   decode-sized), else `torch._grouped_mm` when enough experts are hit to pay its per-expert
   cost; otherwise a loop over the hit experts only (other quantized formats, a single
   sequence's few experts), never over tokens; on CUDA (with triton installed), the Triton
   fused-MoE kernel (kernels/triton/fused_moe.py: grouped GEMMs over expert-sorted blocks of
   rows) for full-precision and int8 experts, the loop for other formats;
4. each row scaled by its routing weight and scattered back with one `index_add_` (summing in
   expert order for each token, as transformers does; the Triton path sums each token's rows,
   also in expert order, without atomics).

On the native kernels, float32 inputs to int8 experts, and decode-sized ones (up to
FUSED_MAX_TOKENS tokens) to float32 experts, skip steps 2-4 in Python: the routing is one native
op and the experts another (`run_fused`, the native fused-MoE op: it groups the pairs by expert
itself, reads each hit expert's rows once for all its tokens and sums in expert order), float32
or int8 experts, SiLU or the clamped SwiGLU.

`MoEKernels` is the whole op for one device; `native` and `triton` are the implementations it
was given (None: not on this device), so the same class is the PyTorch reference with both None.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pagoda.native import MAX_ROWS as NATIVE_MAX_ROWS
from pagoda.native import NativeKernels

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


def top_k_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, softmax_over_top_k: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass(frozen=True)
class SigmoidRouting:
    """DeepSeek-V3's router (GLM-4.5's too): each expert scored by sigmoid(logit); the experts
    are chosen by score + `correction_bias` (the bias steers the choice only, never the weights),
    within the `top_k_groups` best of `num_groups` equal groups of experts (a group's score is
    the sum of its two best biased scores); the chosen experts' scores (renormalized where the
    model says so) are multiplied by `scaling_factor`."""

    correction_bias: torch.Tensor  # [E] float32
    num_groups: int = 1
    top_k_groups: int = 1
    scaling_factor: float = 1.0


def sigmoid_top_k(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, routing: SigmoidRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routing weights [T, k] (float32) and experts [T, k] under `routing`, in
    transformers' order of operations (float32 throughout)."""
    scores = router_logits.float().sigmoid()
    choice = scores + routing.correction_bias.float()
    if routing.num_groups > 1:
        tokens, num_experts = choice.shape
        grouped = choice.view(tokens, routing.num_groups, num_experts // routing.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = torch.topk(group_scores, k=routing.top_k_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling_factor, experts


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, softmax_over_top_k: bool = False) -> Routing:
    """Top-k experts per token from router logits [T, E], the pairs sorted by expert."""
    weights, experts = top_k_experts(router_logits, top_k, renormalize, softmax_over_top_k)
    return sort_pairs(weights, experts, router_logits.shape[-1])


def sort_pairs(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Routing:
    """Each token's routing weights and experts [T, k] as (token, expert) pairs sorted by expert."""
    top_k = experts.shape[-1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Not bincount, which sizes its output from the largest id: a host sync on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return Routing(order // top_k, weights.reshape(-1)[order], counts.scatter_add_(0, flat, torch.ones_like(flat)))


class MoEKernels:
    """Routing and experts of a MoE block for one device. `experts` is the block's
    pagoda.model.moe.Experts: its held experts (`placement.experts`), their stacked weights where
    `finalize` stacked them (full precision: gate_up_weight / down_weight; int8:
    gate_up_qweight / gate_up_scales ...), biases, `gated` activation and `run_expert`."""

    def __init__(
        self, device: torch.device, native: NativeKernels | None = None, triton: ModuleType | None = None
    ) -> None:
        self.grouped = device.type == "cpu"  # the grouped products (native, torch._grouped_mm) run on the CPU
        self.native = native
        self.triton = triton

    def __call__(
        self,
        experts: Any,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        softmax_over_top_k: bool,
        sigmoid: SigmoidRouting | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of sum_k weight_k * expert_k(x) for every token, tokens routed to
        each expert [E]) from router logits [T, E]; `sigmoid`: DeepSeek's router instead of the
        softmax (its choice is torch's on every device; the experts run as for any router)."""
        if sigmoid is not None:
            weights, chosen = sigmoid_top_k(router_logits, top_k, renormalize, sigmoid)
            if self.fuses(experts, hidden):
                counts = torch.bincount(chosen.reshape(-1), minlength=experts.num_experts)
                return self.run_fused(experts, hidden, weights, chosen), counts
            routing = sort_pairs(weights, chosen, experts.num_experts)
            return self.run_routed(experts, hidden, routing), routing.counts
        if self.fuses(experts, hidden):
            assert self.native is not None, "only the native kernels fuse"
            weights, chosen = self.native.route_top_k(router_logits, top_k, renormalize, softmax_over_top_k)
            counts = torch.bincount(chosen.reshape(-1), minlength=experts.num_experts)
            return self.run_fused(experts, hidden, weights, chosen), counts
        routing = route(router_logits, top_k, renormalize, softmax_over_top_k)
        return self.run_routed(experts, hidden, routing), routing.counts

    def path(self, experts: Any, hidden: torch.Tensor, rows: int, active: int) -> str:
        """How this step's `rows` (token, expert) pairs over `active` hit experts run: "native"
        (pagoda's grouped kernel: int8 experts always, float32 ones while the segments are
        decode-sized, as the full format's native product), "grouped_mm", or "loop"."""
        if not self.grouped or hidden.device.type != "cpu":
            return "loop"
        if experts.gate_up_qweight is not None:  # int8 experts in the native layout
            return "native" if hidden.dtype == torch.float32 and self.native is not None else "loop"
        if experts.gate_up_weight is None:
            return "loop"
        if self.native is not None and hidden.dtype == torch.float32 and rows <= NATIVE_MAX_ROWS * active:
            return "native"
        return "grouped_mm" if active * GROUPED_MIN_ACTIVE_SHARE >= experts.placement.experts.size else "loop"

    def fuses(self, experts: Any, hidden: torch.Tensor) -> bool:
        """Whether these rows run through the native fused-MoE op (`run_fused`): float32 inputs on
        the native kernels with SiLU or gpt-oss's clamped SwiGLU, int8 experts at every row count
        (one arithmetic however a step is batched, as their other products), float32 ones while
        the input is decode-sized."""
        gated = experts.gated
        if (
            self.native is None
            or hidden.device.type != "cpu"
            or hidden.dtype != torch.float32
            or (gated.swiglu_limit is None and gated.activation != "silu")
        ):
            return False
        if experts.gate_up_qweight is not None:
            return True
        return experts.gate_up_weight is not None and hidden.shape[0] <= FUSED_MAX_TOKENS

    def run_fused(
        self, experts: Any, hidden: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) in one native op, from each token's
        top-k routing weights and experts [T, k] (no sort or gather here: the op groups the pairs)."""
        assert self.native is not None, "the fused op is the native kernels'"
        quantized = experts.gate_up_qweight is not None
        return self.native.fused_moe(
            hidden,
            chosen,
            weights,
            experts.gate_up_qweight if quantized else experts.gate_up_weight,
            experts.gate_up_scales,
            experts.gate_up_bias,
            experts.down_qweight if quantized else experts.down_weight,
            experts.down_scales,
            experts.down_bias,
            experts.placement.experts.start,
            experts.gated.swiglu_limit,
            experts.gated.swiglu_alpha,
        )

    def run_routed(self, experts: Any, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) for every token (zeros for tokens
        none of its experts serve), from the pairs sorted by expert."""
        if self.runs_triton(experts, hidden):  # no host sync: CUDA graphs capture it
            return self.run_triton(experts, hidden, routing)
        out = torch.zeros_like(hidden)
        held = experts.placement.experts
        counts = routing.counts.tolist()  # the step's one host sync: segment offsets
        start = sum(counts[: held.start])
        held_counts = counts[held.start : held.start + held.size]
        stop = start + sum(held_counts)
        if stop == start:
            return out
        token_index = routing.token_index[start:stop]
        sorted_hidden = hidden[token_index]
        weights = routing.weights[start:stop].to(hidden.dtype).unsqueeze(-1)
        active = sum(1 for count in held_counts if count)
        path = self.path(experts, hidden, stop - start, active)
        if path != "loop":
            rows = self.run_grouped(
                experts,
                sorted_hidden,
                routing.counts[held.start : held.start + held.size],
                stop - start,
                path == "native",
            )
        else:
            pieces = []
            offset = 0
            for expert, count in enumerate(held_counts, start=held.start):
                if count:
                    pieces.append(experts.run_expert(expert, sorted_hidden[offset : offset + count]))
                    offset += count
            rows = torch.cat(pieces)
        return out.index_add_(0, token_index, rows * weights)

    def run_grouped(
        self, experts: Any, sorted_hidden: torch.Tensor, counts: torch.Tensor, rows: int, native: bool
    ) -> torch.Tensor:
        """Every held expert on its segment of the expert-sorted rows, in two grouped products
        (one op each over all experts): the native kernel's, or torch._grouped_mm's."""
        gated = experts.gated
        if experts.gate_up_qweight is not None:
            assert self.native is not None, "`path` groups int8 experts only on the native kernels"
            gate_up = self.native.grouped_linear_int8(
                sorted_hidden, experts.gate_up_qweight, experts.gate_up_scales, counts, experts.gate_up_bias
            )
            gate, up = gate_up.split(experts.gate_up_qweight.shape[1] // 2, dim=-1)
            return self.native.grouped_linear_int8(
                gated(gate, up), experts.down_qweight, experts.down_scales, counts, experts.down_bias
            )
        if native:
            assert self.native is not None, "the native path is chosen only with the native kernels"
            gate_up = self.native.grouped_linear_f32(
                sorted_hidden, experts.gate_up_weight, counts, experts.gate_up_bias
            )
            gate, up = gate_up.split(experts.gate_up_weight.shape[1] // 2, dim=-1)
            return self.native.grouped_linear_f32(gated(gate, up), experts.down_weight, counts, experts.down_bias)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(sorted_hidden, experts.gate_up_weight.transpose(1, 2), offs=offsets)
        expert_of_row = None
        if experts.gate_up_bias is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(counts.shape[0], device=counts.device), counts, output_size=rows
            )
            gate_up = gate_up + experts.gate_up_bias[expert_of_row]
        gate, up = gate_up.split(experts.gate_up_weight.shape[1] // 2, dim=-1)
        down = torch._grouped_mm(gated(gate, up), experts.down_weight.transpose(1, 2), offs=offsets)
        return down if expert_of_row is None else down + experts.down_bias[expert_of_row]

    def runs_triton(self, experts: Any, hidden: torch.Tensor) -> bool:
        """On CUDA, stacked experts (full precision, int8) run through the Triton kernel where
        triton is installed; other formats loop over the hit experts."""
        stacked = experts.gate_up_weight is not None or experts.gate_up_qweight is not None
        return self.triton is not None and hidden.device.type == "cuda" and stacked

    def run_triton(self, experts: Any, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every pair through the Triton kernel (two launches), weighted and summed per token
        (each token's experts in expert order, no atomics); experts this rank does not hold add
        nothing."""
        kernels = self.triton
        assert kernels is not None, "run only where `runs_triton` holds"
        if experts.gate_up_qweight is not None:
            first = next(iter(experts.values()))
            weights = kernels.ExpertWeights(
                experts.gate_up_qweight,
                experts.down_qweight,
                experts.gate_up_bias,
                experts.down_bias,
                experts.gate_up_scales,
                experts.down_scales,
                first.gate_up_proj.in_features,
                first.down_proj.in_features,
            )
        else:
            weights = kernels.ExpertWeights(
                experts.gate_up_weight, experts.down_weight, experts.gate_up_bias, experts.down_bias
            )
        return kernels.grouped_experts(
            hidden,
            routing.token_index,
            routing.weights,
            routing.counts,
            weights,
            experts.gated,
            experts.placement.experts.start,
        )
