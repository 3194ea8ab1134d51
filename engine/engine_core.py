"""The engine loop: validate and add requests, then step (schedule -> run -> sample -> update).

No I/O here: events are drained from the KV manager after every step and handed to an
``EventSink``; the offload connector is reached only through its protocol.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.digest_memo import DigestMemo
from engine.errors import InvalidRequest
from engine.event_sink import EventSink, NullEventSink
from engine.kv_cache import KVCacheGroup, allocate_kv_cache, kv_group_specs, layer_slots
from engine.kv_connector import NullConnector, OffloadConnector
from engine.kv_manager import KVCacheManager
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer, load_tokenizer
from engine.output_text import next_output
from engine.request import PreparedPrompt, Request, StepOutput
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample_token
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.step_chain import Launched, StepChain
from engine.step_graphs import StepGraphs
from events.hashing import BlockHasher

_SEED_BATCH = 64
"""Request seeds drawn per ``torch.randint`` call."""


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        event_sink: EventSink | None = None,
        connector: OffloadConnector | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(config.model_dir, self.device, config.torch_dtype)
        self.model_config: ModelConfig = self.model.config
        self.tokenizer: Tokenizer = load_tokenizer(config.model_dir)
        mcfg = self.model_config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{mcfg.max_position_embeddings}"
            )
        self.hasher = BlockHasher(config.hash_seed, config.block_size, config.hash_algo)
        specs = kv_group_specs(mcfg)
        self.kv_groups: list[KVCacheGroup] = allocate_kv_cache(
            specs, mcfg, config.num_gpu_blocks, config.block_size, config.torch_dtype, self.device
        )
        # Digests remembered across requests (engine.digest_memo): a prefix hit hashes nothing
        # it has seen; twice the pool covers every block a hit can match.
        memo = DigestMemo(self.hasher, min(max(4096, 2 * config.num_gpu_blocks), 1 << 17))
        self.kv = KVCacheManager(specs, config.num_gpu_blocks, config.block_size, memo, config.enable_prefix_caching)
        self.connector: OffloadConnector = connector or NullConnector()
        self.connector.register_kv_caches(self.kv_groups)
        self.scheduler = Scheduler(self.kv, self.connector, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.hold_prefix_on_arrival)
        slots = layer_slots(specs)
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            graphs = StepGraphs(self.model, self.kv_groups, slots, self.device, max_tokens=config.cuda_graph_max_tokens)
        self.runner = ModelRunner(self.model, self.kv_groups, slots, self.kv, self.device, graphs)
        # Async scheduling needs the grid steps (their token ids can come from the device) and
        # no offload connector (whose per-step protocol runs one step at a time).
        self.chain = StepChain(self.device, graphs is not None and type(self.connector) is NullConnector,
                               config.async_scheduling)
        self.event_sink: EventSink = event_sink or NullEventSink()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._settled = True
        """Every step launched so far has completed (its results were read): the next step's
        inputs need not wait for an earlier step to have read them (``StepGraphs.run``)."""
        self._seeds: list[int] = []
        """Seeds drawn ahead, the next one last (``_next_seed``)."""

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequest with a clear message."""
        params.validate()
        return self.add_prepared(self.prepare_prompt(prompt), params, request_id)

    def prepare_prompt(self, prompt: str | Sequence[int], *, plain_ints: bool = False) -> PreparedPrompt:
        """The prompt checked, for ``add_prepared``.

        ``plain_ints``: the caller already made ``prompt`` a list of plain ints (it is used
        as is, not copied)."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif plain_ints:
            assert isinstance(prompt, list)
            token_ids = prompt
        else:
            token_ids = list(prompt)
            # Type check in C (4,096 ids: ~30 us; a Python int() pass ~200 us).
            if list(map(type, token_ids)).count(int) != len(token_ids):
                token_ids = [int(t) for t in token_ids]
        ids = self._check_prompt(token_ids)
        return PreparedPrompt(prompt if isinstance(prompt, str) else None, token_ids, ids)

    def add_prepared(
        self, prepared: PreparedPrompt, params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Queue a request whose prompt came from ``prepare_prompt`` and whose params are valid
        (the request takes ``prepared.token_ids`` as its own list)."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequest(f"request_id {rid!r} is already in use")
        token_ids = prepared.token_ids
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.default_max_tokens
        longest = min(len(token_ids) + max_tokens, self.max_model_len)
        need = -(-longest // self.config.block_size)
        if need > self.config.num_gpu_blocks:
            raise InvalidRequest(
                f"request needs up to {need} KV blocks ({longest} tokens) but the pool has "
                f"{self.config.num_gpu_blocks}; lower max_tokens or shorten the prompt"
            )
        # Drawn for every request, greedy ones too, as before (later requests keep their seeds);
        # the generator is made only when the request samples.
        seed = params.seed if params.seed is not None else self._next_seed()
        req = Request(
            request_id=rid, prompt_token_ids=token_ids, params=params, max_tokens=max_tokens,
            eos_token_ids=() if params.ignore_eos else self.model_config.eos_token_ids,
            generator=None, prompt=prepared.text, prompt_array=prepared.ids, seed=seed,
        )
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _next_seed(self) -> int:
        """The next seed of the engine's stream: drawn 64 at a time (the same values, in the same
        order, as one ``torch.randint`` a request; a torch call each was host work on the hit's path)."""
        if not self._seeds:
            self._seeds = torch.randint(0, 2**62, (_SEED_BATCH,), generator=self._seed_gen).tolist()[::-1]
        return self._seeds.pop()

    def _check_prompt(self, token_ids: list[int]) -> np.ndarray | None:
        """Raises InvalidRequest for a bad prompt of plain ints; returns it as a read-only int64
        array (None when some id does not fit one: such an id is out of range anyway). The
        array costs less than the two Python passes of min() and max() it replaces, and the
        block hasher takes it as is."""
        if not token_ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt is too long: {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt + at least one new token must fit)"
            )
        vocab = self.model_config.vocab_size
        try:
            # struct packs a list of ints in C at ~2.5x the speed of np.fromiter (4,096 ids:
            # ~30 us); the array over its bytes is read-only.
            ids: np.ndarray | None = np.frombuffer(struct.pack(f"{len(token_ids)}q", *token_ids), dtype=np.int64)
        except struct.error:  # an id outside int64
            ids = None
        # One pass: a negative id is above every vocabulary as an unsigned number.
        if ids is not None and int(ids.view(np.uint64).max()) < vocab:
            return ids
        bad = [t for t in token_ids if not 0 <= t < vocab]
        raise InvalidRequest(f"token ids out of range [0, {vocab}): {bad[:5]}")

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")
            self._flush_events()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run a step and return the tokens it made. With async scheduling (engine.step_chain)
        the next decode is launched before these tokens are read, and the step after that is
        already on the GPU when this returns."""
        launched = self.chain.take()
        try:
            if launched is None:
                out = self.scheduler.schedule()
                if not out.scheduled:
                    self._flush_events()
                    return []
                launched = self._launch(out)
            try:
                ahead = self.chain.launch_ahead(launched, self.scheduler, self.kv, self.runner, self.max_model_len)
                if ahead is None:
                    self._free_ending(launched)
                outputs = self._outputs(launched)
                if ahead is not None:
                    self._settle(ahead.scheduled)
                    self.chain.pending = ahead
                else:  # this step's results are read and none was launched after it
                    self._settled = True
                self._flush_events()
                return outputs
            finally:
                # The connector's background work starts only now: its worker thread never holds
                # the GIL while this thread waits for the tokens or makes the outputs.
                self.connector.step_done()
        except BaseException:
            self.chain.pending = None
            raise

    def _launch(self, out: SchedulerOutput) -> Launched:
        scheduled = out.scheduled
        sample_rows = [
            i for i, s in enumerate(scheduled)
            if s.start + s.num_new_tokens == s.request.num_tokens
        ]
        reqs = [scheduled[i].request for i in sample_rows]
        # Greedy only: pick on the device and move token ids, not [rows, vocab] logits. The pick
        # and its copy to the host are queued right behind the step, before the bookkeeping
        # below: the tokens are on the host when the step ends, not a kernel and a copy later.
        greedy = all(r.params.is_greedy and not r.params.return_logits for r in reqs)
        try:
            settled, self._settled = self._settled, False
            logits = self.runner.execute(out, sample_rows, self.connector.take_layer_waits(), settled=settled)
            launched = Launched(scheduled, reqs, None if greedy else logits)
            if greedy:
                self.chain.pick(launched, logits)
            redo = self._settle(scheduled)
            if redo:
                # Wrong KV was loaded: nothing of it may stay cached, nor anything that shares it.
                logits, sample_rows = self._drop(scheduled, redo, logits, sample_rows)
                launched = Launched(scheduled, [scheduled[i].request for i in sample_rows], None if greedy else logits)
                if greedy:
                    self.chain.pick(launched, logits)
        except BaseException:
            # The failed step's loads are completed and checked all the same, so that their
            # pins are released and the stores held for them settled (nothing is redone).
            self.connector.finish_loads()
            self.connector.check_loads()
            self.connector.step_done()
            raise
        return launched

    def _settle(self, scheduled: list[ScheduledRequest]) -> set[str]:
        """A step's bookkeeping once its input tokens are all on the host: progress, newly full
        blocks hashed and handed to the connector. Returns the requests whose loads were wrong."""
        new_blocks = []
        for s in scheduled:
            if s.request.is_finished:  # stopped on the token that fed a step launched ahead
                continue
            s.request.num_computed_tokens = s.start + s.num_new_tokens
            new_blocks.extend(self.kv.register_full_blocks(s.request))
        # The connector's steps, in order (engine.kv_connector). Before any request finishes,
        # so the blocks are still the request's own; the copies a store needs are enqueued
        # behind the step and the step's loads, before the tokens are read. All of this runs
        # while the GPU works and before the loads that started from the engine's view of
        # the host tier are checked (the check waits for their copies to complete).
        self.connector.finish_loads()
        self.connector.store(new_blocks)
        redo = self.connector.check_loads()
        if redo:
            redo = self.kv.forget_blocks(new_blocks, redo, [s.request for s in scheduled])
        return redo

    def _free_ending(self, launched: Launched) -> None:
        """Release the blocks of the requests that this step's token ends by length, whatever the
        token is, while the GPU still computes it (a 4,096-token prompt's 256 blocks took ~70 us
        on an H200 host once the token was in). Nothing allocates blocks before the token is
        read (no step was launched ahead); the request finishes as before when its token comes.
        Only a leading run of such requests: one before them may still end on its token (EOS, a
        stop) and must free first, as it did, so that the LRU order and later events stay the same."""
        for r in launched.requests:
            if r.is_finished:
                continue
            if not r.next_token_ends_by_length(self.max_model_len):
                return
            self.kv.free(r)

    def _outputs(self, launched: Launched) -> list[StepOutput]:
        """Read the step's tokens (sample them from its logits) and append them; a request that
        finished meanwhile (aborted, or stopped on the token that fed this step) is skipped."""
        if launched.logits is None:
            tokens = self.chain.tokens(launched)
            return [self._append_token(r, None, t) for r, t in zip(launched.requests, tokens, strict=True)
                    if not r.is_finished]
        logits_cpu = launched.logits.cpu()
        return [self._append_token(r, logits_cpu[row]) for row, r in enumerate(launched.requests)]

    def _drop(
        self, scheduled: list[ScheduledRequest], redo: set[str], logits: torch.Tensor, sample_rows: list[int],
    ) -> tuple[torch.Tensor, list[int]]:
        """Take the requests in ``redo`` out of this step (the KV loaded for them was wrong):
        they go back to the waiting queue and their rows out of the logits; returns the logits
        and sample rows of the requests left."""
        before = list(scheduled)
        keep = [j for j, i in enumerate(sample_rows) if before[i].request.request_id not in redo]
        for s in before:
            if s.request.request_id in redo:
                scheduled.remove(s)
                self.scheduler.readmit(s.request)
        position = {id(s): n for n, s in enumerate(scheduled)}
        return logits[keep], [position[id(before[sample_rows[j]])] for j in keep]

    def _append_token(self, req: Request, logits: torch.Tensor | None, token: int | None = None) -> StepOutput:
        if token is None:
            assert logits is not None
            token = sample_token(logits, req.params, None if req.params.is_greedy else req.sampler())
        if req.params.return_logits and logits is not None:
            req.logits.append(logits.clone())
        out = next_output(req, token, self.tokenizer, self.max_model_len)
        if out.finish_reason is not None:
            self.scheduler.finish(req, out.finish_reason)
            self.requests.pop(req.request_id, None)
        return out

    def _flush_events(self) -> None:
        events = self.kv.take_events()
        if events:
            self.event_sink.publish(events)
        if self.event_sink.take_resync():
            # The transport lost events and started a new incarnation (the daemon clears our
            # GPU tier on it): announce everything still cached, as of this step boundary.
            snapshot = self.kv.snapshot_events()
            if snapshot:
                self.event_sink.publish(snapshot)

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset_prefix_cache()
        self._flush_events()
        return ok
