"""One rank's engine: scheduler + KV + model + sampler. Every rank runs `step(commands)` with the
same commands; rank 0 (the driver, see llm.py) is the only one that talks to the user.

A step reads top to bottom: apply the commands -> plan (scheduler) -> launch the plan on the
device (a decode graph's replay for decode-only steps, a prefill graph's for steps with prompt
chunks, eager when no bucket holds the step: decode rows through the decode kernels, prefill
chunks through the prefill kernels, one forward) -> read back the previous step's tokens
(overlap) or this one's -> retire finished requests.

A failure while launching a step stays with its requests (one rank): the KV it queued is
rolled back, the prefill chunks of the step end with finish reason "error" and the decode rows
are retried alone; a failing decode-only step fails its rows. Two failing steps in a row, a
failure while reading back, or any failure with several ranks (whose collectives cannot be
resynchronised) end the engine: it says why once (`EngineDeadError`) and refuses further work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from helix.attention.backend import get_backend
from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.errors import EngineDeadError
from helix.graphs import BucketLadder, GraphPool, token_buckets
from helix.kv.context_parallel import own_counts, pass_kv_cheaper, plan_pass_kv
from helix.kv.host_cache import HostCache
from helix.kv.manager import KVManager, upload
from helix.kv.ownership import KVSharding
from helix.layers.attention_gqa import kv_head_range
from helix.layers.hopb import micro_batches
from helix.loader import build_and_load
from helix.parallel.comm import Comm
from helix.runtime import faults, penalties
from helix.runtime.decode_graphs import DecodeGraphs
from helix.runtime.grammar import Grammars, Matcher, allowed, bitmask
from helix.runtime.logprobs import TokenLogprob, from_host, score_prompts
from helix.kv.quant import to_cache
from helix.runtime.memory import plan_kv_pool
from helix.runtime.speculative import Drafter
from helix.runtime.prefill_graphs import DEFAULT_MAX_TOKENS, LOCAL, PASS_KV, PrefillGraphs
from helix.tracing import nvtx_range
from helix.triton_util import MIN_COUNTERS, arrival_counters
from helix.runtime.request import Request
from helix.runtime.sampler import Sampler
from helix.runtime.sampling import SamplingParams, row_params
from helix.runtime.scheduler import Scheduler, StepPlan


@dataclass
class _Launched:
    """A step queued on the device whose tokens are not read back yet."""
    batch: list[Request]          # its sampled rows, in order (row i = sampler token i)
    host: torch.Tensor            # host buffer the tokens are copied into
    event: torch.cuda.Event | None  # recorded after that copy (None: already done)
    num_tokens: int               # tokens fed to the model
    logprobs: tuple | None = None   # host (lp, top_lp, top_ids) of its rows, when one asked
    prompt_logprobs: list | None = None   # (request, host (lp, top_lp, top_ids)) of prompt
                                          # rows scored, when one asked
    verify: dict | None = None    # request id -> (its first row, its guesses): the rows of a
                                  # chunk of guesses (speculative decoding)


@dataclass
class StepOutput:
    tokens: dict[int, int]        # request id -> token generated this step (the first one)
    finished: dict[int, str]      # request id -> finish reason, for requests that ended
    num_tokens: int               # tokens fed to the model this step
    seconds: float                # wall time of the step on this rank
    errors: dict[int, str] | None = None   # request id -> message, for requests that failed
    logprobs: dict[int, TokenLogprob] | None = None   # request id -> its token's, for requests
                                                      # that asked (SamplingParams.logprobs)
    prompt_logprobs: dict[int, list[TokenLogprob]] | None = None   # request id -> its prompt
                                     # positions scored this step, in order (prompt_logprobs)
    cached: dict[int, int] | None = None   # request id -> prompt positions its admission this
                                           # step found in the prefix cache (first admissions)
    more: dict[int, list[int]] | None = None   # request id -> tokens after `tokens`' one, when
                                           # a step verified guesses (speculative decoding)
    more_logprobs: dict[int, list[TokenLogprob]] | None = None   # ... their log-probabilities


class Engine:
    def __init__(self, model_ref: str, cfg: ModelConfig, ckpt: str | None, layout: Layout,
                 runtime: RuntimeConfig, comm: Comm, device: torch.device, ranks_here: int = 1):
        self.cfg, self.layout, self.runtime, self.comm = cfg, layout, runtime, comm
        self.device = device
        self.max_context = runtime.resolved_max_context(cfg)
        dtype = runtime.torch_dtype
        self.model = build_and_load(model_ref, comm, dtype, device, self.max_context,
                                    runtime.seed, cfg=cfg, ckpt=ckpt,
                                    quantization=runtime.quantization)
        self.pool = plan_kv_pool(self.model, cfg, layout, runtime, device, ranks_here,
                                 agree=lambda n: min(comm.gather_object(n)))
        num_pages = self.num_pages = self.pool.num_pages
        self.caches = [[torch.zeros(s, dtype=runtime.torch_kv_dtype, device=device) for s in shapes]
                       for shapes in self.model.kv_cache_shapes(num_pages, runtime.page_size)]
        mesh = comm.mesh
        self.sharding = KVSharding(layout.kvp, layout.kv_interleave, runtime.page_size)
        self.kv = KVManager(num_pages, runtime.page_size, mesh.kvp_rank, layout.kvp,
                            layout.kv_interleave)
        slots = HostCache.slots_for(runtime.host_cache_gb, self.sharding.block_pages,
                                    self.pool.page_bytes)
        self.host_cache = HostCache(self.caches, slots, self.sharding.block_pages) if slots \
            else None
        self.scheduler = Scheduler(num_pages, self.sharding, runtime.max_batch,
                                   runtime.resolved_max_prefill_tokens,
                                   runtime.resolved_idle_prefill_tokens,
                                   prefix_caching=runtime.prefix_caching, host_slots=slots,
                                   policy=runtime.scheduling,
                                   drafter=Drafter(runtime.speculative_tokens,
                                                   runtime.speculative_ngram)
                                   if runtime.speculative_tokens else None)
        self.backend = get_backend(runtime.resolved_backend, runtime.device)
        self.backend.prepare(device, cfg.is_mla)
        self.seeds: dict[int, int] = {}       # request id -> sampling seed
        self.vocab_rows: dict[int, tuple] = {}   # request id -> its prompt mask and logit
                                                 # bias over the vocabulary (penalties.py)
        self.grammars = Grammars(model_ref, cfg.vocab_size)
        self.matchers: dict[int, Matcher] = {}   # request id -> its place in its grammar
        self.kv_tokens_released = 0
        ladder = (BucketLadder(buckets=runtime.graph_buckets) if runtime.graph_buckets
                  else BucketLadder(max_size=runtime.max_batch))
        rows = max(runtime.step_tokens, ladder.max)
        self.sampler = Sampler(rows, device)
        self.overlap = runtime.resolved_overlap
        self.inflight: _Launched | None = None
        self.last_logits: torch.Tensor | None = None
        self.dead: str | None = None
        self.last_graphed = False             # whether the last step replayed a graph
        self.steps = 0                        # steps launched (fault injection counts them)
        self.wait_seconds = 0.0               # host time spent waiting for the device's tokens
        self.prefill_tokens = 0               # prompt tokens this rank projected
        self.spec_drafted = self.spec_accepted = 0   # guesses verified, and kept (speculative)
        attn = self.model.model.layers[0].self_attn
        self._exchange_rows = attn.exchange_rows()
        self._layer_page_bytes = self.pool.page_bytes // cfg.num_layers
        self._failed_last = False
        self.graphs = self.prefill_graphs = None
        geometry = dict(kvp_rank=mesh.kvp_rank, kvp=layout.kvp,
                        interleave=layout.kv_interleave, page_size=runtime.page_size)
        pool = GraphPool()                    # one pool: prefill graphs (largest) first
        if device.type == "cuda" and (runtime.resolved_prefill_graphs or runtime.cuda_graphs):
            # the one-launch kernels' arrival counters exist before any capture: a segment's
            # first counted launch may come under capture (a prefill bucket's warm-up can take
            # another MLA form than its capture)
            arrival_counters(device, MIN_COUNTERS)
        if runtime.resolved_prefill_graphs:
            step = runtime.max_batch + runtime.resolved_max_prefill_tokens
            buckets = runtime.prefill_graph_buckets or token_buckets(min(step,
                                                                         DEFAULT_MAX_TOKENS))
            self.prefill_graphs = PrefillGraphs(
                self.model, self.caches, self.backend, self.sampler, geometry,
                BucketLadder(buckets=[b for b in buckets if b <= step] or [step]), step,
                self._prefill_modes(), runtime.graph_breaks, device,
                enabled=not runtime.graph_eager, pool=pool)
            self.prefill_graphs.capture()
        if runtime.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.caches, self.backend, self.sampler,
                                       geometry, ladder, runtime.graph_breaks,
                                       self.sharding.max_pages(self.max_context), device,
                                       enabled=not runtime.graph_eager,
                                       micro_batches=self._micro_batches, pool=pool)
            self.graphs.capture()

    def _micro_batches(self, rows: int) -> int:
        return micro_batches(self.runtime.hopb, rows, self.layout.kvp)

    def _prefill_modes(self) -> tuple[str, ...]:
        """The ways a step's chunks may attend (see _pass_kv): the prefill graphs to capture."""
        if self.layout.kvp == 1 or self.runtime.prefill_cp == "pass-q":
            return (LOCAL,)
        return (PASS_KV,) if self.runtime.prefill_cp == "pass-kv" else (LOCAL, PASS_KV)

    # -- commands (identical on every rank) --------------------------------------------------
    def apply(self, commands: list[tuple]) -> None:
        for cmd in commands:
            if cmd[0] == "add":
                _, req_id, prompt, params, max_len, prefix = cmd
                req = Request(req_id, list(prompt), params, max_len, prefix)
                self.seeds[req_id] = (params.seed if params.seed is not None
                                      else self.runtime.seed * 1000003 + req_id)
                if params.grammar is not None:
                    self.matchers[req_id] = self.grammars.matcher(
                        params.grammar, self.runtime.speculative_tokens)
                self.scheduler.add(req)
            elif cmd[0] == "abort":
                self.scheduler.abort(cmd[1])
            elif cmd[0] == "grammar":           # compile it in the background (before its
                self.grammars.prepare(cmd[1])   # request's "add", a step or more later)
            elif cmd[0] == "reset_cache":       # idle cached blocks evicted
                self.scheduler.reset_cache()
            elif cmd[0] == "kv":                # the prompt's KV of the request just added
                _, req_id, kv = cmd
                req = next(r for r in self.scheduler.waiting if r.id == req_id)
                req.attach_kv(kv, min(kv.length, len(req.prompt) - 1))

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids))

    @torch.inference_mode()
    def step(self, commands: list[tuple]) -> StepOutput:
        """Queue this step on the device, then read back the tokens of the step before it
        (overlap) or of this one (no overlap). With overlap the host prepares step N + 1 while
        the device runs step N: a request's token is reported one call later, and a request
        that stops on a sampled stop id runs one extra (discarded) row. While a request with a
        grammar runs, every step is read back at once (its next mask needs its token)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        t0 = time.perf_counter()
        self.apply(commands)
        tokens, logprobs, prompt_logprobs, more, more_lps = {}, {}, {}, {}, {}
        if self.inflight is not None and self.matchers:   # constrained rows need their last
            self._resolve_inflight(tokens, logprobs, prompt_logprobs, more,   # token on host
                                   more_lps)
        retired = self._retire()                      # aborted (or just ended) before running
        plan = self.scheduler.schedule()
        self.kv.apply_ops(self.scheduler.take_kv_ops(), self.host_cache)   # the preempted freed
        for c in plan.prefill:
            if c.req.imported_kv is not None:         # admitted with KV from a prefill server
                self._write_imported(c.req, c.start)
        launched = self._launch_confined(plan) if plan else None
        if self.inflight is not None:
            self._resolve_inflight(tokens, logprobs, prompt_logprobs, more, more_lps)
        self.inflight = launched
        if launched is not None and (not self.overlap or self.matchers):
            self._resolve_inflight(tokens, logprobs, prompt_logprobs, more, more_lps)
        retired += self._retire()
        finished = {r.id: r.finish_reason for r in retired}
        errors = {r.id: r.error for r in retired if r.finish_reason == "error"}
        cached = {c.req.id: c.req.cached for c in plan.prefill
                  if c.req.cached and c.start == c.req.cached and not c.req.preemptions
                  and not c.draft}
        return StepOutput(tokens, finished, launched.num_tokens if launched else 0,
                          time.perf_counter() - t0, errors or None, logprobs or None,
                          prompt_logprobs or None, cached or None, more or None,
                          more_lps or None)

    # -- launching ----------------------------------------------------------------------------
    def _launch_confined(self, plan: StepPlan) -> _Launched | None:
        """_launch, with a failure confined to the requests it belongs to (see module doc)."""
        try:
            launched = self._launch(plan)
            self._failed_last = False
            return launched
        except Exception as e:
            if self.layout.world_size > 1:
                raise self._die(f"a step failed on rank {self.comm.mesh.rank}: "
                                f"{type(e).__name__}: {e}") from e
            if self._failed_last:
                raise self._die(f"two steps in a row failed, the last with "
                                f"{type(e).__name__}: {e}") from None
            self._failed_last = True
            self._undo(plan)
            message = f"{type(e).__name__}: {e}"
            guesses = [c for c in plan.prefill if c.draft]       # decode-like: retried too
            prompts = [c for c in plan.prefill if not c.draft]
            suspects = [c.req for c in prompts] or plan.decode + [c.req for c in guesses]
            for r in suspects:
                r.finish_reason, r.error = "error", message
            if not (prompts and (plan.decode or guesses)):
                return None
            return self._launch_confined(StepPlan(decode=plan.decode, prefill=guesses))

    def _undo(self, plan: StepPlan) -> None:
        """A step that failed while being queued: its KV growth rolled back on this rank (the
        scheduler's page count stays: failed requests release theirs when they retire, decode
        rows retried need theirs)."""
        for r in plan.decode:
            self.kv.truncate(r.id, r.num_tokens - 1)
        for c in plan.prefill:
            self.kv.truncate(c.req.id, c.start)

    def _launch(self, plan: StepPlan) -> _Launched:
        """Queue the model and the sampler for the plan's rows; no host sync."""
        self.steps += 1
        faults.check(self.comm.mesh.rank, self.steps - 1)
        batch, ids, src = [], [], []
        sampled, counters = [], []
        for r in plan.decode:
            pos, tok, s = r.decode_input()
            batch.append((r.id, pos, 1))
            ids.append(tok)
            src.append(s)
            sampled.append(r)
            counters.append(pos + 1)            # the position of the token sampled
        last = list(range(len(plan.decode)))
        verify = {}
        ahead = [()] * len(sampled)               # guesses before a row's token (verify rows)
        for c in plan.prefill:
            if self.kv.lengths.get(c.req.id, 0) < c.start:       # synthetic KV: no prefill
                self.kv.assume_prefix(c.req.id, c.start)
            batch.append((c.req.id, c.start, len(c.ids)))
            ids += c.ids
            src += [-1] * len(c.ids)
            if c.draft:                           # every row yields a token to check
                verify[c.req.id] = (len(sampled), c.ids[1:])
                sampled += [c.req] * len(c.ids)
                ahead += [tuple(c.ids[1:1 + j]) for j in range(len(c.ids))]
                counters += range(c.start + 1, c.start + 1 + len(c.ids))
                last += range(len(ids) - len(c.ids), len(ids))
            elif c.samples:
                sampled.append(c.req)
                counters.append(c.start + len(c.ids))
                last.append(len(ids) - 1)
                ahead.append(())
        params = [r.params for r in sampled]
        seeds = [self.seeds[r.id] for r in sampled]
        D = len(plan.decode)
        extras = any(p.extras for p in params)    # rows with logprobs, penalties, ...
        produced = ([len(r.output) + r.pending + len(a) for r, a in zip(sampled, ahead)]
                    if extras else [])
        processed = [i for i, (p, n) in enumerate(zip(params, produced)) if p.processed(n)]
        pending = self._pending_tokens(sampled, processed, ids, src, D) if processed else None
        pass_kv = self._pass_kv(batch[D:])
        key = None                            # the prefill graph of a step with chunks
        if plan.prefill and self.prefill_graphs is not None:
            rows = [D + n for n in own_counts(self.sharding, batch[D:])] if pass_kv else None
            key = self.prefill_graphs.choose(len(ids), rows)
        decode_graph = not plan.prefill and self.graphs is not None and self.graphs.fits(len(ids))
        self.last_graphed = decode_graph or key is not None
        if decode_graph:
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(batch, "cpu")
                rows = None if all(p.greedy for p in params) else row_params(params, seeds,
                                                                            counters)
            with nvtx_range(f"helix.decode_graph[{len(ids)}]"):
                logits = self.graphs.run(torch.tensor(ids, dtype=torch.long),
                                         torch.tensor(src, dtype=torch.long), meta, rows)
            h = residual = None
        else:
            with nvtx_range("helix.prepare"):
                meta = self.kv.prepare(batch, "cpu" if key else self.device)
                if pass_kv:
                    meta.cp = plan_pass_kv(self.kv, batch, D, self._layer_page_bytes,
                                           self.runtime.cp_gather_mb << 20, self.device)
                self.prefill_tokens += ((meta.cp.host_rows.numel() if pass_kv else len(ids)) - D
                                        - self._guess_rows(plan, pass_kv))
                last_t = None if len(last) == len(ids) and key is None else upload(
                    torch.tensor(last, dtype=torch.long), self.device)
            if key is not None:
                with nvtx_range(f"helix.prefill_graph[{key[0]} {key[1]}]"):
                    h, residual = self.prefill_graphs.run(
                        key, torch.tensor(ids, dtype=torch.long),
                        torch.tensor(src, dtype=torch.long), meta)
            else:
                h, residual = self._forward_eager(ids, src, meta, len(batch))
            with nvtx_range("helix.head"):
                logits = self.model.head(h, residual, last_t)
            with nvtx_range("helix.sample"):
                if sampled:
                    self.sampler.sample(logits, params, seeds, counters)
        if processed:
            with nvtx_range("helix.process_rows"):
                self.sampler.process_rows(
                    logits, processed, [params[i] for i in processed],
                    [sampled[i].output + list(ahead[i]) if ahead[i] else sampled[i].output
                     for i in processed], pending,
                    self._vocab_rows([sampled[i] for i in processed], logits.shape[1]),
                    [seeds[i] for i in processed], [counters[i] for i in processed],
                    [tuple(self._stop_ids(params[i])) if produced[i] < params[i].min_tokens
                     else () for i in processed],
                    self._grammar_masks([sampled[i] for i in processed],
                                        [ahead[i] for i in processed], logits.shape[1]))
        k = self._logprobs(params, produced, logits) if extras else None
        scored = None
        if h is not None and any(c.req.params.prompt_logprobs is not None for c in plan.prefill):
            scored = score_prompts(plan, self.model.head, h, residual, self.device)
        with nvtx_range("helix.readback"):
            host, event, lps = self.sampler.readback(len(sampled), k)
        for r in plan.decode:
            r.computed = r.num_tokens
        for c in plan.prefill:
            c.req.computed = c.start + len(c.ids)
        for i, r in enumerate(sampled):
            r.pending += 1
            r.pending_row = i
        self.spec_drafted += sum(c.draft for c in plan.prefill)
        self.last_logits = logits
        return _Launched(sampled, host, event, len(ids), lps, scored, verify or None)

    def _guess_rows(self, plan: StepPlan, pass_kv: bool) -> int:
        """Rows of the plan's chunks of guesses this rank projects (not prompt tokens)."""
        rank, n = self.comm.mesh.kvp_rank, 0
        for c in plan.prefill:
            if c.draft:
                n += (self.sharding.local_len(c.start + len(c.ids), rank)
                      - self.sharding.local_len(c.start, rank)) if pass_kv else len(c.ids)
        return n

    def _pending_tokens(self, sampled: list[Request], rows: list[int], ids: list[int],
                        src: list[int], D: int) -> torch.Tensor:
        """For the sampled rows `rows`: the output token the host has not read back yet (a
        decode row's input under overlap: on the device, or forced), -1 where none; queued
        before the step's model runs (which overwrites the sampler's token buffer)."""
        pend = [i < D and sampled[i].pending > 0 for i in rows]
        s = torch.tensor([src[i] if p else -1 for i, p in zip(rows, pend)], dtype=torch.long)
        t = torch.tensor([ids[i] if p else -1 for i, p in zip(rows, pend)], dtype=torch.long)
        return self.sampler.select(upload(s, self.device), upload(t, self.device))

    def _grammar_masks(self, reqs: list[Request], ahead: list[tuple], vocab: int
                       ) -> torch.Tensor | None:
        """[m, V] bool on the device: the ids each row's grammar allows next (every id for a
        request without one), a verify row's after the guesses ahead of it; None when none of
        them has a grammar."""
        if not any(r.id in self.matchers for r in reqs):
            return None
        mask = bitmask(len(reqs), vocab)
        for i, r in enumerate(reqs):
            m = self.matchers.get(r.id)
            if m is None or ahead[i]:
                continue                          # (a verify row: filled with its first)
            last = i
            while last + 1 < len(reqs) and reqs[last + 1] is r:
                last += 1
            if last > i:
                m.fill_ahead(mask, i, ahead[last])
            else:
                m.fill(mask, i)
        return allowed(upload(mask, self.device), vocab)

    def _vocab_rows(self, reqs: list[Request], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' prompt masks and logit biases [m, V] (made once per request, dropped
        when it retires)."""
        for r in reqs:
            if r.id not in self.vocab_rows:
                self.vocab_rows[r.id] = penalties.request_rows(r.prompt, r.params, vocab,
                                                               self.device)
        seen, bias = zip(*(self.vocab_rows[r.id] for r in reqs))
        return torch.stack(seen), torch.stack(bias)

    def _logprobs(self, params: list[SamplingParams], produced: list[int],
                  logits: torch.Tensor) -> int | None:
        """When a sampled row asks for log-probabilities: queue them for every row (the most
        alternatives any row asks for) -> that k, else None. Runs after the step's tokens are
        sampled (eagerly, after a graph's replay too); a row whose token is forced gets the
        forced id's. produced: each row's index of the token sampled."""
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if not asked:
            return None
        forced = [p.forced_tokens[i] if i < len(p.forced_tokens) else -1
                  for p, i in zip(params, produced)]
        forced_t = None if max(forced) < 0 else upload(torch.tensor(forced, dtype=torch.long),
                                                      self.device)
        with nvtx_range("helix.logprobs"):
            self.sampler.logprobs(logits, max(asked), forced_t)
        return max(asked)

    def _forward_eager(self, ids: list[int], src: list[int], meta, num_seqs: int):
        """The model on this step's rows, no graph -> (h, residual) of every row (the head
        comes after)."""
        with nvtx_range("helix.prepare"):
            if meta.is_decode:
                meta.micro_batches = self._micro_batches(num_seqs)
            ids_t = upload(torch.tensor(ids, dtype=torch.long), self.device)
            if any(s >= 0 for s in src):            # tokens still on the device
                src_t = upload(torch.tensor(src, dtype=torch.long), self.device)
                ids_t = self.sampler.select(src_t, ids_t)
        with nvtx_range(f"helix.forward_eager[{len(ids)} tokens]"):
            return self.model.hidden(ids_t, meta.q_pos, meta, self.caches, self.backend)

    def _pass_kv(self, chunks: list[tuple[int, int, int]]) -> bool:
        """Whether this step's prefill chunks pass KV or Q (helix/kv/context_parallel.py): the
        same answer on every rank (it depends on the schedule only)."""
        if not chunks or self.layout.kvp == 1:
            return False
        if self.runtime.prefill_cp == "auto":
            new = sum(n for _, _, n in chunks)
            cached = sum(start for _, start, _ in chunks)
            return pass_kv_cheaper(new, cached, *self._exchange_rows)
        return self.runtime.prefill_cp == "pass-kv"

    # -- KV transfer (helix/kv/transfer.py) ----------------------------------------------------
    def _kv_heads(self) -> tuple[int, int] | None:
        """KV heads this rank holds (GQA), None for MLA (every rank keeps whole latent rows)."""
        if self.cfg.is_mla:
            return None
        return kv_head_range(self.cfg, self.layout.tpa, self.comm.mesh.tpa_rank)

    def _write_imported(self, req: Request, length: int) -> None:
        """Write positions [0, length) of an imported KV into the request's pages: only the
        positions this rank owns, only its KV heads."""
        kv, req.imported_kv = req.imported_kv, None
        pos, slots = self.kv.import_prefix(req.id, length)
        slots = slots.to(self.device)
        heads = self._kv_heads()
        for layer, cache in enumerate(self.caches):
            for c, rows in zip(cache, kv.rows(layer, pos, heads)):
                c.view(-1, *c.shape[2:])[slots] = to_cache(rows.to(self.device), c.dtype)

    def export_kv(self, req_id: int, length: int) -> dict:
        """This rank's part of a sequence's KV, positions [0, length): the positions it owns [n],
        its KV heads (None: whole rows) and per layer the rows, on the CPU
        (helix.kv.transfer.assemble joins the parts)."""
        pos, slots = self.kv.owned(req_id, length)
        slots = slots.to(self.device)
        layers = [tuple(c.view(-1, *c.shape[2:])[slots].cpu() for c in cache)
                  for cache in self.caches]
        return {"positions": pos, "heads": self._kv_heads(), "layers": layers}

    def _resolve_inflight(self, *outs) -> None:
        """_resolve the step in flight into `outs`; a failure there is the device's (an
        asynchronous fault) and ends the engine."""
        step, self.inflight = self.inflight, None
        try:
            self._resolve(step, *outs)
        except Exception as e:
            raise self._die(f"reading back a step failed: {type(e).__name__}: {e}") from None

    def _resolve(self, step: _Launched, out: dict[int, int], logprobs: dict[int, TokenLogprob],
                 prompt_logprobs: dict[int, list[TokenLogprob]],
                 more: dict[int, list[int]], more_lps: dict[int, list[TokenLogprob]]) -> None:
        """Wait for a queued step's tokens; append them to `out` (request id -> token, and
        their log-probabilities to `logprobs`, its prompt positions' to `prompt_logprobs`, for
        requests that asked; a request's tokens after the first, when it verified guesses, to
        `more`, theirs to `more_lps`) and apply stop and length rules. Rows of requests that
        ended meanwhile (a stop id one step earlier, an abort, an error) are dropped."""
        if step.event is not None:
            t = time.perf_counter()
            step.event.synchronize()
            self.wait_seconds += time.perf_counter() - t
        for r, host in step.prompt_logprobs or ():
            if not r.finished:
                prompt_logprobs.setdefault(r.id, []).extend(from_host(*host))
        n = len(step.batch)
        rows = None if step.logprobs is None else from_host(*step.logprobs)
        outs = (out, more, logprobs, more_lps)
        verify, skip = step.verify or {}, 0
        for i, (r, tok) in enumerate(zip(step.batch, step.host[:n].tolist())):
            if skip:                              # the rest of a chunk of guesses
                skip -= 1
                continue
            r.pending -= 1
            group = verify.get(r.id)
            if group is not None and group[0] == i:
                skip = len(group[1])
                r.pending -= skip
                if not r.finished:
                    self._verified(r, group[1], step.host[i:i + skip + 1].tolist(),
                                   None if rows is None else rows[i:i + skip + 1], outs)
                continue
            if r.finished:
                continue
            forced = r.params.forced_tokens
            if len(r.output) < len(forced):
                tok = forced[len(r.output)]
            self._take(r, tok, None if rows is None else rows[i], outs)

    def _take(self, r: Request, tok: int, row, outs: tuple[dict, dict, dict, dict]) -> None:
        """r's next token (row: its row's log-probabilities, when read back): into outs'
        tokens (and logprobs, when r asked), or their `more` when r has one there already;
        then its grammar, stop ids and length limits."""
        out, more, logprobs, more_lps = outs
        r.output.append(tok)
        k = r.params.logprobs
        lp = None if k is None else TokenLogprob(row.logprob, row.top[:k])
        if r.id not in out:
            out[r.id] = tok
            if lp is not None:
                logprobs[r.id] = lp
        else:
            more.setdefault(r.id, []).append(tok)
            if lp is not None:
                more_lps.setdefault(r.id, []).append(lp)
        matcher = self.matchers.get(r.id)
        if matcher is not None and not matcher.accept(tok):
            r.finish_reason = "error"
            r.error = f"token {tok} is outside the request's grammar (no token was allowed)"
        elif tok in self._stop_ids(r.params) or (matcher is not None and matcher.done):
            r.finish_reason = "stop"
        elif (len(r.output) >= r.params.max_new_tokens
              or r.num_tokens - r.pending >= r.max_len):
            r.finish_reason = "length"

    def _verified(self, r: Request, guesses: list[int], chosen: list[int], lps: list | None,
                  outs: tuple[dict, dict, dict, dict]) -> None:
        """A chunk of r's last token and its guesses ran: chosen[j] is the token row j chose
        (lps[j] its log-probabilities, when read back). Guess j is kept while every guess
        before it was and chosen[j] equals it; the kept guesses and the token chosen after them
        are r's new tokens, taken in turn (_take) until one ends it. The KV of rejected
        guesses' positions is dropped (pages released)."""
        m = next((j for j, g in enumerate(guesses) if chosen[j] != g), len(guesses))
        self.spec_accepted += m
        for j, tok in enumerate(chosen[:m + 1]):
            self._take(r, tok, None if lps is None else lps[j], outs)
            if r.finished:
                break
        r.computed = r.num_tokens - 1
        self.kv.truncate(r.id, r.computed)
        self.scheduler.verified(r)

    def _retire(self) -> list[Request]:
        done = self.scheduler.retire()
        for r in done:
            self.kv_tokens_released += self.kv.local_tokens(r.id)
        self.kv.apply_ops(self.scheduler.take_kv_ops(), self.host_cache)   # their pages freed
        for r in done:
            self.seeds.pop(r.id, None)
            self.vocab_rows.pop(r.id, None)
            self.matchers.pop(r.id, None)
        return done

    def _die(self, message: str) -> EngineDeadError:
        """Refuse further work; the message says why, once."""
        self.dead = message
        return EngineDeadError(message)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the graphs (before any process group is destroyed), the weights and the KV
        cache."""
        if self.inflight is not None and self.dead is None:   # its tokens are never reported
            if self.inflight.event is not None:
                try:
                    self.inflight.event.synchronize()
                except Exception:
                    pass
        self.inflight = None
        self.grammars.close()
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.prefill_graphs = None
        # the weights and the KV cache go now, not with the last reference to the engine (an
        # engine built next in the same process would otherwise find their memory taken)
        self.model = None
        self.caches = []
        self.last_logits = None

    def kv_tokens(self) -> int:
        """KV positions this rank has stored for the run's requests (layer 0), live or finished."""
        return self.kv_tokens_released + sum(self.kv.local_tokens(s) for s in self.kv.lengths)

    def stats(self) -> dict:
        """Scheduler counts and this rank's KV pool use: pages requests hold (cached blocks one
        holds included), and free ones (idle cached blocks' included: taken when needed)."""
        free = self.kv_pages_free()
        return dict(self.scheduler.stats(), kv_pages_used=self.num_pages - free,
                    kv_pages_free=free, steps=self.steps, device_wait_s=self.wait_seconds,
                    speculative_draft_tokens=self.spec_drafted,
                    speculative_accepted_tokens=self.spec_accepted)

    def kv_pages_free(self) -> int:
        """Pages of this rank's pool no request holds (free, or idle cached blocks')."""
        return self.kv.alloc.num_free + self.scheduler.cached_pages
