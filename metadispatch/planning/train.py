"""``md.plan``: the fastest training configuration that fits on N logical GPUs.

Every candidate is traced, not estimated: one rank of an N-GPU job is run
in ``MetaMode(world_size=N, rank=0)`` with FSDP2 (``fully_shard``, an
HSDP mesh where the shard degree is less than the data-parallel one), TP
(``parallelize_module``, the command line's colwise/rowwise names), per-block
activation checkpointing (``md.apply_ac``), ``accum`` micro-batches and
AdamW (foreach or fused), two optimizer steps; the second is scored
(the steady state).  Its reserved peak is ``md.fits``'s (the caching
allocator simulated against the profile's memory) and its time
``md.runtime``'s (collectives priced on the profile's links, one stream,
nothing overlapped).

Note [Tracing once per shape class]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two configurations share a trace when their per-rank programs are equal:
the key is the mesh (replicate, shard, tp), AC, micro-batch, optimizer and
the number of micro-batches *traced*, which is ``min(accum, 2)``.  From the
second micro-batch on, accumulation repeats one program (the gradients are
live, FSDP2 reduce-scatters each micro-batch), so the peak of ``accum >= 2``
is the peak of two; the time adds ``accum - 2`` copies of the second
micro-batch's calls (marks ``"micro"`` and ``"opt"``).  This is exact for
memory up to the allocator's segment reuse, which the repeat does not
change (the same sizes freed and taken again).  Rank 0 is traced: FSDP2
and DTensor split as ``torch.chunk`` does, so the first ranks hold the
larger share and rank 0 peaks at least as high as any other
(Note [Ranks that trace alike] in cli/plan.py).  The wrapping is a
script's: TP on each block, then FSDP2 on each block and the root; the
blocks are the children of the largest ``nn.ModuleList`` (``md.plan_ac``'s).
Programs that are not equal still share a build where only the micro-batch,
AC or optimizer differ (Note [One build for the configurations of a mesh]
in programs.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from ..analysis.fit import fits
from ..errors import MetaDispatchError
from ..ir.cut import step_from
from ..ir.text import fmt_bytes
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..spec.profiles import gpu_profile
from ..timing.runtime import runtime
from ..world.expert_parallel import expert_modules
from . import parallel_dims, pipeline_candidates
from .ac import blocks
from .affine import aligned, deep_peak
from .programs import default_step, tp_plan, trace_programs
from .table import KEYS, Candidate, PlanTable, rank_candidates

__all__ = ["plan", "Candidate", "PlanTable", "trace_config"]


def plan(
    make_model: Callable,
    *,
    gpus: int,
    gpu: str = "h100",
    global_batch: int,
    seq: int,
    search: dict | None = None,
    step: Callable | None = None,
    vocab: int | None = None,
    scale: tuple | None = None,
    confirm: int = 5,
    capacity: int | None = None,
) -> PlanTable:
    """Rank the training configurations of ``make_model()`` on ``gpus`` logical ``gpu`` s.

    ``search`` narrows or widens the space: lists under ``shard``, ``tp``,
    ``ac`` (``"none"``, ``"block"``), ``micro_batch``, ``optimizer``
    (``"foreach"``, ``"fused"``); the replicate degree is the rest of the
    data-parallel ranks, ``accum`` what reaches ``global_batch``.  ``step(model,
    ids)`` is the forward and backward (default: ``model(ids, labels=ids)``'s
    ``.loss`` or the output, backward); ``vocab`` the token range (default: the
    model's ``config.vocab_size`` or its first embedding).

    ``scale=(2, 4)``: ``make_model(layers=k)`` builds the model with ``k``
    blocks; each configuration is traced with 2 and 4 and its figures
    extrapolated to the full model's (Note [Scaling from two depths]); the
    fastest are then traced in full until ``confirm`` fit, and the rest say
    ``fits=None`` (not known) with their extrapolated figures.

    ``capacity``: bytes each GPU holds, in place of the profile's memory
    (as for ``md.max_batch``); the times stay the profile's.
    """
    if type(gpus) is not int or gpus < 1:
        raise MetaDispatchError(f"plan: gpus={gpus!r}, a positive number of GPUs")
    if type(global_batch) is not int or global_batch < 1 or type(seq) is not int or seq < 1:
        raise MetaDispatchError(f"plan: global_batch={global_batch!r}, seq={seq!r}: positive integers")
    if capacity is not None and (type(capacity) is not int or capacity < 1):
        raise MetaDispatchError(f"plan: capacity={capacity!r}, a positive number of bytes")
    planner = _Planner(make_model, gpus, gpu, global_batch, seq, step or default_step, vocab)
    planner.capacity = capacity
    start = time.perf_counter()
    planner.scale = _check_scale(scale)
    planner.pool = planner.configs(search or {})
    table = PlanTable(planner.score(Candidate(c, planner)) for c in planner.pool)
    rank_candidates(table)
    # scaled memory is not a verdict: the fastest are confirmed by full traces, in time order
    while scale and sum(c.fits is True for c in table) < confirm and any(c.fits is None for c in table):
        planner.score(next(c for c in table if c.fits is None), full=True)
        rank_candidates(table)
    table.seconds = time.perf_counter() - start
    table.spent = {k: list(v) for k, v in planner.spent.items()}
    table.traces = sum(n for k, (n, _) in table.spent.items() if k != "measuring")
    profile = gpu_profile(gpu)
    each = f"{fmt_bytes(capacity)} each (capacity=)" if capacity else f"{fmt_bytes(profile.memory)} each"
    table.assumes = (
        f"{profile.title}, {each}; md.runtime's efficiency table for it, "
        "collectives on its links, one stream, communication not overlapped with compute"
    )
    return table


def trace_config(make_model: Callable, config: dict, *, gpus: int, gpu: str, seq: int, **options) -> Trace:
    """Rank 0's step for ``config`` (a ``Candidate.config``), as ``md.plan`` traces it."""
    return _Planner(make_model, gpus, gpu, 0, seq, options.get("step") or default_step, options.get("vocab")).trace(
        config
    )


class _Planner:
    def __init__(self, make_model, gpus, gpu, global_batch, seq, step, vocab) -> None:
        self.make_model, self.gpus, self.gpu, self.global_batch, self.seq = make_model, gpus, gpu, global_batch, seq
        self.step, self.vocab = step, vocab
        self.cache: dict = {}
        self.heads: dict | None = None
        self.experts: int | None = None  # the model's fused MoE experts a block, read with the heads
        self.scale: tuple | None = None
        self.depth: int | None = None
        self.capacity: int | None = None  # bytes per GPU in place of the profile's memory
        self.spent: dict = {}  # what -> [count, seconds] (PlanTable.spent)
        self.optimizers: list = ["foreach"]  # the search's; the first is every mesh's twin (_other_optimizer)
        self.opt_steps: dict = {}  # (tp, shard, optimizer, sp, cp, ep) -> its scaled figures (Note [One optimizer step per mesh])
        self.pool: list = []  # the search's configurations, for traces shared by a mesh's micro-batches
        self.shallow: dict = {}  # (key, layers) -> _measure of a shallow trace

    def _spend(self, what: str, since: float) -> None:
        entry = self.spent.setdefault(what, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - since

    def configs(self, search: dict) -> list:
        """Every configuration of ``search``, those that break a rule included (their ``why`` says which)."""
        n = self.gpus
        tps = search.get("tp", [d for d in _divisors(n) if d <= 8])
        self.optimizers = list(search.get("optimizer", ["foreach", "fused"]))
        out = []
        for tp, (sp, cp, ep) in ((t, x) for t in tps for x in parallel_dims.expand(search, t)):
            dp = n // (tp * cp) if n % (tp * cp) == 0 else 0  # CP ranks share a batch
            shards = search.get("shard", _divisors(dp) if dp else [1])
            mbs = search.get("micro_batch", [b for b in (1, 2, 4, 8) if dp and self.global_batch % (dp * b) == 0])
            for shard, ac, mb, opt in itertools.product(
                shards, search.get("ac", ["none", "block"]), mbs, self.optimizers
            ):
                rep = dp // shard if dp and dp % shard == 0 else 0
                accum = self.global_batch // (dp * mb) if dp and self.global_batch % (dp * mb) == 0 else 0
                out.append(dict(zip(KEYS, (shard, rep, tp, ac, mb, accum, opt, sp, cp, ep))))
        pipelines = pipeline_candidates.configs(n, self.global_batch, search, KEYS)  # search's "pp"
        return out + parallel_dims.with_pipelines(search, pipelines)

    def rule(self, c: dict) -> str | None:
        """The divisibility rule ``c`` breaks, if any."""
        n, tp, cp = self.gpus, c["tp"], c.get("cp", 1)
        if n % (tp * cp):
            return f"tp {tp}{f' x cp {cp}' if cp > 1 else ''} does not divide {n} GPUs"
        dp = n // (tp * cp)
        if dp % c["shard"]:
            return f"shard {c['shard']} does not divide the {dp} data-parallel ranks"
        if self.global_batch % (dp * c["micro_batch"]):
            return f"global batch {self.global_batch} is not a multiple of {dp} ranks x micro-batch {c['micro_batch']}"
        for name, count in self._heads().items():
            if count % tp:
                return f"tp {tp} does not divide {name}={count}"
        return parallel_dims.rule(c, self.seq, self.experts)

    def score(self, cand: Candidate, full: bool = False) -> Candidate:
        c = cand.config
        if c.get("pp", 1) > 1:  # Note [Scoring a pipeline configuration] in pipeline_candidates.py
            cand.why = parallel_dims.pipeline_rule(c)
            if not cand.why:
                pipeline_candidates.score(self, cand, tp_plan, custom_step=self.step is not default_step)
            return cand
        cand.why = self.rule(c)
        if cand.why:
            return cand
        key = self._key(c, full)
        cand.cached = key in self.cache
        if not cand.cached:
            try:
                if self.scale and not full:
                    twin = self._other_optimizer(c)
                    mesh = (c["tp"], c["shard"], c["optimizer"], c["sp"], c["cp"], c["ep"])
                    cand.cached = twin is not None and twin is not self.opt_steps.get(mesh)
                    self.cache[key] = twin or self._scaled(c)
                else:  # screening confirms one at a time; a search in full traces each mesh once
                    self.cache[key] = self._measure(self.trace(c)) if full else self._shallow(c, None)
            except (RuntimeError, MetaDispatchError) as e:
                # torch refusing the wrapping (fused AdamW over TP's DTensors and plain tensors when no FSDP2
                # makes them all DTensors) or metadispatch refusing an op: a verdict on this configuration
                self.cache[key] = f"the step raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if isinstance(self.cache[key], str):
            cand.why, cand.fits = self.cache[key], False
            return cand
        peak, reserved, capacity, oom, micro_s, other_s, state, _ = self.cache[key][:8]
        cand.scaled = self.scale is not None and not full
        cand.peak, cand.reserved_peak, cand.fits = int(peak), int(reserved), reserved <= capacity
        cand.state = int(state)
        cand.step_time = other_s + max(c["accum"] - 2, 0) * micro_s
        cand.tokens_per_s = self.global_batch * self.seq / cand.step_time if cand.step_time else None
        if cand.scaled and self.scale:
            a, b = self.scale
            # Note [What scaling may reject]: the bytes live as the optimizer starts extrapolate exactly
            cand.fits = False if state > capacity else None
            cand.why = (
                f"parameters, gradients and optimizer state hold {fmt_bytes(int(state))} "
                f"> {fmt_bytes(capacity)} (extrapolated from {a} and {b} layers)"
                if state > capacity
                else f"not confirmed: memory extrapolated from {a} and {b} layers"
            )
        elif not cand.fits:
            at = f": first OOM at call {oom[0]} ({oom[1]})" if oom else ""
            cand.why = f"reserved {fmt_bytes(int(reserved))} > {fmt_bytes(capacity)}{at}"
        return cand

    def _key(self, c: dict, full: bool) -> tuple:
        # Note [Tracing once per shape class]: accum past 2 repeats the second micro-batch
        return tuple(c[k] for k in KEYS if k != "accum") + (min(c["accum"], 2), self.scale and not full)

    def _other_optimizer(self, c: dict) -> tuple | None:
        """Note [One optimizer step per mesh]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The optimizer step sees the same parameter and gradient shards
        whatever the activation checkpointing and micro-batch: its calls,
        from mark ``"opt"`` to the step's end, are those of the mesh and the
        optimizer alone, and so are the bytes live as it starts.  When
        screening (``scale=``), a configuration whose optimizer is not the
        search's first is then not traced: its time is its first-optimizer
        twin's with that optimizer step swapped for the one traced once for
        the mesh (exact: tests/planning/test_plan.py against full traces),
        its state figure is that trace's, and its peaks are the twin's
        moved by the difference in state (an estimate, as every screened
        peak is; a full trace confirms it).  That optimizer step is traced
        alone, in the first optimizer's build (``_optimizer_alone`` in
        programs.py): one micro-batch's forward-backward and a warmup
        ``opt.step()`` making its state, then one more micro-batch and the
        scored step -- two forward-backwards of one micro-batch each, where
        a warmup and a step of its own run every micro-batch of both.
        """
        first = self.optimizers[0]
        if c["optimizer"] == first:
            return None
        mesh = (c["tp"], c["shard"], c["optimizer"], c["sp"], c["cp"], c["ep"])
        if mesh not in self.opt_steps:  # its optimizer step, traced alone once for the mesh
            self.opt_steps[mesh] = self._scaled(c)
        twin = {**c, "optimizer": first}
        key = self._key(twin, False)
        if key not in self.cache:
            self.cache[key] = self._scaled(twin)
        peak, reserved, capacity, _, micro_s, other_s, state, opt_s = self.cache[key][:8]
        ref = self.opt_steps[mesh][:8]
        moved = ref[6] - state
        return peak + moved, reserved + moved, capacity, None, micro_s, other_s - opt_s + ref[7], ref[6], ref[7]

    def _measure(self, trace: Trace, layers: int | None = None) -> tuple:
        """(allocated peak, reserved peak, capacity, first OOM, last micro-batch's seconds, step's seconds,
        bytes live as the optimizer starts, the optimizer step's seconds), of the step from mark ``"step"`` on."""
        began = time.perf_counter()
        s, m, o = (trace.marks[k] for k in ("step", "micro", "opt"))
        # one cut, read by the allocator, the timeline and the roofline; the build's calls before it scanned once
        step = step_from(trace, s, getattr(trace, "scan", None))
        fit = fits(step, gpu=self.gpu, capacity=self.capacity)
        first = fit.first_oom_call
        oom = (first.index, first.op) if first is not None else None  # numbered from the step, as md.fits(since=)
        live = fit.memory.timeline
        per_call = runtime(step, self.gpu).per_call  # type: ignore[union-attr]  # one trace: a Runtime
        # each call's live bytes, for the peak at full depth (Note [Scaling from two depths])
        lines = aligned(step.calls, live, layers, ends=2) if layers is not None else None
        self._spend("measuring", began)
        return (
            fit.memory.peak,
            fit.reserved_peak,
            fit.capacity,
            oom,
            sum(per_call[m - s : o - s]),
            sum(per_call),
            live[o - s],
            sum(per_call[o - s :]),
            lines,
        )

    def _scaled(self, c: dict) -> tuple:
        """Note [Scaling from two depths]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        With FSDP2 per block, every block adds the same parameters, gradients,
        optimizer state, saved activations and calls: the step time is affine
        in the number of blocks (exact: tests/planning/test_plan.py against
        full traces).  The allocated peak is not -- which call holds it moves
        with the depth (a 2-layer model's logits outweigh its blocks; LLaMA-7B
        with per-block AC on 64 GPUs: the peaks' line through 2 and 4 layers
        gave 2.45 GiB where the full trace holds 32.9 GiB) -- but each call's
        live bytes are, once the blocks between the first and the last are
        left out (Note [Live bytes affine in batch and depth] in affine.py):
        each call's line through depths ``a`` and ``b``, the largest at full
        depth, is the allocated peak (within 1 KiB of a full trace,
        tests/planning/test_plan.py).  Two blocks are kept at each end (Note
        [Blocks unlike their neighbours] in affine.py: FSDP2's prefetch), so
        that needs ``a >= 4`` and the calls to line up; otherwise it is the
        peaks' own line, an estimate.  The reserved peak adds the deeper trace's allocator
        rounding, an estimate either way.  So a scaled peak is never a
        verdict: a scaled candidate's ``fits`` is ``None`` until a full trace
        confirms it, and ``md.plan`` confirms the fastest in time order until
        ``confirm`` of them fit.

        Note [What scaling may reject]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        One memory figure does extrapolate exactly: the bytes live as the
        optimizer step starts -- parameter shards, gradient shards, AdamW's
        state and what the step keeps (the loss) -- are storages, each block
        adding the same ones, with no peak to move.  They are at most the
        allocated peak, itself at most the reserved one, so a candidate
        whose extrapolated figure exceeds the capacity cannot fit: it is
        rejected (``fits`` False, ``.why`` says so) and not traced in full.
        tests/planning/test_plan.py checks the figure against full traces.
        """
        assert self.scale is not None
        a, b = self.scale
        lo, hi = (self._shallow(c, k) for k in (a, b))
        depth = self._depth()

        def at(i):
            return lo[i] + (hi[i] - lo[i]) * (depth - a) / (b - a)

        peak = deep_peak(lo[8], hi[8], (a, b), depth, ends=2)
        if peak is None:  # the calls do not line up: the peaks' own line, an estimate
            return at(0), at(1), lo[2], None, at(4), at(5), at(6), at(7)
        # the reserved peak: the deeper trace's allocator rounding on top, an estimate (only a full trace says)
        return peak, peak + hi[1] - hi[0], lo[2], None, at(4), at(5), at(6), at(7)

    def _shallow(self, c: dict, layers: int | None) -> tuple:
        """``_measure`` of ``c`` at ``layers`` blocks (None: in full), traced with the other configurations of its
        mesh (Note [One build for the configurations of a mesh] in programs.py)."""
        full = layers is None
        key, first = (self._key(c, full), layers), self.optimizers[0]
        if key not in self.shallow:
            group: dict = {}
            for d in [c, *self.pool]:
                if d.get("pp", 1) > 1 or _mesh(d) != _mesh(c) or self.rule(d) is not None:
                    continue  # a pipeline configuration is traced by its stages (pipeline_candidates.py)
                other = (d["tp"], d["shard"], d["optimizer"]) in self.opt_steps or d["optimizer"] in {
                    e["optimizer"] for e in group.values()
                }
                if not full and d is not c and d["optimizer"] != first and other:
                    continue  # Note [One optimizer step per mesh]: one configuration traced for another optimizer
                if (self._key(d, full), layers) not in self.shallow:  # accumulation past 2 repeats one program
                    group.setdefault((self._key(d, full), layers), d)
            pending = list(group.items())
            while pending:  # a step that raised ends its build; those after it are traced in another
                done = zip(pending, self.traces([d for _, d in pending], layers, None if full else first))
                for (k, _), t in sorted(done, key=_in_build_order):  # each cut's scan goes on from the last
                    if t is not None:
                        self.shallow[k] = t if isinstance(t, Exception) else self._measure(t, layers)
                pending = [(k, d) for k, d in pending if k not in self.shallow]
        if isinstance(self.shallow[key], Exception):
            raise self.shallow[key]
        return self.shallow[key]

    def _depth(self) -> int:
        if self.depth is None:
            with MetaMode(device="cuda"):
                self.depth = len(blocks(self.make_model()))
        return self.depth

    def trace(self, c: dict, layers: int | None = None) -> Trace:
        """Rank 0's step for ``c``: built, one warmup step, the step scored (marks ``step``, ``micro``, ``opt``)."""
        if c.get("pp", 1) > 1:
            return pipeline_candidates.trace(self, c, tp_plan)
        out = self.traces([c], layers)[0]
        if isinstance(out, Exception):
            raise out
        return out

    def traces(self, cs: list, layers: int | None = None, first: str | None = None) -> list:
        """Rank 0's steps of ``cs`` (one mesh), one mode (Note [One build for the configurations of a mesh] in
        programs.py); an entry is the exception that configuration's step raised, or None: not traced.  ``first``:
        the optimizer traced in full, the others' optimizer step alone (Note [One optimizer step per mesh])."""
        began = time.perf_counter()
        args = (self.make_model, cs, self.gpus, self.gpu, self.seq, self.step, self.vocab, layers, first)
        out = trace_programs(*args)
        self._spend("full" if layers is None else f"{layers} layer{'s' * (layers != 1)}", began)
        return out

    def _heads(self) -> dict:
        """The model's head counts TP must divide (HF config names), read once from a meta build."""
        if self.heads is None:
            with MetaMode(device="cuda"):
                model = self.make_model()
                cfg = getattr(model, "config", None)
            names = ("num_attention_heads", "num_key_value_heads")
            self.heads = {n: getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)}
            # EP's rule's (parallel_dims.rule), not TP's
            self.experts = next((m.num_experts for m in expert_modules(model)), None)
        return self.heads


def _check_scale(scale) -> tuple | None:
    if scale is None:
        return None
    if not (isinstance(scale, tuple) and len(scale) == 2 and all(type(k) is int for k in scale)) or not (
        0 < scale[0] < scale[1]
    ):
        raise MetaDispatchError(f"plan: scale={scale!r}, two depths (a, b) with 0 < a < b, e.g. (2, 4)")
    return scale


def _in_build_order(done: tuple) -> int:
    t = done[1]
    return t.marks["step"] if isinstance(t, Trace) else -1


def _mesh(c: dict) -> tuple:
    """What a build fixes: every key but those Note [One build for the configurations of a mesh] varies."""
    return tuple((k, v) for k, v in c.items() if k not in ("ac", "micro_batch", "accum", "optimizer"))


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]
