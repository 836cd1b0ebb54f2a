"""The tokenizer of a GGUF file, built from its metadata (`tokenizer.ggml.*`) as llama.cpp reads it.

llama.cpp's converters store the vocabulary itself, not a `tokenizer.json`: the pieces
(`tokens`), their kinds (`token_type`), SentencePiece scores (`scores`, model `llama`) or BPE
merges (`merges`, model `gpt2`), the name of the pre-tokenizer (`pre`), the special token ids and
whether BOS/EOS are added. This module rebuilds from them a `tokenizers.Tokenizer` that splits
text into the same ids llama.cpp does (its `src/llama-vocab.cpp`), so a file from llama.cpp's
world loads without transformers' GGUF internals (which change between releases):

- `llama` (SentencePiece): spaces become "▁", one "▁" is prepended to every run of text after
  the start or a special token (`add_space_prefix`), then pieces merge pairwise, the pair whose
  merged piece has the highest score first; characters left outside the vocabulary fall back to
  their `<0xXX>` byte pieces. A BPE model whose merges are ranked by those scores is the same
  procedure while the scores differ. Where they tie (llama.cpp's converter writes -1000 for
  every piece of a vocabulary converted from tokenizer.json alone) llama.cpp merges the leftmost
  pair first, which BPE's ranks cannot say: such vocabularies also get an encoder whose
  pre-tokenizer runs llama.cpp's procedure itself (`SentencePieceSegmenter`) and hands the
  finished pieces to the same BPE model.
- `gpt2` (byte-level BPE): the text is split by the pre-tokenizer's regular expressions (one
  after another, as llama.cpp applies them), bytes are mapped to GPT-2's printable alphabet, and
  the stored merges apply in order.

Control tokens (type 3) and user-defined tokens (type 4) are matched in the text before anything
else, as llama.cpp does when it parses special tokens (the server's prompts always are).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (gguf.TokenType): what each id is.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer expressions of llama.cpp (`llm_tokenizer_bpe`), by the names its converter
# writes in `tokenizer.ggml.pre`. Several expressions run one after another, each splitting the
# pieces the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's pre-tokenizers: its expressions and the vocabulary flags it implies."""

    expressions: tuple[str, ...]
    # Whole words found in the vocabulary are taken as one token before any merge (Llama 3).
    ignore_merges: bool = False
    # The BOS default when the file does not say (`tokenizer.ggml.add_bos_token`).
    add_bos: bool = False


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_STARCODER_PRE = PreTokenizer((r"\p{N}", _GPT2))
_GPT2_PRE = PreTokenizer((_GPT2,))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2"), _QWEN2_PRE),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _STARCODER_PRE
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "mellum", "a.x-4.0", "gigachat"), _GPT2_PRE),
    "tekken": PreTokenizer(
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)",
        ),
        ignore_merges=True,
        add_bos=True,
    ),
    "default": PreTokenizer(_DEFAULT),
    "": PreTokenizer(_DEFAULT),  # no name in the file: llama.cpp warns and uses its default
}


@dataclass
class GGUFVocabulary:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    pre: str = ""
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unknown_token_id: int | None = None
    padding_token_id: int | None = None
    add_bos: bool | None = None  # None: the model's default
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    @property
    def adds_bos(self) -> bool:
        if self.add_bos is not None:
            return self.add_bos
        if self.model == "llama":
            return True
        return self.pre_tokenizer.add_bos

    @property
    def adds_eos(self) -> bool:
        return bool(self.add_eos)

    @property
    def adds_space_prefix(self) -> bool:
        if self.add_space_prefix is not None:
            return self.add_space_prefix
        return self.model == "llama"

    @property
    def pre_tokenizer(self) -> PreTokenizer:
        try:
            return PRE_TOKENIZERS[self.pre]
        except KeyError:
            raise ValueError(
                f"the GGUF pre-tokenizer {self.pre!r} is not supported (supported: "
                f"{', '.join(sorted(name for name in PRE_TOKENIZERS if name))}); "
                f"pass --tokenizer DIR with the model's tokenizer.json"
            ) from None

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def read_gguf_vocabulary(path: str | Path) -> GGUFVocabulary:
    """The vocabulary stored in a GGUF file's metadata; ValueError when there is none."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(key: str, default: Any = None) -> Any:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    model = value("tokenizer.ggml.model")
    if model is None or value("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{path}: no tokenizer in the GGUF metadata; pass --tokenizer DIR")
    if model not in ("llama", "gpt2"):
        raise ValueError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (llama and gpt2 are); "
            f"pass --tokenizer DIR with the model's tokenizer.json"
        )
    tokens = list(value("tokenizer.ggml.tokens"))
    return GGUFVocabulary(
        model=model,
        tokens=tokens,
        token_types=list(value("tokenizer.ggml.token_type", [NORMAL] * len(tokens))),
        scores=list(value("tokenizer.ggml.scores", [])),
        merges=list(value("tokenizer.ggml.merges", [])),
        pre=value("tokenizer.ggml.pre", "") or "",
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
        unknown_token_id=value("tokenizer.ggml.unknown_token_id"),
        padding_token_id=value("tokenizer.ggml.padding_token_id"),
        add_bos=value("tokenizer.ggml.add_bos_token"),
        add_eos=value("tokenizer.ggml.add_eos_token"),
        add_space_prefix=value("tokenizer.ggml.add_space_prefix"),
        chat_template=value("tokenizer.chat_template"),
    )


def build_tokenizer(vocabulary: GGUFVocabulary) -> Tokenizer:
    """A `tokenizers.Tokenizer` that encodes and decodes as llama.cpp does with this vocabulary
    (for SentencePiece scores that tie, encode with `build_encoder`'s)."""
    vocab = {piece: token_id for token_id, piece in enumerate(vocabulary.tokens)}
    unk = vocabulary.token(vocabulary.unknown_token_id)
    if vocabulary.model == "llama":
        tokenizer = Tokenizer(
            models.BPE(
                vocab=vocab, merges=_merges_by_score(vocabulary), unk_token=unk, fuse_unk=True, byte_fallback=True
            )
        )
        prefix = [normalizers.Prepend("▁")] if vocabulary.adds_space_prefix else []
        tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if vocabulary.adds_space_prefix else []
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
    else:
        pre = vocabulary.pre_tokenizer
        merges = [_merge_pair(merge) for merge in vocabulary.merges]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, ignore_merges=pre.ignore_merges))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(expression), behavior="isolated") for expression in pre.expressions]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(piece, special=kind in (CONTROL, UNKNOWN), normalized=False)
            for piece, kind in zip(vocabulary.tokens, vocabulary.token_types)
            if kind in (CONTROL, USER_DEFINED, UNKNOWN)
        ]
    )
    _set_post_processor(tokenizer, vocabulary)
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    """A stored merge "left right" as the pair of pieces BPE takes."""
    left, space, right = merge.partition(" ")
    if not space:
        raise ValueError(f"merge {merge!r} is not two pieces separated by a space")
    return left, right


def _merges_by_score(vocabulary: GGUFVocabulary) -> list[tuple[str, str]]:
    """SentencePiece's scores as BPE merges: every split of a piece into two pieces of the
    vocabulary is a merge, ranked by the merged piece's score (highest first), as llama.cpp's
    SentencePiece session picks the best-scoring pair at each step."""
    pieces = {
        piece: token_id
        for token_id, piece in enumerate(vocabulary.tokens)
        if vocabulary.token_types[token_id] in (NORMAL, USER_DEFINED, UNUSED)
    }
    scores = vocabulary.scores or [0.0] * len(vocabulary.tokens)
    ranked = []
    for piece, token_id in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[token_id], pieces[left], pieces[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _set_post_processor(tokenizer: Tokenizer, vocabulary: GGUFVocabulary) -> None:
    bos = vocabulary.token(vocabulary.bos_token_id) if vocabulary.adds_bos else None
    eos = vocabulary.token(vocabulary.eos_token_id) if vocabulary.adds_eos else None
    if bos is None and eos is None:
        return
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [
        (piece, token_id)
        for piece, token_id in ((bos, vocabulary.bos_token_id), (eos, vocabulary.eos_token_id))
        if piece
    ]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def scores_tie(vocabulary: GGUFVocabulary) -> bool:
    """Whether two pieces that merges can form share a score (then ranks cannot order them as
    llama.cpp does: leftmost first)."""
    if vocabulary.model != "llama":
        return False
    scores = [score for score, kind in zip(vocabulary.scores, vocabulary.token_types) if kind in (NORMAL, USER_DEFINED)]
    return len(set(scores)) < len(scores)


class SentencePieceSegmenter:
    """llama.cpp's SentencePiece procedure (`llm_tokenizer_spm_session`) as a `tokenizers`
    pre-tokenizer: repeatedly merge the adjacent pair whose concatenation is a piece of the
    vocabulary with the highest score, the leftmost on a tie; each finished piece becomes one
    pre-token, which the BPE model then maps to its id (or to byte pieces)."""

    def __init__(self, vocabulary: GGUFVocabulary) -> None:
        self._scores = {
            piece: vocabulary.scores[token_id] if vocabulary.scores else 0.0
            for token_id, piece in enumerate(vocabulary.tokens)
            if vocabulary.token_types[token_id] in (NORMAL, USER_DEFINED, UNUSED)
        }

    def pieces(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each finished piece of `text`, in characters."""
        starts = list(range(len(text)))
        ends = [start + 1 for start in starts]
        following = [index + 1 for index in starts]
        preceding = [index - 1 for index in starts]
        queue: list[tuple[float, int, int, int]] = []

        def consider(left: int, right: int) -> None:
            if left < 0 or right >= len(text):
                return
            score = self._scores.get(text[starts[left] : ends[right]])
            if score is not None:
                heapq.heappush(queue, (-score, left, right, ends[right] - starts[left]))

        for index in range(1, len(text)):
            consider(index - 1, index)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            # Stale when either symbol has merged since (emptied, or grown): llama.cpp's test.
            sizes = (ends[left] - starts[left], ends[right] - starts[right])
            if 0 in sizes or sum(sizes) != length:
                continue
            ends[left] = ends[right]
            starts[right] = ends[right]  # emptied
            following[left] = following[right]
            if following[right] < len(text):
                preceding[following[right]] = left
            consider(preceding[left], left)
            consider(left, following[left])
        spans, index = [], 0
        while index < len(text):
            spans.append((starts[index], ends[index]))
            index = following[index]
        return spans

    def pre_tokenize(self, pretokenized: Any) -> None:
        pretokenized.split(lambda _, normalized: [normalized[start:end] for start, end in self.pieces(str(normalized))])


def build_encoder(vocabulary: GGUFVocabulary) -> Tokenizer | None:
    """For a SentencePiece vocabulary whose scores tie: a tokenizer that encodes with
    SentencePieceSegmenter (decoding and everything else stay `build_tokenizer`'s, which can be
    serialized); None when the ranked BPE already encodes as llama.cpp does."""
    if not scores_tie(vocabulary):
        return None
    encoder = build_tokenizer(vocabulary)
    model = encoder.model
    model.ignore_merges = True  # a finished piece is a token as it is; a lone unknown character falls back to bytes
    encoder.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(SentencePieceSegmenter(vocabulary))
    return encoder


def gguf_hf_tokenizer(path: str | Path) -> tuple[Any, Tokenizer | None]:
    """A transformers fast tokenizer around `build_tokenizer`, with the file's special tokens and
    chat template, and the encoder `build_encoder` gives (what pagoda.tokenizer.Tokenizer wraps)."""
    from transformers import PreTrainedTokenizerFast

    vocabulary = read_gguf_vocabulary(path)
    special = {
        name: vocabulary.token(token_id)
        for name, token_id in (
            ("bos_token", vocabulary.bos_token_id),
            ("eos_token", vocabulary.eos_token_id),
            ("unk_token", vocabulary.unknown_token_id),
            ("pad_token", vocabulary.padding_token_id),
        )
    }
    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocabulary),
        name_or_path=str(path),
        clean_up_tokenization_spaces=False,
        **{name: piece for name, piece in special.items() if piece is not None},
    )
    if vocabulary.chat_template:
        hf.chat_template = vocabulary.chat_template
    return hf, build_encoder(vocabulary)
