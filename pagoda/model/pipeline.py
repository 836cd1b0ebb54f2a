"""Pipeline parallelism inside the model: which contiguous layers a stage holds.

A model split into P stages is P models, each holding only its slice of the decoder layers
(layers of other stages are `OtherStageLayer` placeholders, so parameter names keep the
checkpoint's layer indices), the embedding on the first stage and the final norm and LM head
on the last (with tied embeddings the last stage holds the embedding matrix too, as its head).
The stages pass hidden states along (pagoda.executor.pipeline); the decoder layers here carry
the residual stream in the hidden states themselves, so nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `num_stages`, holding decoder layers [first_layer, end_layer)."""

    index: int
    num_stages: int
    first_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    def holds_layer(self, layer: int) -> bool:
        return self.first_layer <= layer < self.end_layer


def pipeline_stages(num_layers: int, num_stages: int, partition: list[int] | None = None) -> list[PipelineStage]:
    """Contiguous slices of the layers, one per stage: `partition` (layers per stage), or an
    even split (the first stages take one more layer when it does not divide)."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} is larger than the model's {num_layers} layers: "
            f"every stage needs at least one layer"
        )
    if partition is None:
        size, extra = divmod(num_layers, num_stages)
        partition = [size + (1 if stage < extra else 0) for stage in range(num_stages)]
    elif len(partition) != num_stages:
        raise ValueError(
            f"pp_layer_partition has {len(partition)} stage(s) ({','.join(map(str, partition))}), "
            f"pipeline_parallel_size is {num_stages}"
        )
    elif any(count < 1 for count in partition):
        raise ValueError(f"pp_layer_partition {','.join(map(str, partition))}: every stage needs at least one layer")
    elif sum(partition) != num_layers:
        raise ValueError(
            f"pp_layer_partition {','.join(map(str, partition))} sums to {sum(partition)} layers, "
            f"the model has {num_layers}"
        )
    stages, first = [], 0
    for index, count in enumerate(partition):
        stages.append(PipelineStage(index, num_stages, first, first + count))
        first += count
    return stages


class OtherStageLayer(nn.Module):
    """Where another stage's decoder layer sits: no weights, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was called")
