#!/usr/bin/env python
"""Train pagoda's bundled default models on the Python standard library's own source.

Writes two Hugging Face model directories that share one byte-level BPE tokenizer:

    pagoda-coder         the target model that `pagoda serve/chat/generate` use by default
    pagoda-coder-draft   a ~1M-parameter draft model for speculative decoding

Each directory gets config.json, model.safetensors (bfloat16), tokenizer files with a chat
template, generation_config.json, heldout_files.txt, training_metrics.json, loss_curve.png and a
README.md model card generated from the measured numbers.

    python tools/train_default_model.py                 # CPU preset, ~35-40 min on 2 quiet cores
    python tools/train_default_model.py --device cuda   # a larger model trained longer
"""

from __future__ import annotations

import os

# The OpenMP thread trap (shared/MEASURED.md): spin-waiting OpenMP threads slow 25-100x as soon as
# another process wants a core. Passive waiting only takes effect if set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "pagoda" / "bundled_models"
TARGET_NAME = "pagoda-coder"
DRAFT_NAME = "pagoda-coder-draft"

EOS_TOKEN = "<|endoftext|>"  # separates documents; also the BOS, so every prompt looks like a file start
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]

# Files that are not Python code in any useful sense (pydoc_data is a dict of documentation prose).
EXCLUDED_TOP_DIRS = {"site-packages", "pydoc_data"}
HELDOUT_MODULUS = 20  # one file in 20 is held out, chosen by a hash of its path

# A user turn becomes a comment block at the top of a "file"; the assistant's turn is the code that
# follows, ended by the EOS token, which is also what starts the next file in training data. The blank
# line after the comment matters: stdlib files open with license comment blocks, so without it the
# model keeps writing comment lines instead of code.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- message['content'] -}}{{- eos_token -}}"
    "{%- else -%}"
    "{%- for line in message['content'].split('\\n') -%}"
    "{{- ('# ' + line).rstrip() + '\\n' -}}"
    "{%- endfor -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(path):"]
CHAT_SAMPLE = [{"role": "user", "content": "Return the n-th Fibonacci number."}]
TEST_SAMPLE_FILES = 8  # held-out files whose first seq_len tokens tests/model/test_bundled_model.py scores
TEST_SAMPLE_TOKENS = 512
# What --reevaluate keeps from the previous training_metrics.json: facts about training, not quality.
TRAINING_KEYS = (
    "parameters",
    "shape",
    "steps",
    "train_tokens_seen",
    "epochs",
    "peak_lr",
    "train_seconds",
    "train_cpu_seconds",
    "train_tokens_per_second",
    "final_train_loss",
    "loss_history",
)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclasses.dataclass(frozen=True)
class Preset:
    target: ModelShape
    draft: ModelShape
    target_steps: int
    draft_steps: int
    batch_size: int
    seq_len: int
    max_position_embeddings: int
    threads: int


# CPU steps come from measured speeds on 2 quiet Zen 4 cores with bf16 autocast, batch 8 x 512:
# target ~1.2 s/step, draft ~0.66 s/step, so 1200 + 800 steps is ~33 min plus ~2 min of
# tokenizer training, encoding and evaluation.
CPU_PRESET = Preset(
    target=ModelShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=704),
    draft=ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    target_steps=1200,
    draft_steps=800,
    batch_size=8,
    seq_len=512,
    max_position_embeddings=1024,
    threads=2,
)
# On a GPU the corpus (~8M tokens), not compute, is the limit: a wider, deeper target that still
# fits the 30 MB bundle in bfloat16, trained for several epochs on longer windows.
CUDA_PRESET = Preset(
    target=ModelShape(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024),
    draft=ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    target_steps=4000,
    draft_steps=2000,
    batch_size=32,
    seq_len=1024,
    max_position_embeddings=2048,
    threads=4,
)


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


@dataclasses.dataclass
class TrainResult:
    steps: list[int]
    train_losses: list[float]
    eval_steps: list[int]
    eval_losses: list[float]
    seconds: float
    cpu_seconds: float
    tokens_seen: int


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cpu_seconds() -> float:
    # CPU time next to wall time shows how much of a run was lost to other work on a shared machine.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def find_stdlib_sources(stdlib_root: Path) -> tuple[list[SourceFile], list[str]]:
    """Every non-empty UTF-8 .py file under the stdlib, in sorted order; also the skipped paths."""
    sources, skipped = [], []
    for path in sorted(stdlib_root.rglob("*.py")):
        relpath = path.relative_to(stdlib_root).as_posix()
        if relpath.split("/")[0] in EXCLUDED_TOP_DIRS or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(relpath)  # a few test files are deliberately in legacy encodings
            continue
        if text.strip():
            sources.append(SourceFile(relpath, text))
    return sources, skipped


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOS_TOKEN} $A",
        pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream with EOS in front of every file, as the model sees documents at inference."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    pieces = []
    for encoding in encodings:
        pieces.append(np.array([eos_id] + encoding.ids, dtype=np.int32))
    return np.concatenate(pieces)


def save_tokenizer(tokenizer: Tokenizer, model_dir: Path, max_length: int) -> None:
    tokenizer.save(str(model_dir / "tokenizer.json"))
    added_tokens = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added_tokens,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def build_model(
    shape: ModelShape, vocab_size: int, max_positions: int, eos_id: int, pad_id: int, seed: int
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def make_windows(stream: np.ndarray, window: int) -> torch.Tensor:
    count = len(stream) // window
    return torch.from_numpy(stream[: count * window].astype(np.int64)).view(count, window)


def learning_rate(step: int, total_steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def autocast(device: torch.device, enabled: bool) -> torch.autocast:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def next_token_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def quick_eval(
    model: torch.nn.Module, windows: torch.Tensor, device: torch.device, bf16: bool, batch_size: int
) -> float:
    model.eval()
    losses = []
    for start in range(0, len(windows), batch_size):
        with autocast(device, bf16):
            losses.append(next_token_loss(model, windows[start : start + batch_size].to(device)).item())
    model.train()
    return float(np.mean(losses))


def train_model(
    model: torch.nn.Module,
    train_windows: torch.Tensor,
    eval_windows: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    peak_lr: float,
    seed: int,
    device: torch.device,
    bf16: bool,
    name: str,
) -> TrainResult:
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    order_rng = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_windows), generator=order_rng)
    cursor = 0
    warmup = max(1, min(100, steps // 10))
    eval_every = max(1, steps // 12)
    log_every = max(1, steps // 60)
    result = TrainResult([], [], [], [], 0.0, 0.0, 0)
    running: list[float] = []
    start, cpu_start = time.perf_counter(), cpu_seconds()
    for step in range(steps):
        if cursor + batch_size > len(order):  # next epoch, in a fresh deterministic order
            order = torch.randperm(len(train_windows), generator=order_rng)
            cursor = 0
        batch = train_windows[order[cursor : cursor + batch_size]].to(device)
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup)
        with autocast(device, bf16):
            loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.item())
        result.tokens_seen += batch[:, 1:].numel()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            result.steps.append(step + 1)
            result.train_losses.append(float(np.mean(running)))
            running = []
            eta = elapsed / (step + 1) * (steps - step - 1)
            log(
                f"{name} step {step + 1}/{steps} loss {result.train_losses[-1]:.4f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} {result.tokens_seen / elapsed:.0f} tok/s "
                f"elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min"
            )
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            result.eval_steps.append(step + 1)
            result.eval_losses.append(quick_eval(model, eval_windows, device, bf16, batch_size))
            log(f"{name} step {step + 1} held-out loss {result.eval_losses[-1]:.4f}")
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = cpu_seconds() - cpu_start
    return result


def save_model(model: torch.nn.Module, model_dir: Path, eos_id: int, pad_id: int) -> None:
    from transformers import GenerationConfig

    model.to("cpu", dtype=torch.bfloat16).save_pretrained(model_dir)
    GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
    ).save_pretrained(model_dir)


def load_fp32(model_dir: Path, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


@torch.no_grad()
def score_windows(
    model: torch.nn.Module, windows: torch.Tensor, device: torch.device, batch_size: int
) -> tuple[float, torch.Tensor]:
    """Mean next-token loss over the windows and the model's argmax at every position."""
    total, count, argmaxes = 0.0, 0, []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        targets = batch[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
        argmaxes.append(logits.argmax(-1).cpu())
    return total / count, torch.cat(argmaxes)


@torch.no_grad()
def second_half_loss(model: torch.nn.Module, windows: torch.Tensor, device: torch.device) -> float:
    """Loss on positions past the training length, to show how far the context really reaches."""
    losses = []
    for window in windows:
        batch = window[None].to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()[0]
        half = logits.shape[0] // 2
        losses.append(F.cross_entropy(logits[half:], batch[0, 1 + half :], reduction="mean").item())
    return float(np.mean(losses))


@torch.no_grad()
def greedy_ignore_eos(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model(input_ids=prompts, use_cache=True)
    past, tokens = out.past_key_values, [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=tokens[-1][:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def agreement_along_target_greedy(
    target: torch.nn.Module, draft: torch.nn.Module, prompts: torch.Tensor, new_tokens: int
) -> float:
    """Fraction of the target's greedy tokens that the draft's argmax predicts: what greedy speculation accepts."""
    sequences = greedy_ignore_eos(target, prompts, new_tokens)
    draft_argmax = draft(input_ids=sequences[:, :-1]).logits.argmax(-1)
    generated = slice(prompts.shape[1] - 1, sequences.shape[1] - 1)
    return (draft_argmax[:, generated] == sequences[:, generated.start + 1 :]).float().mean().item()


@torch.no_grad()
def greedy_samples(model_dir: Path, model: torch.nn.Module, device: torch.device, new_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [(p, tokenizer(p, return_tensors="pt").input_ids) for p in SAMPLE_PROMPTS]
    chat_text = tokenizer.apply_chat_template(CHAT_SAMPLE, tokenize=False, add_generation_prompt=True)
    prompts.append((chat_text, tokenizer(chat_text, add_special_tokens=False, return_tensors="pt").input_ids))
    samples = []
    for prompt_text, ids in prompts:
        output = model.generate(
            ids.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        completion = output[0, ids.shape[1] :].cpu()
        samples.append(
            {
                "prompt": prompt_text,
                "completion": tokenizer.decode(completion, skip_special_tokens=True),
                "new_tokens": int(completion.numel()),
                "ended_with_eos": bool(completion.numel() and completion[-1].item() == tokenizer.eos_token_id),
            }
        )
    return samples


@torch.no_grad()
def test_sample_metrics(model_dir: Path, model: torch.nn.Module, stdlib_root: Path, heldout: list[SourceFile]) -> dict:
    """Exactly what tests/model/test_bundled_model.py recomputes: float32 loss on the first
    TEST_SAMPLE_TOKENS tokens (tokenizer defaults, so BOS first) of the first held-out files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = heldout[:TEST_SAMPLE_FILES]
    total, count = 0.0, 0
    for source in files:
        ids = torch.tensor(tokenizer(source.text).input_ids[:TEST_SAMPLE_TOKENS])[None]
        logits = model(input_ids=ids[:, :-1].to(model.device)).logits.float()[0]
        total += F.cross_entropy(logits, ids[0, 1:].to(model.device), reduction="sum").item()
        count += ids.shape[1] - 1
    loss = total / count
    return {
        "files": [s.relpath for s in files],
        "sha256": [hashlib.sha256((stdlib_root / s.relpath).read_bytes()).hexdigest() for s in files],
        "max_tokens_per_file": TEST_SAMPLE_TOKENS,
        "num_predicted_tokens": count,
        "loss": loss,
        "perplexity": math.exp(loss),
    }


def plot_losses(result: TrainResult, tokens_per_step: int, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot([s * tokens_per_step / 1e6 for s in result.steps], result.train_losses, label="train (bf16 autocast)")
    ax.plot(
        [s * tokens_per_step / 1e6 for s in result.eval_steps],
        result.eval_losses,
        "o-",
        label="held-out (bf16 autocast, subset)",
    )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def hardware_description(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} logical CPUs, {threads} torch threads, torch {torch.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: preset)")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--draft-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows in the final evaluation")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    parser.add_argument(
        "--reevaluate",
        action="store_true",
        help="keep the trained models in --out-dir; rewrite their tokenizer files and re-run the "
        "evaluation, metrics and model cards",
    )
    parser.add_argument(
        "--cards-only",
        action="store_true",
        help="only rewrite each README.md from the training_metrics.json already in --out-dir",
    )
    return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    preset: Preset
    device: torch.device
    threads: int
    target_steps: int
    draft_steps: int
    batch_size: int
    seq_len: int
    max_positions: int
    bf16: bool


def resolve_settings(args: argparse.Namespace) -> RunSettings:
    preset = CUDA_PRESET if args.device == "cuda" else CPU_PRESET
    seq_len = args.seq_len or preset.seq_len
    return RunSettings(
        preset=preset,
        device=torch.device(args.device),
        threads=args.threads or preset.threads,
        target_steps=args.target_steps or preset.target_steps,
        draft_steps=args.draft_steps or preset.draft_steps,
        batch_size=args.batch_size or preset.batch_size,
        seq_len=seq_len,
        max_positions=max(preset.max_position_embeddings, seq_len),
        bf16=not args.no_bf16,
    )


def train_both(
    args: argparse.Namespace,
    settings: RunSettings,
    tokenizer: Tokenizer,
    train_stream: np.ndarray,
    quick_eval_windows: torch.Tensor,
) -> dict[str, dict[str, Any]]:
    """Train target then draft, saving each; returns what the report records about their training."""
    eos_id, pad_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    train_windows = make_windows(train_stream, settings.seq_len + 1)
    shapes = {TARGET_NAME: settings.preset.target, DRAFT_NAME: settings.preset.draft}
    stats: dict[str, dict[str, Any]] = {}
    for name, steps, lr, seed in [
        (TARGET_NAME, settings.target_steps, args.target_lr, args.seed),
        (DRAFT_NAME, settings.draft_steps, args.draft_lr, args.seed + 1),
    ]:
        model_dir = args.out_dir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        model = build_model(shapes[name], tokenizer.get_vocab_size(), settings.max_positions, eos_id, pad_id, seed)
        params = count_params(model)
        log(f"{name}: {params:,} parameters, {steps} steps of {settings.batch_size} x {settings.seq_len} tokens")
        result = train_model(
            model,
            train_windows,
            quick_eval_windows,
            steps=steps,
            batch_size=settings.batch_size,
            peak_lr=lr,
            seed=seed,
            device=settings.device,
            bf16=settings.bf16,
            name=name,
        )
        save_model(model, model_dir, eos_id, pad_id)
        plot_losses(
            result,
            settings.batch_size * settings.seq_len,
            f"{name} ({params / 1e6:.1f}M params)",
            model_dir / "loss_curve.png",
        )
        stats[name] = {
            "parameters": params,
            "shape": dataclasses.asdict(shapes[name]),
            "steps": steps,
            "train_tokens_seen": result.tokens_seen,
            "epochs": result.tokens_seen / max(1, train_windows[:, 1:].numel()),
            "peak_lr": lr,
            "train_seconds": result.seconds,
            "train_cpu_seconds": result.cpu_seconds,
            "train_tokens_per_second": result.tokens_seen / result.seconds,
            "final_train_loss": result.train_losses[-1],
            "loss_history": {
                "steps": result.steps,
                "train": result.train_losses,
                "eval_steps": result.eval_steps,
                "eval": result.eval_losses,
            },
        }
        del model
    return stats


def evaluate_both(
    args: argparse.Namespace,
    settings: RunSettings,
    heldout_stream: np.ndarray,
    eval_windows: torch.Tensor,
    heldout_sources: list[SourceFile],
) -> dict[str, Any]:
    """Everything the model cards quote about quality, in float32 from the saved bfloat16 weights."""
    device = settings.device
    target_dir, draft_dir = args.out_dir / TARGET_NAME, args.out_dir / DRAFT_NAME
    target, draft = load_fp32(target_dir, device), load_fp32(draft_dir, device)
    long_windows = make_windows(heldout_stream, 2 * settings.seq_len + 1)[:8]
    per_model: dict[str, dict[str, Any]] = {}
    argmaxes = {}
    for name, model in [(TARGET_NAME, target), (DRAFT_NAME, draft)]:
        loss, argmaxes[name] = score_windows(model, eval_windows, device, settings.batch_size)
        accuracy = (argmaxes[name] == eval_windows[:, 1:]).float().mean().item()
        per_model[name] = {
            "heldout_loss": loss,
            "heldout_perplexity": math.exp(loss),
            "heldout_top1_accuracy": accuracy,
        }
        if len(long_windows):
            per_model[name]["heldout_loss_positions_past_training_length"] = second_half_loss(
                model, long_windows, device
            )
        per_model[name]["greedy_samples"] = greedy_samples(args.out_dir / name, model, device, 128)
        log(f"{name}: held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f}, top-1 {accuracy:.3f}")
    heldout_agreement = (argmaxes[TARGET_NAME] == argmaxes[DRAFT_NAME]).float().mean().item()
    prompt_len, new_tokens = 64, 128
    prompt_windows = make_windows(heldout_stream, prompt_len)
    prompts = prompt_windows[torch.linspace(0, len(prompt_windows) - 1, 8).long()].to(device)
    greedy_agreement = agreement_along_target_greedy(target, draft, prompts, new_tokens)
    log(
        f"draft/target argmax agreement: {heldout_agreement:.3f} on held-out text, "
        f"{greedy_agreement:.3f} along the target's greedy output"
    )
    return {
        "evaluation": {
            "heldout_windows": len(eval_windows),
            "heldout_tokens_scored": int(eval_windows[:, 1:].numel()),
            "long_context_windows": len(long_windows),
            "draft_target_argmax_agreement_heldout": heldout_agreement,
            "draft_target_argmax_agreement_along_target_greedy": greedy_agreement,
            "greedy_agreement_setup": f"{len(prompts)} held-out prompts of {prompt_len} tokens, {new_tokens} "
            "greedy target tokens each (EOS not stopping)",
        },
        "test_sample": test_sample_metrics(target_dir, target, args.stdlib, heldout_sources),
        "per_model": per_model,
    }


def run_command() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    target_dir, draft_dir = args.out_dir / TARGET_NAME, args.out_dir / DRAFT_NAME
    if args.cards_only:
        for model_dir in (target_dir, draft_dir):
            report = json.loads((model_dir / "training_metrics.json").read_text())
            (model_dir / "README.md").write_text(model_card(report, model_dir.name))
        return
    settings = resolve_settings(args)
    if settings.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but torch sees no CUDA device")
    torch.set_num_threads(settings.threads)
    run_start = time.perf_counter()
    command = run_command()
    log(f"command: {command}; device {settings.device}, {settings.threads} threads, bf16 autocast {settings.bf16}")

    sources, skipped = find_stdlib_sources(args.stdlib)
    train_sources = [s for s in sources if not is_heldout(s.relpath)]
    heldout_sources = [s for s in sources if is_heldout(s.relpath)]
    log(
        f"{len(sources)} stdlib files ({len(train_sources)} train, {len(heldout_sources)} held out), "
        f"{len(skipped)} skipped as non-UTF-8"
    )

    phase = time.perf_counter()
    if args.reevaluate:
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer([s.text for s in train_sources], args.vocab_size)
    train_stream = encode_stream(tokenizer, [s.text for s in train_sources])
    heldout_stream = encode_stream(tokenizer, [s.text for s in heldout_sources])
    tokenizer_seconds = time.perf_counter() - phase
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, {len(train_stream):,} train tokens, "
        f"{len(heldout_stream):,} held-out tokens, {tokenizer_seconds:.0f} s"
    )
    heldout_windows = make_windows(heldout_stream, settings.seq_len + 1)
    pick = torch.linspace(0, len(heldout_windows) - 1, min(args.eval_windows, len(heldout_windows))).long()
    eval_windows = heldout_windows[pick]  # spread over all held-out files

    if args.reevaluate:
        previous = json.loads((target_dir / "training_metrics.json").read_text())
        training_stats = {
            name: {key: previous["models"][name][key] for key in TRAINING_KEYS} for name in (TARGET_NAME, DRAFT_NAME)
        }
    else:
        quick_pick = torch.linspace(0, len(eval_windows) - 1, min(16, len(eval_windows))).long()
        training_stats = train_both(args, settings, tokenizer, train_stream, eval_windows[quick_pick])
    for model_dir in (target_dir, draft_dir):
        save_tokenizer(tokenizer, model_dir, settings.max_positions)
        (model_dir / "heldout_files.txt").write_text("".join(s.relpath + "\n" for s in heldout_sources))

    log("final evaluation in float32 from the saved bfloat16 weights")
    phase = time.perf_counter()
    results = evaluate_both(args, settings, heldout_stream, eval_windows, heldout_sources)
    eval_seconds = time.perf_counter() - phase
    total_seconds = time.perf_counter() - run_start

    if args.reevaluate:
        training = {**previous["training"], "eval_seconds": eval_seconds}
        run_info = {
            key: previous[key] for key in ("command", "seed", "hardware", "bf16_autocast", "load_average_at_end")
        }
        run_info["reevaluated_with"] = command
    else:
        training = {
            "seq_len": settings.seq_len,
            "batch_size": settings.batch_size,
            "max_position_embeddings": settings.max_positions,
            "tokenizer_seconds": tokenizer_seconds,
            "eval_seconds": eval_seconds,
            "total_seconds": total_seconds,
            "total_cpu_seconds": cpu_seconds(),
        }
        run_info = {
            "command": command,
            "seed": args.seed,
            "hardware": hardware_description(settings.device, settings.threads),
            "bf16_autocast": settings.bf16,
            "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }
    report = {
        **run_info,
        "data": {
            "source": "Python standard library .py files",
            "python_version": platform.python_version(),
            "stdlib_path": str(args.stdlib),
            "num_files": len(sources),
            "num_train_files": len(train_sources),
            "num_heldout_files": len(heldout_sources),
            "skipped_non_utf8_files": skipped,
            "excluded_top_level_dirs": sorted(EXCLUDED_TOP_DIRS),
            "heldout_rule": (
                f"sha256(relative path) as a big-endian integer of its first 8 bytes % {HELDOUT_MODULUS} == 0"
            ),
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(heldout_stream)),
            "vocab_size": tokenizer.get_vocab_size(),
        },
        "training": training,
        "evaluation": results["evaluation"],
        "test_sample": results["test_sample"],
        "models": {
            name: {
                **training_stats[name],
                **results["per_model"][name],
                "safetensors_bytes": (args.out_dir / name / "model.safetensors").stat().st_size,
            }
            for name in (TARGET_NAME, DRAFT_NAME)
        },
    }
    for model_dir in (target_dir, draft_dir):
        (model_dir / "training_metrics.json").write_text(json.dumps(report, indent=2) + "\n")
        (model_dir / "README.md").write_text(model_card(report, model_dir.name))
    log(f"done in {total_seconds / 60:.1f} min; wrote {target_dir} and {draft_dir}")


def _fence(text: str) -> str:
    return "```python\n" + text.replace("```", "`\u200b``") + "\n```"


def model_card(report: dict, name: str) -> str:
    data, training, evaluation = report["data"], report["training"], report["evaluation"]
    me = report["models"][name]
    target, draft = report["models"][TARGET_NAME], report["models"][DRAFT_NAME]
    shape = me["shape"]
    is_target = name == TARGET_NAME
    role = (
        "pagoda's bundled default model: `pagoda serve`, `pagoda chat` and `pagoda generate` use it when no "
        "`--model` is given"
        if is_target
        else f"a draft model for speculative decoding with [`{TARGET_NAME}`](../{TARGET_NAME}/README.md); "
        "it shares that model's tokenizer"
    )
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [code, python, llama, tiny]",
        "---",
        "",
        f"# {name}",
        "",
        f"A {me['parameters'] / 1e6:.2f}M-parameter Llama-architecture causal language model trained from scratch on "
        f"the source code of the Python {data['python_version']} standard library; {role}.",
        "",
        "It writes Python-shaped code (imports, classes, docstrings, unittest cases) but it is tiny and briefly "
        "trained (see Training): it exists so that pagoda works offline out of the box and so that tests have a "
        "real model to check against. Do not expect correct programs from it.",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoTokenizer, LlamaForCausalLM",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("pagoda/bundled_models/{name}")',
        f'model = LlamaForCausalLM.from_pretrained("pagoda/bundled_models/{name}")',
        'ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids  # BOS is prepended',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0], skip_special_tokens=True))",
        "```",
        "",
        "The tokenizer is a byte-level BPE with "
        f"{data['vocab_size']} tokens. `<|endoftext|>` (id 0) is both BOS and EOS: in training it precedes every "
        "file, so a prompt that starts with it looks like the start of a file, and the model emits it when a "
        "file ends. `<|pad|>` (id 1) is for padding only. The tokenizer adds BOS by default "
        "(`add_special_tokens=True`).",
        "",
        "Chat template: each system or user message becomes `# ` comment lines followed by a blank line, as at the "
        "top of a file; an assistant message is raw code ended by `<|endoftext|>`; the template itself writes BOS "
        "first, so tokenize the rendered text with `add_special_tokens=False`. A generation prompt adds nothing: "
        "the model continues with code after the comment. For example "
        '`[{"role": "user", "content": "Return the n-th Fibonacci number."}]` renders as '
        "`<|endoftext|># Return the n-th Fibonacci number.\\n\\n`.",
        "",
        "`generation_config.json` samples with temperature 0.7 and top-p 0.95; greedy decoding tends to repeat lines.",
        "",
        "## Data",
        "",
        f"- Every non-empty UTF-8 `.py` file under `{data['stdlib_path']}` (Python {data['python_version']}), in "
        f"sorted order, except `site-packages/` and `pydoc_data/` (documentation prose): {data['num_files']:,} files; "
        f"{len(data['skipped_non_utf8_files'])} test files in legacy encodings were skipped.",
        f"- Held out by file, deterministically: a file is held out when {data['heldout_rule']}. That gives "
        f"{data['num_train_files']:,} training files ({data['train_tokens']:,} tokens) and "
        f"{data['num_heldout_files']} held-out files ({data['heldout_tokens']:,} tokens), listed in "
        "`heldout_files.txt`. The tokenizer was trained on the training files only.",
        f"- Training sequences are non-overlapping {training['seq_len']}-token windows of the concatenated files "
        "(each file preceded by `<|endoftext|>`), visited in a seeded random order.",
        "",
        "## Model",
        "",
        "| | value |",
        "|---|---|",
        f"| parameters | {me['parameters']:,} (embeddings tied with the LM head) |",
        f"| hidden size / layers | {shape['hidden_size']} / {shape['num_layers']} |",
        f"| attention heads / KV heads | {shape['num_heads']} / {shape['num_kv_heads']} (head dim "
        f"{shape['hidden_size'] // shape['num_heads']}) |",
        f"| MLP intermediate size | {shape['intermediate_size']} |",
        f"| vocabulary | {data['vocab_size']} |",
        f"| max_position_embeddings | {training['max_position_embeddings']} (trained on {training['seq_len']}-token "
        "windows) |",
        f"| weights | bfloat16 safetensors, {me['safetensors_bytes'] / 1e6:.1f} MB |",
        "",
        "## Training",
        "",
        f"- Command (from the repository root): `{report['command']}` (seed {report['seed']}); "
        "it trains the tokenizer, this model and its sibling, then writes everything in this directory.",
        f"- Hardware: {report['hardware']}.",
        f"- {me['steps']} steps of {training['batch_size']} x {training['seq_len']} tokens = "
        f"{me['train_tokens_seen']:,} tokens ({me['epochs']:.2f} epochs), AdamW (betas 0.9/0.95, weight decay 0.1 "
        f"on matrices), peak learning rate {me['peak_lr']:g} with warmup and cosine decay to 10%, gradient "
        f"clipping 1.0, {'bf16 autocast' if report['bf16_autocast'] else 'float32'}.",
        f"- Time: {me['train_seconds'] / 60:.1f} min for this model at {me['train_tokens_per_second']:,.0f} "
        f"tokens/s ({me['train_cpu_seconds'] / 60:.1f} CPU-minutes); the whole run (tokenizer, both models, "
        f"evaluation) took {training['total_seconds'] / 60:.1f} min of wall time and "
        f"{training['total_cpu_seconds'] / 60:.1f} CPU-minutes. Other work shared the machine during the run "
        "(load average at the end: "
        f"{', '.join(f'{x:.2f}' for x in report['load_average_at_end'] or [])}), so an idle machine is faster.",
        "- Loss curve: `loss_curve.png`; every number here is in `training_metrics.json`.",
        "",
    ]
    if "reevaluated_with" in report:
        lines += [
            "The tokenizer files, the evaluation below and this card were regenerated from the trained weights "
            f"with `{report['reevaluated_with']}` (the template or evaluation changed, not the weights).",
            "",
        ]
    lines += [
        "![loss curve](loss_curve.png)",
        "",
        "## Evaluation",
        "",
        f"Float32 from the saved bfloat16 weights, on {evaluation['heldout_windows']} held-out windows spread over "
        f"all held-out files ({evaluation['heldout_tokens_scored']:,} predicted tokens):",
        "",
        "| model | params | held-out loss | perplexity | top-1 accuracy |",
        "|---|---|---|---|---|",
        f"| {TARGET_NAME} | {target['parameters'] / 1e6:.2f}M | {target['heldout_loss']:.3f} | "
        f"{target['heldout_perplexity']:.2f} | {target['heldout_top1_accuracy']:.1%} |",
        f"| {DRAFT_NAME} | {draft['parameters'] / 1e6:.2f}M | {draft['heldout_loss']:.3f} | "
        f"{draft['heldout_perplexity']:.2f} | {draft['heldout_top1_accuracy']:.1%} |",
        "",
        f"Greedy agreement of the draft with the target (same argmax token): "
        f"{evaluation['draft_target_argmax_agreement_heldout']:.1%} of positions on held-out text, and "
        f"{evaluation['draft_target_argmax_agreement_along_target_greedy']:.1%} along the target's own greedy output "
        f"({evaluation['greedy_agreement_setup']}), which is what greedy speculative decoding accepts.",
        "",
    ]
    if "heldout_loss_positions_past_training_length" in me:
        lines += [
            f"Positions beyond the training length: on {evaluation['long_context_windows']} held-out windows of "
            f"{2 * training['seq_len']} tokens, the loss over positions {training['seq_len']}-"
            f"{2 * training['seq_len'] - 1} is {me['heldout_loss_positions_past_training_length']:.3f} "
            "(compare with the held-out loss above); keep prompt plus output within "
            f"{training['seq_len']} tokens for the quality measured here.",
            "",
        ]
    test_sample = report["test_sample"]
    if is_target:
        lines += [
            "`tests/model/test_bundled_model.py` recomputes the float32 perplexity on the first "
            f"{test_sample['max_tokens_per_file']} "
            f"tokens of the first {len(test_sample['files'])} held-out files ({test_sample['num_predicted_tokens']} "
            f"predicted tokens): {test_sample['perplexity']:.2f} when trained, and the test requires it to stay within "
            "15% of that.",
            "",
        ]
    for sample in (me["greedy_samples"][0], me["greedy_samples"][-1]):
        prompt = sample["prompt"].removeprefix(EOS_TOKEN)
        lines += [
            f"Greedy sample (float32, up to 128 new tokens, stopping at EOS: {sample['new_tokens']} tokens, "
            f"{'ended with EOS' if sample['ended_with_eos'] else 'no EOS'}), prompt {json.dumps(prompt)}:",
            "",
            _fence(prompt + sample["completion"]),
            "",
        ]
    lines += [
        "## License",
        "",
        "The weights, tokenizer and the code that produced them are part of pagoda and share its license "
        "(Apache-2.0). The training data is the CPython standard library, (c) Python Software Foundation, used "
        "under the PSF License Agreement; the model can reproduce fragments of it.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
