"""Batched sampling on the logits' device: one set of tensor operations for every row, no per-row loop.

Order of operations (as vLLM and transformers apply them): penalties on the raw logits, then each row's
logit bias (OpenAI's), then the bans (min-tokens, bad words) and the allowed sets (grammars' masks for
structured outputs, `allowed_token_ids`); greedy rows
take the argmax; the others are divided by their temperature, filtered by min-p, top-k and top-p, and drawn
with the exponential-race trick (`argmax(p / E)`, E ~ Exp(1)), which equals sampling from p.

Randomness is counter-based: the noise for (sequence seed, output position, token id) is a hash, so a
seeded request gives the same tokens whatever else is in the batch, on any device, without a per-row
torch.Generator. Log-probabilities returned are those of the raw model distribution (log_softmax of the
logits), as OpenAI reports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .scheduler import SamplingRow
from .sequence import TokenLogprob
from .structured_output import fill_allowed_token_masks, mask_disallowed
from .transfer import to_device

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiply; logical shifts made by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def mix_seed(seed: int, stream: int) -> int:
    """A well-mixed 64-bit seed for choice `stream` of a request seeded with `seed` (host side): `_splitmix64`
    on Python integers, to the same bits. NOTE: not through a one-element tensor, which took ~20 us a
    request (10 ms of adding 500 requests at once)."""
    x = (seed * 0x100000001B3 + stream * _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return _signed64(x ^ (x >> 31))


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] i.i.d. Exp(1) noise, a pure function of (seed, position, token id)."""
    base = _splitmix64(seeds * _GOLDEN + positions)  # [rows]
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _splitmix64(base[:, None] + token[None, :] * _MIX2)  # [rows, vocab]
    uniform = (((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) + 0.5) * (1.0 / (1 << 53))  # (0, 1)
    return (-torch.log(uniform)).to(torch.float32)


@dataclass(frozen=True)
class SamplingBatch:
    """The rows' parameters as tensors, built once per step from the plan's sampling rows.

    NOTE: an all-greedy batch without penalties (the common serving case) needs no parameter tensors:
    its tensor fields are None and nothing is copied to the device.
    """

    all_greedy: bool
    any_top_k_or_p: bool
    any_min_p: bool
    penalties: "PenaltyBatch | None"
    num_logprobs: int  # top alternatives to return (max over rows), -1 when no row asks
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) that must not be drawn
    bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # ((rows, token ids), values)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [k], their allowed tokens' bitmasks [k, vocab / 32])
    temperature: torch.Tensor | None = None  # [rows] float32, 1.0 for greedy rows
    top_p: torch.Tensor | None = None  # [rows] float32
    min_p: torch.Tensor | None = None  # [rows] float32
    greedy: torch.Tensor | None = None  # [rows] bool
    top_k: torch.Tensor | None = None  # [rows] int64, vocab_size when off
    seeds: torch.Tensor | None = None  # [rows] int64
    positions: torch.Tensor | None = None  # [rows] int64, output position of the token being drawn

    @property
    def plain_greedy(self) -> bool:
        """Every row takes its argmax of the raw logits: no penalty, bias, ban, grammar or log-probability to
        compute."""
        return (self.all_greedy and self.penalties is None and self.bias is None and self.banned is None
                and self.allowed is None and self.num_logprobs < 0)

    @classmethod
    def from_rows(cls, rows: tuple[SamplingRow, ...], vocab_size: int, device: torch.device,
                  eos_token_ids: tuple[int, ...] = ()) -> "SamplingBatch":
        """`eos_token_ids` are banned, with each row's stop_token_ids, until the row has min_tokens."""
        params = [row.params for row in rows]
        # NOTE: a top_k above the vocabulary restricts nothing (and may not fit an int64: the API bounds
        # it below only)
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        flags = dict(
            all_greedy=all(p.greedy for p in params),
            any_top_k_or_p=any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            penalties=PenaltyBatch.from_rows(rows, vocab_size, device) if any(p.uses_penalties for p in params)
            else None,
            num_logprobs=max(asked) if asked else -1,
            banned=_bans(rows, eos_token_ids, vocab_size, device),
            bias=_logit_biases(rows, device),
            allowed=_allowed_masks(rows, vocab_size, device),
        )
        if flags["all_greedy"]:
            return cls(**flags)
        floats = to_device(torch.tensor([[1.0 if p.greedy else p.temperature for p in params],
                                         [p.top_p for p in params], [p.min_p for p in params]]), device)
        ints = to_device(torch.tensor([[int(p.greedy) for p in params], top_k,
                                       [row.rng_seed for row in rows], [row.output_position for row in rows]],
                                      dtype=torch.int64), device)
        return cls(**flags, temperature=floats[0], top_p=floats[1], min_p=floats[2], greedy=ints[0].bool(),
                   top_k=ints[1], seeds=ints[2], positions=ints[3])


def _bans(rows, eos_token_ids, vocab_size, device):
    """(row, token) pairs that may not be drawn now: end-of-sequence and stop ids before min_tokens, and the
    last token of each bad word whose other tokens the output ends on."""
    pairs = []
    for i, row in enumerate(rows):
        # NOTE: not under a grammar, which decides where the output ends (a ban could leave no token allowed)
        if row.output_position < row.params.min_tokens and row.grammar is None:
            ids = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else set(eos_token_ids))
            pairs += [(i, t) for t in sorted(ids) if 0 <= t < vocab_size]
        if row.bad_words:
            pairs += [(i, t) for t in sorted(_bad_word_ends(row.bad_words, row.output_token_ids))]
    if not pairs:
        return None
    packed = to_device(torch.tensor(pairs, dtype=torch.int64).t().contiguous(), device)
    return packed[0], packed[1]


def _logit_biases(rows, device):
    """((rows, token ids), values) of the rows' logit_bias entries, or None when no row has any.
    NOTE: the token ids were checked against the vocabulary when the request came in."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias is not None]  # NOTE: every step: cheap
    if not biased:
        return None
    entries = [(i, token, bias) for i in biased for token, bias in rows[i].params.logit_bias.items()]
    index = to_device(torch.tensor([[i for i, _, _ in entries], [t for _, t, _ in entries]], dtype=torch.int64),
                      device)
    return (index[0], index[1]), to_device(torch.tensor([b for _, _, b in entries], dtype=torch.float32), device)


def _bad_word_ends(bad_words: tuple[tuple[int, ...], ...], output: tuple[int, ...]) -> set[int]:
    """The last tokens of the bad words whose tokens before it end the output (a one-token word: always)."""
    ends = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= len(output) and (prefix == 0 or output[len(output) - prefix:] == word[:-1]):
            ends.add(word[-1])
    return ends


def _allowed_masks(rows, vocab_size, device):
    """(rows, bitmasks) of the rows that may draw only some tokens, or None when no row is limited: a
    grammar's next tokens (structured outputs), `allowed_token_ids`, or both (the tokens in each)."""
    limited = [i for i, row in enumerate(rows)  # NOTE: every step: cheap
               if row.grammar is not None or row.allowed_mask is not None]
    if not limited:
        return None
    masks = torch.full((len(limited), (vocab_size + 31) // 32), -1, dtype=torch.int32)  # every token
    fill_allowed_token_masks(masks, [(rows[i].grammar, k) for k, i in enumerate(limited)
                                     if rows[i].grammar is not None])
    for k, i in enumerate(limited):
        if rows[i].allowed_mask is not None:
            masks[k] &= rows[i].allowed_mask
    return to_device(torch.tensor(limited, dtype=torch.int64), device), to_device(masks, device)


@dataclass(frozen=True)
class PenaltyBatch:
    repetition: torch.Tensor  # [rows] float32
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    prompt_tokens: torch.Tensor  # [rows, max_prompt] int64, padded with vocab_size
    output_tokens: torch.Tensor  # [rows, max_output] int64, padded with vocab_size

    @classmethod
    def from_rows(cls, rows, vocab_size: int, device: torch.device) -> "PenaltyBatch":
        def padded(lists):
            width = max(1, max(len(tokens) for tokens in lists))
            host = torch.tensor([list(t) + [vocab_size] * (width - len(t)) for t in lists], dtype=torch.int64)
            return to_device(host, device)

        weights = to_device(torch.tensor([[r.params.repetition_penalty for r in rows],
                                          [r.params.presence_penalty for r in rows],
                                          [r.params.frequency_penalty for r in rows]]), device)
        return cls(
            repetition=weights[0],
            presence=weights[1],
            frequency=weights[2],
            prompt_tokens=padded([r.prompt_token_ids for r in rows]),
            output_tokens=padded([r.output_token_ids for r in rows]),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Repetition penalty (transformers' rule, prompt and output tokens), then OpenAI's presence and
        frequency penalties (output tokens only): logit -= frequency * count + presence * (count > 0)."""
        rows, vocab = logits.shape
        counts = torch.zeros(rows, vocab + 1, device=logits.device, dtype=logits.dtype)
        counts.scatter_add_(1, self.output_tokens, torch.ones_like(self.output_tokens, dtype=logits.dtype))
        counts = counts[:, :vocab]  # [rows, vocab]
        seen = torch.zeros(rows, vocab + 1, device=logits.device, dtype=torch.bool)
        seen.scatter_(1, self.prompt_tokens, True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = self.repetition[:, None].to(logits.dtype)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).to(logits.dtype)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32, of the chosen tokens; None when no row asks
    top_ids: torch.Tensor | None  # [rows, k]
    top_logprobs: torch.Tensor | None  # [rows, k]
    ranks: torch.Tensor | None = None  # [rows] int64, of given tokens (`score_tokens`)

    @classmethod
    def concat(cls, parts: list["SamplerOutput"]) -> "SamplerOutput":
        """The rows of several outputs (made alike) as one."""
        fields = [f.name for f in dataclasses.fields(cls)]
        return cls(*(None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
                     for name in fields))

    def copy_to_host(self, stream: "torch.cuda.Stream | None" = None) -> "HostSamples":
        """Start the copy to the host without waiting for it (pinned memory, an event marks the end), on
        `stream` if given (CUDA), after the work queued so far on the current one.

        Why a stream of its own: on the step's stream the copy sat between the sampling and the next
        step's first kernel, a hand-over of the copy engine each way. NOTE: `token_ids` may be a buffer
        the next step's sampling overwrites: that step must wait for `HostSamples.copied` first."""
        tensors = (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, self.ranks)
        if self.token_ids.device.type != "cuda":  # NOTE: copies: token_ids may be the runner's reused buffer
            return HostSamples(*(None if t is None else t.clone() for t in tensors))
        current = torch.cuda.current_stream(self.token_ids.device)
        stream = stream or current
        if stream != current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            host = tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                t, non_blocking=True) for t in tensors)
            for t in tensors:
                if t is not None:  # NOTE: the allocator must not hand their memory out before the copy read it
                    t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return HostSamples(*host, copied=event)


@dataclass(frozen=True)
class HostSamples:
    token_ids: torch.Tensor  # [rows] int64, on the host
    logprobs: torch.Tensor | None  # [rows] float32
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor | None = None
    copied: "torch.cuda.Event | None" = None  # recorded after the device-to-host copies

    def read(self, rows: tuple[SamplingRow, ...]) -> list[TokenLogprob]:
        """NOTE: the step's one device-to-host synchronisation (waits for the copies)."""
        return self.read_tops([row.params.logprobs or 0 for row in rows])

    def read_tops(self, num_tops: list[int]) -> list[TokenLogprob]:
        """One TokenLogprob a row, with the row's first num_tops[i] alternatives (waits for the copies)."""
        if self.copied is not None:
            self.copied.synchronize()
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else [None] * len(ids)
        ranks = self.ranks.tolist() if self.ranks is not None else [None] * len(ids)
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out = []
        for i, k in enumerate(num_tops):
            top = tuple(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None and k else ()
            out.append(TokenLogprob(ids[i], lps[i], top, ranks[i]))
        return out


def sample(logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [rows, vocab] -> one token per row, with its log-probability. `out`: [rows] int64, where the
    token ids go (the runner's buffer, which the next decode graph reads its pending inputs from)."""
    if batch.plain_greedy:  # NOTE: the argmax of the logits as they are: float32 would give the same token
        return SamplerOutput(_argmax(logits, out), None, None, None)
    logits = logits.float()
    raw_logits = logits  # NOTE: logprobs are of the model's own distribution, before any penalty
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.bias is not None:
        index, values = batch.bias
        logits = logits.index_put(index, values, accumulate=True)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = mask_disallowed(logits, *batch.allowed)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        scaled = logits / batch.temperature[:, None]
        if batch.any_min_p:
            probs = torch.softmax(scaled, dim=-1)
            threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        if batch.any_top_k_or_p:
            scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = exponential_noise(batch.seeds, batch.positions, logits.shape[-1])
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(batch.greedy, tokens, drawn)
    if out is not None:
        tokens = out.copy_(tokens)
    top_ids = top_lps = None
    if batch.num_logprobs > 0:
        raw_logprobs = torch.log_softmax(raw_logits, dim=-1)  # [rows, vocab]
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        top_lps, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
    elif batch.num_logprobs == 0:  # the chosen token's only: no need for the whole log-softmax
        chosen = raw_logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(raw_logits, dim=-1)
    else:  # NOTE: no row asked for log-probabilities: none are computed (as in vLLM)
        chosen = None
    # the chosen token's rank in the model's distribution (1: the most likely; ties rank alike), as vLLM's
    # Logprob.rank: a comparison over the row, where log-probabilities are asked for anyway
    ranks = None if chosen is None else (raw_logits > raw_logits.gather(1, tokens[:, None])).sum(dim=-1) + 1
    return SamplerOutput(tokens, chosen, top_ids, top_lps, ranks)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> SamplerOutput:
    """Given tokens' log-probabilities under the raw logits (prompt tokens: `SamplingParams.prompt_logprobs`),
    their ranks (1: the most likely; ties rank alike) and each row's `num_top` most likely tokens.
    logits: [rows, vocab], targets: [rows] int64."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_lps, top_ids = logprobs.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return SamplerOutput(targets, chosen[:, 0], top_ids, top_lps, ranks)


def _argmax(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Each row's first maximal column, [rows] int64: a Triton kernel on CUDA (kernels/tokens.py: torch's
    argmax reduces a row in one block of threads, 10-25 us for a vocabulary), torch elsewhere."""
    if logits.is_cuda:
        from .kernels.tokens import argmax

        return argmax(logits, out)
    return torch.argmax(logits, dim=-1, out=out)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's k most likely tokens and the smallest set whose probability reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # top-p acts on what top-k kept, renormalised
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]  # NOTE: rank 0 has mass_before 0, so one token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
