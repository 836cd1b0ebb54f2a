"""Load a Hugging Face checkpoint directory (one or many safetensors shards) into the model."""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagoda.artifacts.digests import PICKLE_PATTERNS
from pagoda.kernels import Kernels
from pagoda.model.classifier_config import token_classifier
from pagoda.model.decoder import DecoderModel
from pagoda.model.families.base import ModelFamily, family_of, gguf_config, gguf_reading
from pagoda.model.layers import Linear
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe import Experts
from pagoda.model.parallel import TensorParallelGroup, VocabParallelEmbedding
from pagoda.model.pipeline import PipelineStage
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, find_gguf_file, gguf_weight_format
from pagoda.quant.hf_quantized import check_checkpoint_quantization, gptq_tensors, resolve_checkpoint_format
from pagoda.quant.weight_formats import GGUFBlocks, GGUFBlockWeight, Int4Weight, WeightFormat

# Checkpoint tensors that are fused into one parameter: (fused name, part, part index). A
# checkpoint's already fused tensor (Phi-3) maps to the whole parameter, its shard taking each
# part's rows.
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Qwen3.5's Gated DeltaNet projections (pagoda.model.gated_delta_net)
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# transformers 5's in-memory layout: all experts of a layer in one tensor, [E, 2I, H] with gate
# rows before up rows, and [E, H, I].
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked against the index if there is one."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ValueError(f"{index_path}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in model_dir.glob(pattern))
        if pickles:
            raise ValueError(
                f"{model_dir}: only pickle weights ({', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''}); "
                f"pagoda refuses pickle checkpoints on purpose (loading one can run any code it holds). Convert "
                f'it once to safetensors where you trust it: python -c "from transformers import '
                f"AutoModelForCausalLM as M, AutoTokenizer as T; M.from_pretrained('{model_dir}')"
                f".save_pretrained('OUT', safe_serialization=True); T.from_pretrained('{model_dir}')"
                f".save_pretrained('OUT')\" and serve OUT"
            )
        raise ValueError(f"{model_dir}: no *.safetensors weights found")
    return shards


def iterate_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        name = None
        try:
            with safe_open(str(path), framework="pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    yield path, name, tensor
        except SafetensorError as error:  # truncated or corrupt file
            where = f"tensor {name!r}" if name is not None else "header"
            raise ValueError(f"{path}: unreadable safetensors file, corrupt or truncated ({where}: {error})") from None


def load_model_config(
    model: str | Path, score_tokens: str | None = None, tokenizer: str | Path | None = None
) -> ModelConfig:
    """The config of a Hugging Face directory or of a GGUF file (or a directory holding one).
    `score_tokens` ("no,yes"): read the LM as a reranker by those tokens' logits (--score-tokens);
    a classifier read from tokens has their ids looked up in the tokenizer (`tokenizer`, else
    the model's)."""
    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        model_config = ModelConfig.from_dict(gguf_config(GGUFCheckpoint(gguf_file)), source=str(gguf_file))
    else:
        check_checkpoint_quantization(Path(model))
        model_config = ModelConfig.from_dir(model)
    if score_tokens and model_config.classifier is not None and not model_config.classifier.generates:
        raise ValueError(f"{model}: --score-tokens reads a causal LM's head; this checkpoint has its own classifier")
    classifier = token_classifier(score_tokens, "--score-tokens") if score_tokens else model_config.classifier
    if classifier is None or classifier.from_tokens is None:
        return model_config
    from pagoda.tokenizer import Tokenizer  # only a reranker read from tokens needs it here

    hf = Tokenizer.from_pretrained(tokenizer or model).hf
    ids = []
    for token in classifier.from_tokens:
        token_id = hf.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or (token_id == hf.unk_token_id and token != hf.unk_token):
            raise ValueError(f"{model}: the classifier's token {token!r} is not in the tokenizer's vocabulary")
        ids.append(int(token_id))
    return replace(model_config, classifier=classifier.with_token_ids(tuple(ids)))


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat | None = None,
    tp: TensorParallelGroup | None = None,
    stage: PipelineStage | None = None,
    kernels: Kernels | None = None,
) -> DecoderModel:
    """The model with its weights; with `tp`, this rank's shards of them only; with `stage`,
    that pipeline stage's layers only; its layers call `kernels` (None: PyTorch's for `device`)."""
    kernels = kernels or Kernels(device)
    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:
        return _load_gguf(gguf_file, config, dtype, device, weight_format, tp, stage, kernels)
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    requested = weight_format.name if weight_format is not None else "none"
    checkpoint_format, quantization = resolve_checkpoint_format(model_dir, "none" if requested == "full" else requested)
    if checkpoint_format is not None:  # a GPTQ checkpoint: its codes load as they are
        weight_format = checkpoint_format
        kernels.linear.check(weight_format, device, dtype)
    model = build_empty_model(config, dtype, device, weight_format, str(model_dir), tp, stage, kernels)
    plain = ((path.name, name, tensor) for path, name, tensor in iterate_tensors(files))
    if quantization is not None:
        tensors = gptq_tensors(plain, quantization)
    else:
        tensors = ((file_name, name, tensor, None) for file_name, name, tensor in plain)
    _fill(model, tensors, config, dtype, str(model_dir))
    return model.eval()


def checkpoint_items(model_dir: str | Path) -> Iterator[tuple[str, str, torch.Tensor | None, tuple | None]]:
    """A safetensors checkpoint directory's tensors as `_fill` takes them (file, name, tensor,
    None); GPTQ checkpoints and GGUF files are refused (a weight update carries plain tensors)."""
    model_dir = Path(model_dir)
    if find_gguf_file(model_dir) is not None:
        raise ValueError(f"{model_dir}: a GGUF file; weight updates read safetensors checkpoints")
    files = checkpoint_files(model_dir)
    return ((path.name, name, tensor, None) for path, name, tensor in iterate_tensors(files))


def stage_weights(
    model: DecoderModel,
    tensors: Iterable[tuple[str, str, torch.Tensor | None, tuple | None]],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat,
    source: str,
    tp: TensorParallelGroup | None = None,
    stage: PipelineStage | None = None,
    check_layout: bool = True,
    fresh: DecoderModel | None = None,
) -> DecoderModel:
    """New weights for the live `model` (every tensor of a checkpoint) in a fresh model of the
    same shape (`fresh`: one built already, some of whose tensors may have been received in place:
    `receive_targets`), which `commit_weights` copies in: a missing tensor, a wrong shape or dtype
    or an unreadable file raises ValueError here with the live model untouched. Costs one model's
    memory until committed or dropped."""
    if fresh is None:
        fresh = build_empty_model(config, dtype, device, weight_format, source, tp, stage, model.kernels)
    _fill(fresh, _floating(tensors), config, dtype, source)
    live, new = _tensors(model), _tensors(fresh)
    if check_layout and (
        set(live) != set(new) or any(live[k].shape != new[k].shape or live[k].dtype != new[k].dtype for k in new)
    ):
        raise ValueError(
            f"{source}: the loaded weights do not lay out as the served model's (a weight format "
            f"that packs weights differently per load cannot be updated in place)"
        )
    return fresh


def receive_targets(
    fresh: DecoderModel, config: ModelConfig, announced: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor | None]:
    """For each announced checkpoint tensor (name, dtype, shape), the piece of `fresh`'s
    parameter it can be received into directly — the whole parameter or one fused part's rows,
    of its dtype and exact shape, nothing transformed in between — or None: that one arrives in a
    buffer of its own and `_fill` copies it (or refuses it) as for any checkpoint. `_fill` then
    finds the pieces already in place."""
    targets: list[torch.Tensor | None] = [None] * len(announced)
    if family_of(config).checkpoint_tensors is not ModelFamily.checkpoint_tensors:
        return targets  # the family renames or reshapes its checkpoints' tensors
    params = dict(fresh.named_parameters())
    skipped = {_classifier_head_source(fresh, config)} | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for index, (name, dtype, shape) in enumerate(announced):
        if name in skipped or name.endswith(_IGNORED_SUFFIXES) or _FUSED_EXPERTS.match(name):
            continue
        target, part = _locate(name)
        param = params.get(target)
        if param is None or param.dtype != dtype:
            continue
        module_name, param_name = target.rsplit(".", 1)
        shard = getattr(fresh.get_submodule(module_name), "shard", None)
        if shard is not None and (shard.is_split or tuple(shape) != shard.full_shape(part, param_name)):
            continue
        announced_tensor = torch.empty(shape, dtype=dtype, device="meta")  # shapes only: nothing is read
        offset, piece = (0, announced_tensor) if shard is None else shard.take(announced_tensor, part, param_name)
        if not piece.shape or piece.shape[0] > param.shape[0]:
            continue
        view = param.data.narrow(0, offset, piece.shape[0])
        if tuple(view.shape) == tuple(shape) and view.is_contiguous():
            targets[index] = view
    return targets


def commit_weights(model: DecoderModel, staged: DecoderModel) -> None:
    """Copy what `stage_weights` staged into the live model's storage, in place (CUDA graphs, the
    runner and adapters keep pointing at the same tensors)."""
    live = _tensors(model)
    with torch.no_grad():
        for name, tensor in _tensors(staged).items():
            live[name].copy_(tensor)


def drop_weights(model: DecoderModel) -> None:
    """Free every parameter and buffer of `model` (each becomes an empty tensor of its dtype) until
    `adopt_weights` gives it new ones: sleep mode on the CPU, where packed weights have no
    storage to shrink in place."""
    for module in model.modules():  # the tensors themselves are swapped, so their tables are written
        for name, param in module._parameters.items():  # noqa: SLF001
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(0, dtype=param.dtype),  # noqa: SLF001
                    requires_grad=False,
                )
        for name, buffer in module._buffers.items():  # noqa: SLF001
            if buffer is not None:
                module._buffers[name] = torch.empty(0, dtype=buffer.dtype)  # noqa: SLF001


def adopt_weights(model: DecoderModel, staged: DecoderModel) -> None:
    """Give the live `model` the staged model's tensors themselves (after drop_weights)."""
    for name, module in staged.named_modules():
        live = model.get_submodule(name)
        live._parameters.update(module._parameters)  # noqa: SLF001
        live._buffers.update(module._buffers)  # noqa: SLF001


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _floating(
    tensors: Iterable[tuple[str, str, torch.Tensor | None, tuple | None]],
) -> Iterator[tuple[str, str, torch.Tensor | None, tuple | None]]:
    """A plain checkpoint's tensors, refusing integer or boolean ones: cast silently into a float
    parameter they would serve garbage."""
    for file_name, name, tensor, codes in tensors:
        if tensor is not None and not (tensor.is_floating_point() or name.endswith(_IGNORED_SUFFIXES)):
            raise ValueError(f"{file_name}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point one")
        yield file_name, name, tensor, codes


def _load_gguf(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat | None,
    tp: TensorParallelGroup | None,
    stage: PipelineStage | None,
    kernels: Kernels,
) -> DecoderModel:
    checkpoint = GGUFCheckpoint(path)
    reading = gguf_reading(checkpoint)
    weight_format = gguf_weight_format(checkpoint, weight_format, whole_layers=tp is None or tp.world_size == 1)
    kernels.linear.check(weight_format, device, dtype)
    model = build_empty_model(config, dtype, device, weight_format, str(path), tp, stage, kernels)
    blocks = isinstance(weight_format, GGUFBlockWeight)
    keep_codes = isinstance(weight_format, Int4Weight) and weight_format.group_size == 32
    # The fourth item: GGUF blocks, int4 codes, or None (`_fill` tells them apart).
    tensors: Iterator[tuple[str, str, torch.Tensor | None, Any]] = (
        (path.name, t.hf_name, t.tensor, t.blocks if t.blocks is not None else t.int4_codes)
        for t in checkpoint.iterate(
            reading.config(checkpoint), reading.layout, keep_q4_0_codes=keep_codes, keep_blocks=blocks
        )
    )
    _fill(model, tensors, config, dtype, str(path))
    _return_freed_heap()
    return model.eval()


def _return_freed_heap() -> None:
    """Hand glibc's freed heap back to the system: reading a GGUF file copies each tensor once and
    some twice (unpermuted q/k rows, fused parts concatenated), and the freed chunks would otherwise
    stay in the process's RSS beside the blocks kept."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _fill(
    model: DecoderModel,
    tensors: Iterator[tuple[str, str, torch.Tensor | None, tuple | None]],
    config: ModelConfig,
    dtype: torch.dtype,
    source: str,
) -> None:
    """Copy (file, name, float tensor or None, int4 codes or GGUF blocks or None) items into the
    model, then let the weight formats finalize."""
    family = family_of(config)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    ready = _ReadyLinears(model)
    # A reranker read from tokens: its head comes from rows of the LM head (or tied embedding).
    head_source = _classifier_head_source(model, config)
    for file_name, name, tensor, int4_codes in _per_expert(family.checkpoint_tensors(tensors)):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == head_source:
            if tensor is None:
                raise ValueError(
                    f"{file_name}: {name!r} comes quantized; a classifier read from its tokens "
                    f"needs it in full precision"
                )
            assert model.score is not None  # a head source is only named for a model with a head
            model.score.fill_from_head(tensor)
            loaded.add("score.weight")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target, part = _locate(name)
        if target not in params:
            if _held_by_another_rank(model, target) or _held_by_another_stage(model, target):
                continue
            raise ValueError(f"{file_name}: unexpected tensor {name!r} for {config.architecture}")
        param = params[target]
        module_name, param_name = target.rsplit(".", 1)
        layer = model.get_submodule(module_name)
        # Linear layers and embeddings carry a shard (pagoda.model.parallel): the rank's rows
        # of each fused part and its input columns, the whole tensor without parallelism.
        shard = getattr(layer, "shard", None)
        expected = tuple(param.shape) if shard is None else shard.full_shape(part, param_name)
        if isinstance(int4_codes, GGUFBlocks):
            shape = int4_codes.shape
        elif tensor is not None:
            shape = tuple(tensor.shape)
        else:
            assert int4_codes is not None, "a checkpoint item holds values or int4 codes"
            shape = tuple(int4_codes[0].shape)
        if shape != expected:
            raise ValueError(
                f"{file_name}: tensor {name!r} has shape {shape}, expected {expected} from the model's config"
            )
        if isinstance(int4_codes, GGUFBlocks):
            _stage_gguf_blocks(layer, int4_codes, part, file_name, name)
        elif int4_codes is not None:
            weight_format = getattr(layer, "weight_format", None)
            if not isinstance(weight_format, Int4Weight):  # a MoE router or gate: full precision
                shown = family.checkpoint_names([name])[0][: -len(".weight")]
                raise ValueError(
                    f"{file_name}: {shown!r} comes quantized (GPTQ qweight or GGUF Q4_0 codes), but "
                    f"pagoda keeps {module_name} in full precision; use a checkpoint that leaves it "
                    f"unquantized"
                )
            assert shard is not None and weight_format.group_size is not None, "a Linear's shard, its format's group"
            codes, scales, *zeros = int4_codes
            offset, pieces = shard.take_int4(
                codes, scales, zeros[0] if zeros else None, part, weight_format.group_size, module_name
            )
            weight_format.stage_codes(layer, offset, *pieces)
        else:
            assert tensor is not None, "an item without int4 codes holds values"
            offset, piece = (0, tensor) if shard is None else shard.take(tensor, part, param_name)
            destination = param.data.narrow(0, offset, piece.shape[0])
            if piece.data_ptr() != destination.data_ptr() or piece.shape != destination.shape:
                destination.copy_(piece.to(dtype))  # (else received in place: receive_targets)
        loaded.add(name)
        ready.filled(target, part, name)
    missing = [name for name in _expected_checkpoint_names(params, loaded) if name not in loaded]
    if missing:
        missing = family.checkpoint_names(missing)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{source}: checkpoint is missing tensor(s) {shown}")
    finalize_linears(model, ready.finalized)


class _ReadyLinears:
    """Full-precision Linears finalized (pre-packed) as soon as every tensor of theirs is
    filled, while the rest still arrives: a weight update streamed from a trainer packs each
    layer while the next ones are received (pagoda.rl.weight_group.Transfer). A Linear whose
    tensors never all arrive (a tied LM head) is finalized with the rest at the end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.finalized: set[str] = set()
        self._needs: dict[str, set[tuple[str, int | None]]] = {}  # Linear: (parameter, part) still unfilled
        experts = [name + "." for name, module in model.named_modules() if isinstance(module, Experts)]
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.weight_format.name != "full":
                continue
            if any(name.startswith(prefix) for prefix in experts):
                continue  # a MoE block's experts finalize together
            parts: list[int | None] = list(range(len(module.shard.parts))) if len(module.shard.parts) > 1 else [None]
            self._needs[name] = {
                (f"{name}.{param}", part)
                for param, value in module.named_parameters(recurse=False)
                if value is not None
                for part in parts
            }

    def filled(self, target: str, part: int | None, name: str) -> None:
        """`target` (a parameter; `part` of it, None: whole) was filled from checkpoint tensor `name`."""
        module_name = target.rsplit(".", 1)[0]
        if module_name in self.finalized:
            raise ValueError(f"tensor {name!r} comes twice")
        needs = self._needs.get(module_name)
        if needs is None:
            return
        if part is None:
            needs.difference_update({need for need in needs if need[0] == target})
        else:
            needs.discard((target, part))
        if not needs:
            module = self.model.get_submodule(module_name)
            assert isinstance(module, Linear), "only Linears are tracked"
            module.finalize(module_name)
            self.finalized.add(module_name)
            del self._needs[module_name]


def _stage_gguf_blocks(layer: torch.nn.Module, blocks: GGUFBlocks, part: int | None, file_name: str, name: str) -> None:
    """A GGUF tensor kept as stored: an embedding holds it for its lookups (and a tied head), a
    Linear of the GGUF block format stages it as its rows of `part`."""
    if isinstance(layer, VocabParallelEmbedding):
        layer.hold_blocks(blocks)
        return
    weight_format = getattr(layer, "weight_format", None)
    if not isinstance(weight_format, GGUFBlockWeight) or not isinstance(layer, Linear):
        raise ValueError(f"{file_name}: {name!r} comes as GGUF blocks, which its layer does not hold")
    weight_format.stage_blocks(layer, layer.shard.row_offset(part), blocks)


def _classifier_head_source(model: DecoderModel, config: ModelConfig) -> str | None:
    """The checkpoint tensor a classifier read from tokens takes its rows from, or None."""
    classifier = config.classifier
    if classifier is None or classifier.from_tokens is None or model.score is None:
        return None
    if classifier.token_ids is None:
        raise ValueError(f"the classifier's tokens {list(classifier.from_tokens)} were not resolved to ids")
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def build_empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat | None,
    source: str = "model",
    tp: TensorParallelGroup | None = None,
    stage: PipelineStage | None = None,
    kernels: Kernels | None = None,
) -> DecoderModel:
    """The model with unfilled parameters; fails before any loading if a layer's shape does
    not fit the weight format (or, with tensor parallelism, does not split over the ranks)."""
    try:
        with torch.device(device):
            model = family_of(config).model_class(config, dtype, device, weight_format, tp, stage, kernels)
    except ValueError as error:  # a dimension that tensor_parallel_size does not divide
        raise ValueError(f"{source}: {error}") from None
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            try:
                module.weight_format.check_shape(name, module.in_features, module.out_features)
            except ValueError as error:
                where = (
                    f" (this rank's slice with tensor_parallel_size {tp.world_size})"
                    if tp is not None and module.shard.is_split
                    else ""
                )
                raise ValueError(f"{source}: {error}{where}") from None
    return model


def finalize_linears(model: torch.nn.Module, done: set[str] | frozenset[str] = frozenset()) -> None:
    """Let each Linear's weight format quantize/pack what the loader staged (a MoE block's
    experts finalize theirs together: pagoda.model.moe.Experts), but those in `done`."""
    experts = ""
    for name, module in model.named_modules():
        if experts and name.startswith(experts):
            continue
        if isinstance(module, Experts):
            module.finalize(name)
            experts = name + "."
        elif isinstance(module, Linear) and name not in done:
            module.finalize(name)


def _per_expert(
    tensors: Iterable[tuple[str, str, torch.Tensor | None, tuple | None]],
) -> Iterator[tuple[str, str, torch.Tensor | None, tuple | None]]:
    """Checkpoint items with a layer's fused expert tensors (one [E, ...] tensor, transformers 5's
    layout) cut into one tensor per expert."""
    for file_name, name, tensor, int4_codes in tensors:
        fused = _FUSED_EXPERTS.match(name)
        if fused is None or tensor is None or tensor.dim() != 3:
            yield file_name, name, tensor, int4_codes
            continue
        prefix, projection = fused.groups()
        for expert, weight in enumerate(tensor.unbind(0)):
            yield file_name, f"{prefix}.{expert}.{projection}.weight", weight, None


def _held_by_another_rank(model: DecoderModel, target: str) -> bool:
    """An expert's tensor that expert parallelism placed on another rank."""
    match = _EXPERT.match(target)
    if match is None:
        return False
    try:
        experts = model.get_submodule(match.group(1))
    except AttributeError:
        return False
    expert = int(match.group(2))
    return isinstance(experts, Experts) and expert < experts.num_experts and not experts.placement.holds(expert)


def _held_by_another_stage(model: DecoderModel, target: str) -> bool:
    """A tensor of a decoder layer, the embedding, or the final norm and LM head that pipeline
    parallelism placed on another stage."""
    parts = target.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        return not model.stage.holds_layer(int(parts[2]))
    if parts[:2] == ["model", "embed_tokens"]:
        return model.model.embed_tokens is None
    if parts[:2] == ["model", "norm"] or parts[0] in ("lm_head", "score"):
        return not model.stage.is_last
    return False


def _locate(name: str) -> tuple[str, int | None]:
    """Map a checkpoint tensor to (parameter name, index of its part in a fused parameter) —
    part None = the whole parameter. The layer's shard knows each part's size."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED_PARTS:
        fused, index = _FUSED_PARTS[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), index
    return name, None


def _expected_checkpoint_names(params: dict[str, torch.nn.Parameter], loaded: set[str]) -> list[str]:
    """A fused parameter comes either whole (Phi-3's qkv_proj, gate_up_proj) or in its parts."""
    names: list[str] = []
    fused_back = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    }
    for name in params:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fused_back and name not in loaded:
            names.extend(".".join(parts[:-2] + [p, parts[-1]]) for p in fused_back[parts[-2]])
        else:
            names.append(name)
    return names
