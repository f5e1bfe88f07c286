"""Continuous batching: one forward pass per step over every active sequence; sequences join and leave each step.

Requests queue in ``submit`` (from Triton's ``execute``) and join at the next step when
the KV cache has room for their prompt and ``max_tokens`` (prefix blocks already
computed are shared, see ``coalesce.generation.blocks``). Each step packs one token per
decoding sequence and chunks of prompts up to ``max_prefill_tokens``, so decoding
never stalls behind a long prompt, runs one forward pass, samples, and answers: a
streaming request gets its new text every step, and a sequence that ends (``max_tokens``,
end of sequence, a stop string, the context) gets its final response and frees its
blocks the same step. A cancelled request is dropped within one step. With
``generation_batching: request`` the engine admits only into an empty batch, which then
runs until its last sequence ends: static batching, for comparison.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from coalesce.core.errors import (
    CancelledError,
    CoalesceError,
    ConfigError,
    InvalidInputError,
    RuntimeFailure,
    UnavailableError,
)
from coalesce.generation.blocks import BlockPool, prefix_digests
from coalesce.generation.events import FINISH_LENGTH, FINISH_STOP, GenerationEvent, Sink
from coalesce.generation.model import CausalLM, KVCache, StepInput
from coalesce.generation.request import GenerationRequest
from coalesce.generation.sampling import sample
from coalesce.generation.text import IncrementalText
from coalesce.observability.log import Logger
from coalesce.observability.metrics import GenerationMetrics
from coalesce.runtimes.cores import CoreBoard, marked
from coalesce.settings import GenerateOptions


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def encode(self, text: str) -> Any:
        """An encoding whose ``ids`` are the tokens of ``text``, special tokens added."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        ...


@dataclasses.dataclass(eq=False)
class _Sequence:
    id: int
    request: GenerationRequest
    prompt: list[int]
    sink: Sink
    is_cancelled: Callable[[], bool] | None
    arrived_s: float
    text: IncrementalText
    generator: torch.Generator | None
    total_tokens: int
    digests: list[bytes]
    generated: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    #: The cache slot of each position the sequence may fill (its blocks are all taken when it joins).
    slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    computed: int = 0
    registered: int = 0
    first_token_s: float = 0.0
    last_token_s: float = 0.0

    def token(self, position: int) -> int:
        return self.prompt[position] if position < len(self.prompt) else self.generated[position - len(self.prompt)]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


def _cancelled(sequences: list[_Sequence]) -> list[_Sequence]:
    """Those of ``sequences`` whose client cancelled them."""
    return [s for s in sequences if s.is_cancelled is not None and s.is_cancelled()]


class GenerationEngine:
    """Schedules and runs generation steps on one model, from its own thread (or ``step()`` by hand in tests)."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, options: GenerateOptions, *, context_length: int,
                 metrics: GenerationMetrics, logger: Logger, start: bool = True,
                 board: CoreBoard | None = None) -> None:
        """Allocate the KV cache from ``options.kv_cache_bytes``; start the step thread unless ``start`` is False.

        ``context_length``: most tokens of one sequence, prompt included (capped to what the pool holds).
        ``board``: the server's core board, marked around each forward pass so that the server's
        other models keep to their own share of the cores while this one generates.
        """
        self.model = model
        self.board = board
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = metrics
        self.logger = logger
        block = options.kv_block_tokens
        per_token = KVCache.bytes_per_token(model.shapes, model.dtype)
        num_blocks = options.kv_cache_bytes // (per_token * block)
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_bytes {options.kv_cache_bytes} holds no block of {block} tokens "
                              f"({per_token * block} bytes each for this model)")
        self.pool = BlockPool(num_blocks, block, prefix_cache=options.prefix_cache)
        self.cache = KVCache(model.shapes, num_blocks * block, dtype=model.dtype, device=model.device)
        self.context_length = min(context_length, num_blocks * block)
        self.bytes_per_token = per_token
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[_Sequence] = []
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._closed = False
        self._abandoned = False
        self.steps = 0
        self._thread: threading.Thread | None = None
        self._checker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="coalesce-cancel")
        metrics.kv_blocks_total.set(num_blocks)
        self._report_pool()
        if start:
            self._thread = threading.Thread(target=self._run, name="coalesce-generate", daemon=True)
            self._thread.start()

    # -- requests ------------------------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens, checked against the context.

        Raises:
            InvalidInputError: If the prompt leaves no room in the context for one new token.
        """
        ids = list(self.tokenizer.encode(request.prompt).ids)
        if not ids:
            raise InvalidInputError("input 'text_input' holds no tokens")
        if len(ids) >= self.context_length:
            raise InvalidInputError(f"input 'text_input' is {len(ids)} tokens; the context holds "
                                    f"{self.context_length} (prompt and generated tokens together; parameter "
                                    "max_sequence_length, the model's own limit and kv_cache_bytes cap it)")
        return ids

    def submit(self, request: GenerationRequest, sink: Sink, *, is_cancelled: Callable[[], bool] | None = None,
               prompt: list[int] | None = None) -> None:
        """Queue a request; ``sink`` gets its responses, from the step thread (errors included, always a final one).

        Refused at once (``UNAVAILABLE`` through ``sink``) when ``max_waiting_sequences`` wait already.
        """
        now = time.perf_counter()
        try:
            ids = prompt if prompt is not None else self.prompt_tokens(request)
        except CoalesceError as exc:
            sink(GenerationEvent(final=True, error=exc))
            return
        sampling = request.sampling
        generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            generator = torch.Generator().manual_seed(seed)
        digests = prefix_digests(ids, self.pool.block_tokens) if self.pool.prefix_cache else []
        sequence = _Sequence(
            id=next(self._ids), request=request, prompt=ids, sink=sink, is_cancelled=is_cancelled, arrived_s=now,
            text=IncrementalText(self.tokenizer, sampling.stop), generator=generator,
            total_tokens=min(len(ids) + sampling.max_tokens, self.context_length), digests=digests)
        with self._lock:
            if self._closed:
                refusal: CoalesceError | None = UnavailableError("the model is being unloaded")
            elif len(self._waiting) + len(self._inbox) >= self.options.max_waiting_sequences:
                refusal = UnavailableError(f"{len(self._waiting) + len(self._inbox)} requests already wait to join "
                                           f"(parameter max_waiting_sequences); retry later")
                self.metrics.refusals["queue_full"].increment(1)
            else:
                refusal = None
                self._inbox.append(sequence)
                self._lock.notify()
        if refusal is not None:
            sink(GenerationEvent(final=True, error=refusal))

    def close(self, *, drain_s: float = 30.0) -> None:
        """Refuse new requests, let queued and running ones finish for up to ``drain_s``, then end the rest."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=drain_s)
            self._abandoned = True  # past the drain: the thread stops after the step it is in
            self._thread.join(timeout=10)
        with self._lock:
            left = self._inbox + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
        for sequence in left:
            self._fail(sequence, UnavailableError("the model was unloaded before the request joined"), running=False)
        for sequence in list(self._running):
            self._fail(sequence, UnavailableError("the model was unloaded before the request finished"))
        self._checker.shutdown(wait=False)

    @property
    def prefilling(self) -> int:
        """Requests whose prompt is not all computed yet: queued, waiting, or joined and prefilling."""
        return (len(self._inbox) + len(self._waiting)
                + sum(1 for s in self._running if s.computed < len(s.prompt)))

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._inbox or self._waiting or self._running)

    # -- the step loop ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._abandoned:
            with self._lock:
                while not self._closed and not (self._inbox or self._waiting or self._running):
                    self._lock.wait()
                if self._closed and not (self._inbox or self._waiting or self._running):
                    return
            try:
                self.step()
            except Exception as exc:
                self.logger.error(f"generation step failed: {exc!r}; failing its {len(self._running)} sequences")
                self.metrics.step_failures.increment(1)
                for sequence in list(self._running):
                    self._fail(sequence, RuntimeFailure(f"generation step failed: {exc}"))
            if self._waiting and not self._running:
                time.sleep(0.001)  # waiting for the KV cache with nothing running: only expiry can change it

    def step(self) -> bool:
        """Admit, run one forward pass, sample and answer; False if there was nothing to run.

        Whether each request was cancelled is asked while the forward pass runs (in
        Triton each ask is a round trip to the server), and cancelled ones leave at the
        end of the step.
        """
        now = time.perf_counter()
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        watched = [s for s in (*self._running, *self._waiting) if s.is_cancelled is not None]
        check = self._checker.submit(_cancelled, watched) if watched else None
        self._admit(now)
        ran = bool(self._running)
        if ran:
            step, members = self._plan()
            with marked(self.board):
                logits = self.model.forward(step, self.cache)
            self.steps += 1
            self._advance(members, logits)
        if check is not None:
            self._drop(check.result())
        self.metrics.waiting_sequences.set(len(self._waiting))
        self.metrics.active_sequences.set(len(self._running))
        self._report_pool()
        return ran

    def _drop(self, cancelled: list[_Sequence]) -> None:
        for sequence in cancelled:
            running = sequence in self._running
            if not running and sequence not in self._waiting:
                continue  # it ended this step
            if not running:
                self._waiting.remove(sequence)
            self.metrics.cancelled.increment(1)
            self._fail(sequence, CancelledError("the request was cancelled"), running=running)

    def _admit(self, now: float) -> None:
        options = self.options
        if options.generation_batching == "request" and self._running:
            return  # static batching: the batch runs until its last sequence ends
        while self._waiting and len(self._running) < options.max_active_sequences:
            sequence = self._waiting[0]
            reusable = sequence.digests[:(len(sequence.prompt) - 1) // self.pool.block_tokens]
            allocation = self.pool.allocate(sequence.total_tokens, reusable)
            if allocation is None:
                break
            self._waiting.popleft()
            sequence.blocks = allocation.blocks
            block = self.pool.block_tokens
            sequence.slots = (np.asarray(allocation.blocks, dtype=np.int64)[:, None] * block
                              + np.arange(block, dtype=np.int64)).reshape(-1)
            sequence.computed = allocation.cached_tokens
            sequence.registered = allocation.cached_tokens // self.pool.block_tokens
            self.metrics.prompt_tokens.increment(len(sequence.prompt))
            self.metrics.prefix_hit_tokens.increment(allocation.cached_tokens)
            self.metrics.queue_seconds.observe(now - sequence.arrived_s)
            self._running.append(sequence)
        limit_s = options.max_queue_wait_ms / 1000
        while self._waiting and now - self._waiting[0].arrived_s > limit_s:
            sequence = self._waiting.popleft()
            usage = self.pool.usage()
            self.metrics.refusals["kv_full"].increment(1)
            self._fail(sequence, UnavailableError(
                f"waited {(now - sequence.arrived_s) * 1000:.0f} ms for room in the KV cache (parameter "
                f"max_queue_wait_ms): {usage.used} of {self.pool.num_blocks} blocks held by {len(self._running)} "
                f"sequences, this one needs {self.pool.blocks_for(sequence.total_tokens)}; retry later"),
                running=False)

    def _plan(self) -> tuple[StepInput, list[tuple[_Sequence, int, bool]]]:
        """Pack the step: decoding sequences first (one token each), then prompt chunks within the prefill budget."""
        step = StepInput(ids=[], positions=[], slots=[], decode_slots=[], prefills=[], logits_rows=[])
        members: list[tuple[_Sequence, int, bool]] = []  # (sequence, tokens computed this step, wants logits)
        prefilling = []
        for sequence in self._running:
            if sequence.computed < len(sequence.prompt):
                prefilling.append(sequence)
                continue
            position = sequence.computed
            step.logits_rows.append(len(step.ids))
            step.ids.append(sequence.token(position))
            step.positions.append(position)
            step.slots.append(int(sequence.slots[position]))
            step.decode_slots.append(sequence.slots[:position + 1])
            members.append((sequence, 1, True))
        budget = self.options.max_prefill_tokens
        for sequence in prefilling:
            if budget <= 0:
                break
            start = sequence.computed
            count = min(len(sequence.prompt) - start, budget)
            budget -= count
            packed = len(step.ids)
            step.ids.extend(sequence.prompt[start:start + count])
            step.positions.extend(range(start, start + count))
            step.slots.extend(sequence.slots[start:start + count].tolist())
            step.prefills.append((packed, packed + count, sequence.slots[:start + count], start))
            done = start + count == len(sequence.prompt)
            if done:
                step.logits_rows.append(packed + count - 1)
            members.append((sequence, count, done))
        return step, members

    def _advance(self, members: list[tuple[_Sequence, int, bool]], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        wanting = [sequence for sequence, _, wants in members if wants]
        tokens = sample(logits, [s.request.sampling for s in wanting], [s.generator for s in wanting])
        chosen = dict(zip((id(s) for s in wanting), tokens, strict=True))
        for sequence, count, wants in members:
            sequence.computed += count
            self._register_prefix(sequence)
            if not wants:
                continue
            token = chosen[id(sequence)]
            sequence.generated.append(token)
            self.metrics.generated_tokens.increment(1)
            if len(sequence.generated) == 1:
                sequence.first_token_s = now
                self.metrics.time_to_first_token_seconds.observe(now - sequence.arrived_s)
            else:
                self.metrics.inter_token_seconds.observe(now - sequence.last_token_s)
            sequence.last_token_s = now
            if token not in self.model.eos_token_ids:
                sequence.text.add(token)
            finish = self._finish_reason(sequence, token)
            if finish is not None:
                sequence.text.finish()
            self._answer(sequence, finish)
            if finish is not None:
                self._release(sequence)
                self.metrics.finished[finish].increment(1)

    def _finish_reason(self, sequence: _Sequence, token: int) -> str | None:
        sampling = sequence.request.sampling
        if token in self.model.eos_token_ids and not sampling.ignore_eos:
            return FINISH_STOP
        if sequence.text.stopped:
            return FINISH_STOP
        if len(sequence.generated) >= sampling.max_tokens or sequence.length >= sequence.total_tokens:
            return FINISH_LENGTH
        return None

    def _answer(self, sequence: _Sequence, finish: str | None) -> None:
        request = sequence.request
        final = finish is not None
        if not request.stream and not final:
            return
        text = sequence.text.take(final=final)
        if not text and not final:
            return
        if request.prepend_prompt:
            text = request.prompt + text
        self._send(sequence, GenerationEvent(text=text, final=final, finish_reason=finish,
                                             prompt_tokens=len(sequence.prompt),
                                             generated_tokens=len(sequence.generated)))

    def _register_prefix(self, sequence: _Sequence) -> None:
        full = min(sequence.computed, len(sequence.prompt)) // self.pool.block_tokens
        for index in range(sequence.registered, min(full, len(sequence.digests))):
            self.pool.register(sequence.blocks[index], sequence.digests[index])
        sequence.registered = max(sequence.registered, full)

    def _release(self, sequence: _Sequence) -> None:
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence.blocks:
            self.pool.release(sequence.blocks)
            sequence.blocks = []

    def _fail(self, sequence: _Sequence, error: CoalesceError, *, running: bool = True) -> None:
        if running:
            self._release(sequence)
        self.metrics.failures.increment(1)
        self._send(sequence, GenerationEvent(final=True, error=error, prompt_tokens=len(sequence.prompt),
                                             generated_tokens=len(sequence.generated)))

    def _send(self, sequence: _Sequence, event: GenerationEvent) -> None:
        try:
            sequence.sink(event)
        except Exception as exc:
            self.logger.warning(f"sending a response of request {sequence.id} failed: {exc!r}; dropping it")
            if not event.final:
                self._release(sequence)

    def _report_pool(self) -> None:
        usage = self.pool.usage()
        self.metrics.kv_blocks["used"].set(usage.used)
        self.metrics.kv_blocks["cached"].set(usage.cached)
        self.metrics.kv_blocks["free"].set(usage.free)
