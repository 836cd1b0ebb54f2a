"""Turn one step's logits into tokens, each row with its own request's sampling knobs.

Order, as in vLLM: logit bias and min_tokens masking, then penalties, then the token bans
(allowed_token_ids, bad_words: one mask for the whole batch), then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential-race trick
(argmax p/q, q ~ Exp(1)) so that a seeded request draws only from its own generator and gets
the same tokens whatever else is in the batch. Reported logprobs are those of the raw model
distribution (before any processing), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.outputs import Logprob, PositionLogprobs
from pagoda.request import Request


class DraftedRow:
    """A request as seen at a drafted position: as if `extra` tokens had been accepted, so
    penalties and min_tokens apply exactly as they would without speculation."""

    __slots__ = ("request", "extra")

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request = request
        self.extra = extra

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def eos_token_ids(self):
        return self.request.eos_token_ids

    @property
    def generator(self):
        return self.request.generator

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row; None where the request did not ask


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits [N, V] float32, one row per request about to receive a token."""
        raw_logits = logits
        logits = self.process(logits, requests)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not random_rows:  # all greedy (the common case): one argmax, no row gathers
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if greedy_rows and random_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = logits[rows].argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in random_rows])

        sampled = token_ids.tolist()
        wanted = [r.sampling_params.logprobs for r in requests]
        logprobs: list[PositionLogprobs | None] = [None] * len(requests)
        if any(k is not None for k in wanted):
            asking = [i for i, k in enumerate(wanted) if k is not None]
            computed = position_logprobs(
                raw_logits[asking], [sampled[i] for i in asking], [k for k in wanted if k is not None]
            )
            for i, entry in zip(asking, computed):
                logprobs[i] = entry
        return SamplerOutput(sampled, logprobs)

    # ---- processing ----------------------------------------------------------------------------

    def process(self, logits: torch.Tensor, requests: Sequence[Request | DraftedRow]) -> torch.Tensor:
        """Logit bias, min_tokens masking and penalties (the processing greedy decoding sees too)."""
        needs_copy = any(
            r.sampling_params.logit_bias
            or r.sampling_params.needs_penalties
            or r.sampling_params.bans_tokens
            or r.num_output_tokens < r.sampling_params.min_tokens
            for r in requests
        )
        if not needs_copy:
            return logits
        logits = logits.clone()
        for i, request in enumerate(requests):
            params = request.sampling_params
            row = logits[i]
            if params.logit_bias:
                # Token ids were checked against the vocabulary when the request was added.
                ids = torch.tensor(list(params.logit_bias), device=row.device)
                row[ids] += torch.tensor(list(params.logit_bias.values()), device=row.device)
            if request.num_output_tokens < params.min_tokens:
                stop_ids = [t for t in set(params.stop_token_ids) | set(request.eos_token_ids) if t < self.vocab_size]
                if stop_ids:
                    row[torch.tensor(stop_ids, device=row.device)] = float("-inf")
            if params.needs_penalties:
                self._apply_penalties(row, request)
        self._apply_bans(logits, requests)
        return logits

    @staticmethod
    def _apply_bans(logits: torch.Tensor, requests: Sequence[Request | DraftedRow]) -> None:
        """allowed_token_ids and bad_words of every row, as one boolean mask filled at once."""
        restricted: list[int] = []  # rows limited to their allowed tokens
        allowed: tuple[list[int], list[int]] = ([], [])  # (row, token) pairs allowed
        banned: tuple[list[int], list[int]] = ([], [])  # (row, token) pairs banned by a bad word
        vocab = logits.shape[-1]
        for i, request in enumerate(requests):
            params = request.sampling_params
            if params.allowed_token_ids is not None:
                restricted.append(i)
                ids = [t for t in params.allowed_token_ids if t < vocab]
                allowed[0].extend([i] * len(ids))
                allowed[1].extend(ids)
            if params.bad_words_token_ids:
                ids = [t for t in _bad_word_endings(params.bad_words_token_ids, request.output_token_ids) if t < vocab]
                banned[0].extend([i] * len(ids))
                banned[1].extend(ids)
        if not restricted and not banned[0]:
            return
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        if restricted:
            mask[torch.tensor(restricted, device=logits.device)] = True
            mask[torch.tensor(allowed[0], device=logits.device), torch.tensor(allowed[1], device=logits.device)] = False
        if banned[0]:
            mask[torch.tensor(banned[0], device=logits.device), torch.tensor(banned[1], device=logits.device)] = True
        logits.masked_fill_(mask, float("-inf"))

    def _apply_penalties(self, row: torch.Tensor, request: Request | DraftedRow) -> None:
        params = request.sampling_params
        if params.repetition_penalty != 1.0:
            # Applies to every token seen so far, prompt included (as transformers and vLLM do).
            seen = torch.tensor(request.all_token_ids, device=row.device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
            # OpenAI's definition: only generated tokens count.
            counts = torch.bincount(
                torch.tensor(request.output_token_ids, device=row.device), minlength=self.vocab_size
            )[: self.vocab_size].to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        probs = self.probabilities(logits, requests)
        race = torch.empty_like(probs)
        race.exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                race[i].exponential_(generator=request.generator)
        return (probs / race).argmax(dim=-1)

    def draw(self, probs: torch.Tensor, row: Request | DraftedRow) -> int:
        """One token from a probability vector, with the request's own generator if seeded."""
        race = torch.empty_like(probs).exponential_(generator=row.generator or self.generator)
        return int((probs / race).argmax())

    def uniform(self, row: Request | DraftedRow) -> float:
        generator = row.generator or self.generator
        return float(torch.rand((), generator=generator, device=generator.device))

    def probabilities(self, logits: torch.Tensor, requests: Sequence[Request | DraftedRow]) -> torch.Tensor:
        """Processed logits -> the distribution a non-greedy request samples from:
        temperature, then top-k, top-p and min-p."""
        params = [r.sampling_params for r in requests]
        temperatures = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temperatures
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            probs = logits.softmax(dim=-1)
            threshold = torch.tensor(min_p, device=logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits.softmax(dim=-1)


def _bad_word_endings(words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    endings = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or output_token_ids[-len(prefix) :] == prefix:
            endings.append(word[-1])
    return endings


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    sorted_logits = sorted_logits.masked_fill(mass_before >= ps, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def position_logprobs(logits: torch.Tensor, chosen: Sequence[int], top_k: Sequence[int]) -> list[PositionLogprobs]:
    """Per row: {token: Logprob} for the chosen token and the row's top-k tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_t = torch.tensor(list(chosen), device=logits.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen_t)
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_values = chosen_lp.squeeze(1).tolist()
    max_k = max(top_k) if top_k else 0
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k:
        top = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    result = []
    for row, token_id in enumerate(chosen):
        entry: PositionLogprobs = {token_id: Logprob(chosen_values[row], ranks[row])}
        for j in range(top_k[row]):
            tid = top_ids[row][j]
            if tid not in entry:
                entry[tid] = Logprob(top_values[row][j], j + 1)
        result.append(entry)
    return result
