"""A small HF-transformers generation engine that batches concurrent requests into one decode loop.

Requests arrive from the HTTP server's handlers; one engine thread gathers whatever is queued
(up to ``max_batch_size`` sequences, waiting at most ``batch_wait_ms`` for more), runs a single
KV-cached sampling loop over all of them, and resolves each request's future. Log-probabilities are
those of the distribution each token was drawn from (logits / temperature, top-p renormalised), as
vLLM reports them with ``logprobs_mode=processed_logprobs``; prompt log-probs stay temperature-1.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nexrl_hpc.checkpoint.adapter import is_adapter_dir
from nexrl_hpc.checkpoint.hf import read_safetensors_dir
from nexrl_hpc.inference import lora_adapter
from nexrl_hpc.models.tiny import load_model, load_tokenizer, stop_token_ids

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions per forward when scoring a prompt (its logits' rows)


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # OpenAI's ``seed``: this request's draws, whatever else shares its batch


@dataclass
class GenerationRequest:
    prompts: list[list[int]]  # token ids per prompt
    params: SamplingParams
    future: Future = field(default_factory=Future)
    first_prompt: int = 0  # a part of a split request: where its prompts and samples sit in the whole
    first_sample: int = 0  #   (a seeded request's rows keep their streams whatever the split)

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    weight_version: int


class EngineError(RuntimeError):
    pass


@dataclass
class _Rows:
    """One engine batch as rows: every sample of every prompt of every request, with its sampling settings."""

    prompts: list[list[int]] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    max_new: list[int] = field(default_factory=list)
    stops: list[tuple[int, ...]] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)  # per row, from its request's seed

    @classmethod
    def of(cls, batch: list[GenerationRequest], default_stop_ids: tuple[int, ...]) -> _Rows:
        rows = cls()
        for req in batch:
            p = req.params
            for prompt_index, ids in enumerate(req.prompts, start=req.first_prompt):
                for sample in range(req.first_sample, req.first_sample + p.n):
                    rows.prompts.append(ids)
                    rows.temperatures.append(p.temperature)
                    rows.top_ps.append(p.top_p)
                    rows.max_new.append(p.max_tokens)
                    rows.stops.append(p.stop_token_ids or default_stop_ids)
                    rows.seeds.append(None if p.seed is None else row_seed(p.seed, prompt_index, sample))
        return rows


def row_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The generator seed of one row of a seeded request: its own stream for each prompt and sample
    (``n`` samples of one prompt differ), the same for the same request wherever it is batched."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class HFEngine:
    """Owns the model; the only thread that runs it is the engine loop (reloads take the same lock)."""

    def __init__(
        self,
        model_dir: str,
        max_batch_size: int,
        batch_wait_ms: float,
        seed: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
        *,
        stop_timeout_s: float,
    ):
        self.model_dir = model_dir
        self.stop_timeout_s = stop_timeout_s  # stop() waits this long for the engine loop
        self.tokenizer = load_tokenizer(model_dir)
        self.device = torch.device(device)
        self.model = load_model(
            model_dir, dtype=dtype, device=self.device, attn_implementation=attn_implementation
        ).eval()
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.default_stop_ids = stop_token_ids(model_dir, self.tokenizer)  # a request without its own
        self.pad_token_id = self.tokenizer.pad_token_id
        self.weight_version = 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._model_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stopped = False
        self._thread.start()

    # --- public API -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request of at most ``max_batch_size`` sequences (``split`` cuts bigger ones)."""
        if self._stopped:
            raise EngineError("engine is stopped")
        if request.num_sequences > self.max_batch_size:
            raise ValueError(
                f"{request.num_sequences} sequences in one request, more than the engine's batch of "
                f"{self.max_batch_size} (service.inference_service.local.max_batch_size)"
            )
        self.validate(request.prompts, request.params)
        self._queue.put(request)
        return request.future

    def split(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationRequest]:
        """Requests of at most ``max_batch_size`` sequences each whose outputs, concatenated, are
        those of ``prompts`` x ``params.n`` in order: one HTTP request never becomes a batch larger
        than the engine's (a 4,000-prompt x n=4 request ran as one 16,000-row batch before)."""
        cap = self.max_batch_size
        if params.n <= cap:
            per = cap // params.n
            return [
                GenerationRequest(prompts[i : i + per], params, first_prompt=i)
                for i in range(0, len(prompts), per)
            ]
        return [
            GenerationRequest(
                [ids], replace(params, n=min(cap, params.n - done)), first_prompt=i, first_sample=done
            )
            for i, ids in enumerate(prompts)
            for done in range(0, params.n, cap)
        ]

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """ValueError (a 400) for what the model cannot take: ids outside its vocabulary, a prompt
        and completion longer than its context, an empty prompt, no tokens to generate."""
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        for i, ids in enumerate(prompts):
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                # CPU: an IndexError mid-batch; CUDA: a device-side assert that kills the engine
                raise ValueError(
                    f"prompt {i}: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
                )
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{params.max_tokens} for the completion)."
                )
            if not ids:
                raise ValueError("prompt is empty")

    def load_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> str:
        """Swap in weights from an HF-layout directory between two batches; returns a message. A
        LoRA policy's adapter directory (PEFT layout) is applied to the base (``lora_adapter``)."""
        if is_adapter_dir(model_path):
            return lora_adapter.load_adapter(self, model_path, weight_version)
        state = read_safetensors_dir(model_path)
        with self._model_lock:
            current = self.model.state_dict()
            unknown = sorted(set(state) - set(current))
            if unknown:
                raise EngineError(f"{model_path}: unexpected weights {unknown[:5]}")
            missing = sorted(set(current) - set(state))
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied:
                raise EngineError(f"{model_path}: missing weights {sorted(set(missing) - tied)[:5]}")
            for name, tensor in state.items():
                if current[name].shape != tensor.shape:
                    raise EngineError(
                        f"{model_path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(current[name].shape)}"
                    )
            self.model.load_state_dict(state, strict=False)
            self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
        return f"loaded {len(state)} tensors from {model_path} as version {self.weight_version}"

    @torch.no_grad()
    def prompt_log_probs(self, prompts: list[list[int]]) -> list[list[float]]:
        """log p(token i | tokens < i) for i >= 1 of each prompt (teacher-forced, the raw
        log-softmax in fp32, as vLLM's ``prompt_logprobs``): one prompt per forward, no padding,
        between two generation batches and never across a reload (the model lock)."""
        self.validate(prompts, SamplingParams(max_tokens=1))
        out: list[list[float]] = []
        with self._model_lock:
            for ids in prompts:
                out.append(self._prompt_log_probs(torch.tensor(ids, device=self.device)))
        return out

    def _prompt_log_probs(self, tokens: torch.Tensor) -> list[float]:
        """One prompt, ``PROMPT_LOGPROBS_CHUNK`` positions at a time through the KV cache: the
        logits held at once stay [chunk, vocab], whatever the prompt's length."""
        chunk, cache, pieces = PROMPT_LOGPROBS_CHUNK, None, []
        for start in range(0, len(tokens) - 1, chunk):
            part = tokens[start : start + chunk]
            out = self.model(input_ids=part[None], past_key_values=cache, use_cache=len(tokens) - 1 > chunk)
            cache = out.past_key_values
            targets = tokens[start + 1 : start + 1 + len(part)]
            log_p = torch.log_softmax(out.logits[0, : len(targets)].float(), dim=-1)
            pieces.append(log_p.gather(-1, targets[:, None]).squeeze(-1))
        return torch.cat(pieces).cpu().tolist()

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=self.stop_timeout_s)

    # --- engine loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        pending: GenerationRequest | None = None
        while True:
            first = pending or self._queue.get()
            pending = None
            if first is None:
                return
            batch = [first]
            size = first.num_sequences
            deadline = time.monotonic() + self.batch_wait_s
            while size < self.max_batch_size:
                timeout = deadline - time.monotonic()
                try:
                    nxt = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                if size + nxt.num_sequences > self.max_batch_size:
                    pending = nxt
                    break
                batch.append(nxt)
                size += nxt.num_sequences
            try:
                with self._model_lock:
                    outputs = self._generate(batch)
                for req, outs in zip(batch, outputs):
                    req.future.set_result(outs)
            except Exception as exc:  # fail the requests, keep serving
                logger.exception("generation failed")
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)

    @torch.no_grad()
    def _generate(self, batch: list[GenerationRequest]) -> list[list[GenerationOutput]]:
        rows = _Rows.of(batch, self.default_stop_ids)
        logits, cache, attention, next_pos, padded = self._prefill(rows.prompts)
        decoded = self._decode(rows, logits, cache, attention, next_pos, padded)
        return self._outputs(batch, *decoded)

    def _prefill(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, bool]:
        """Every row's prompt through the model: (last logits, KV cache, attention mask, next
        positions, whether prompts are padded). Prefix sharing: each distinct prompt is prefilled
        once, its KV cache is then copied to its rows."""
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = torch.tensor(
            [unique.setdefault(tuple(ids), len(unique)) for ids in prompts], device=self.device
        )
        unique_prompts = list(unique)
        lengths_u = [len(u) for u in unique_prompts]
        width = max(lengths_u)
        padded = min(lengths_u) != width
        input_ids = torch.full((len(unique_prompts), width), self.pad_token_id, dtype=torch.long)
        attention_u = torch.zeros((len(unique_prompts), width), dtype=torch.long)
        for i, unique_ids in enumerate(unique_prompts):
            input_ids[i, width - len(unique_ids) :] = torch.tensor(unique_ids)
            attention_u[i, width - len(unique_ids) :] = 1
        input_ids = input_ids.to(self.device)
        attention_u = attention_u.to(self.device)
        positions_u = (attention_u.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_u if padded else None,  # equal lengths: plain causal attention
            position_ids=positions_u,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        if len(unique_prompts) != len(prompts):
            cache.batch_select_indices(row_to_unique)
        logits = out.logits[:, -1, :].float()[row_to_unique]
        attention = attention_u[row_to_unique]
        next_pos = positions_u[row_to_unique][:, -1:] + 1
        return logits, cache, attention, next_pos, padded

    def _decode(
        self,
        rows: _Rows,
        logits: torch.Tensor,
        cache: Any,
        attention: torch.Tensor,
        next_pos: torch.Tensor,
        padded: bool,
    ) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]]:
        """Token by token until every row stopped: (tokens, logprobs, lengths, stopped by a stop token)."""
        n_rows = len(rows.prompts)
        temperature = torch.tensor(rows.temperatures, dtype=torch.float32, device=self.device)
        top_p = torch.tensor(rows.top_ps, dtype=torch.float32, device=self.device)
        limit = torch.tensor(rows.max_new, device=self.device)
        stop_sets = [set(s) for s in rows.stops]
        default_stops = set(self.default_stop_ids)
        uniform_stop = all(s == default_stops for s in stop_sets)
        default_stop_tensor = torch.tensor(self.default_stop_ids, device=self.device)

        generators = (  # None unless a request of the batch is seeded: the shared draw as before
            [
                None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
                for seed in rows.seeds
            ]
            if any(seed is not None for seed in rows.seeds)
            else None
        )
        tokens: list[torch.Tensor] = []
        logps: list[torch.Tensor] = []
        done = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        finished_by_stop = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(n_rows, dtype=torch.long, device=self.device)
        max_steps = int(limit.max())
        for step in range(max_steps):
            chosen, chosen_logp = self._sample(logits, temperature, top_p, generators)
            chosen = torch.where(done, torch.full_like(chosen, self.pad_token_id), chosen)
            tokens.append(chosen)
            logps.append(chosen_logp)
            active = ~done
            lengths += active.long()
            if uniform_stop:
                hit = torch.isin(chosen, default_stop_tensor)
            else:
                hit = torch.tensor(
                    [int(t) in s for t, s in zip(chosen.tolist(), stop_sets)], device=self.device
                )
            finished_by_stop |= active & hit
            done |= active & (hit | (lengths >= limit))
            if bool(done.all()) or step == max_steps - 1:
                break
            if padded:
                attention = torch.cat(
                    [attention, torch.ones((n_rows, 1), dtype=attention.dtype, device=self.device)], dim=1
                )
            out = self.model(
                input_ids=chosen[:, None],
                attention_mask=attention if padded else None,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        return (
            torch.stack(tokens, dim=1).tolist(),
            torch.stack(logps, dim=1).tolist(),
            lengths.tolist(),
            finished_by_stop.tolist(),
        )

    def _outputs(
        self,
        batch: list[GenerationRequest],
        token_mat: list[list[int]],
        logp_mat: list[list[float]],
        lengths_list: list[int],
        stop_list: list[bool],
    ) -> list[list[GenerationOutput]]:
        """The decoded rows back as each request's outputs (rows in request, prompt, sample order)."""
        results: list[list[GenerationOutput]] = []
        row = 0
        for req in batch:
            outs: list[GenerationOutput] = []
            for ids in req.prompts:
                for _ in range(req.params.n):
                    n_tok = lengths_list[row]
                    outs.append(
                        GenerationOutput(
                            prompt_token_ids=list(ids),
                            token_ids=token_mat[row][:n_tok],
                            logprobs=logp_mat[row][:n_tok],
                            finish_reason="stop" if stop_list[row] else "length",
                            weight_version=self.weight_version,
                        )
                    )
                    row += 1
            results.append(outs)
        return results

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        generators: list[torch.Generator | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob under the distribution it was drawn from, as vLLM's
        ``logprobs_mode=processed_logprobs`` reports it: log-softmax of logits / temperature, over
        top-p's kept tokens renormalised; a greedy row (temperature 0) reports the raw log-softmax.
        A row with a generator of its own (a seeded request) draws from it, the others together
        from the engine's."""
        greedy = logits.argmax(dim=-1)
        sampled_rows = temperature > 0
        scaled = logits / torch.where(sampled_rows, temperature, torch.ones_like(temperature))[:, None]
        log_p = torch.log_softmax(scaled, dim=-1)
        if not bool(sampled_rows.any()):
            return greedy, log_p.gather(-1, greedy[:, None]).squeeze(-1)
        probs = torch.softmax(scaled, dim=-1)
        truncated = sampled_rows & (top_p < 1.0)
        if bool(truncated.any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            drop = ((cumulative - sorted_probs) > top_p[:, None]) & truncated[:, None]
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            kept = torch.zeros_like(drop).scatter(-1, order, ~drop)
            log_p = log_p.masked_fill(~kept, -torch.inf)
            log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # renormalised over the kept
        if generators is None:
            sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
        else:
            sampled = torch.empty_like(greedy)
            shared = [i for i, g in enumerate(generators) if g is None]
            if shared:
                sampled[shared] = torch.multinomial(probs[shared], 1, generator=self._generator).squeeze(-1)
            for i, generator in enumerate(generators):
                if generator is not None:
                    sampled[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
        chosen = torch.where(sampled_rows, sampled, greedy)
        return chosen, log_p.gather(-1, chosen[:, None]).squeeze(-1)
