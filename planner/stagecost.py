"""Stage costs of a traced model for the pipeline search, and the Plan the search's answer
becomes.

trace -> **cost** (costmodel.estimate.stage_cost) -> solve (planner/inter) -> assemble -> run.
A candidate stage runs a range of layer units on a (dp, tp) submesh with Megatron-LM's
placements (planner/manual.py's propagation rules, so a uniform answer is exactly a plan
``manual_plan`` would write), priced by the same ``stage_cost`` that ``meshplan.estimate``
applies to whole plans. Pricing every one of the thousands of candidate ranges would take
minutes, so ranges are priced *affinely*: a range costs its first unit as a stage of its own
plus, for each further unit, what adding it after its predecessor costs (a probe of two
units minus a probe of one). For repeated identical blocks this is exact up to the cost
model's few non-linear terms (gradient buckets rounded up, the largest layer of a ZeRO-3
buffer); ``assemble_plan`` prices the chosen plan in full, and benchmarks/plan_quality.py
reports the difference.

Probes per unit: one ``stage_cost`` as a single stage (times, tail, weights, activations of
one microbatch plus the working set) and one as the first of two GPipe stages, whose extra
in-flight microbatches separate kept activations from the working set and whose extra
communication is one receive of the unit's input. The search's lower bounds read times only:
their probes skip the activation walk (``stage_cost(memory=False)``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from meshplan import support
from meshplan.costmodel.estimate import default_runtime, stage_cost, with_stage_predictions
from meshplan.costmodel.compute import BACKWARD_FLOPS_FACTOR, DTYPE_NAMES
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GIB, model_state_bytes
from meshplan.costmodel.moe import moe_layers
from meshplan.planner.cp_placements import CpPropagator
from meshplan.planner.manual import Propagator, attention_heads, stage_params, with_cp_axis
from meshplan.planner.assemble import batch_and_seq, mesh_info, model_info, training_config
from meshplan.planner.clusters import LayerUnit, layer_units
from meshplan.graph import OpGraph, OpKind
from meshplan.planner.inter import (PipelinePlan, Problem, SearchSpace, StageCost, StageOption,
                                    search_best)
from meshplan.plan import Estimate, Plan, SolverInfo, Stage
from meshplan.schedules import Schedule
from meshplan.vocabulary import Engine, Recompute
from meshplan.placements import REPLICATE, shard

NAME = "meshplan-inter"
RERANK = 4  # best pipeline shapes priced in full before choosing (affine prices differ ~0.5%)
# ... among those whose affine price is within this factor of the best (2x the affine
# prices' measured difference, benchmarks/plan_quality.py): shapes further off are pruned
RERANK_WITHIN = 0.01
WIDEN = 16  # shapes priced in full when none of the first RERANK fits in full
# models of this many layer units or fewer are priced range by range, exactly: at most
# 12 x 13 / 2 = 78 ranges, each one cost-model call (two with memory)
EXACT_UNITS = 12
_EMPTY = Estimate(step_time_s=0.0, peak_memory_gib=0.0, memory_capacity_gib=0.0, fits=True,
                  mfu=0.0, tokens_per_s=0.0)


class MegatronStageCost:
    """``unit_cost`` for planner/inter's additive fast path (see the module docstring), and
    ``range_cost``, every range priced in full, for models of at most ``exact_units`` units
    (where the affine terms' error, up to 2% of a step on 4 CPU processes, would decide)."""

    exact_units = EXACT_UNITS

    def __init__(self, graph: OpGraph, units: tuple[LayerUnit, ...], hw: HardwareProfile, *,
                 num_devices: int, dtype: str, optimizer: str, engine: str = Engine.GRAPH):
        self.graph, self.units, self.hw = graph, units, hw
        # the engine whose runtime prices every probe (costmodel.estimate.default_runtime):
        # the one that will run the plan, so the search optimises what runs
        self.engine = engine
        # the engine that prices pipelined stages (pp > 1) where it is not ``engine``: the
        # graph engine where the module engine runs no pipeline of this model (api.autoparallel,
        # module_pipeline.model_pipeline_refusal), so one search prices each candidate as the
        # engine that will run it
        self.pipeline_engine: str | None = None
        self.dtype, self.optimizer = dtype, optimizer
        self.batch, self.seq = batch_and_seq(graph)  # a 1-D first input has seq 1
        self.heads = attention_heads(graph)
        self.on_host = min(num_devices, hw.devices_per_node)
        self._placements: dict = {}
        self._walks: dict = {}
        self._probes: dict = {}
        self._alone: dict = {}
        self._acts: dict = {}
        self._neighbourhoods: dict = {}
        self._stage_ops: dict = {}
        self._storage: dict = {}
        self._cp_spans: dict = {}
        self._stage_params: dict = {}
        self._param_dicts: dict = {}
        # the cost model's own memo (operator walks, activation profiles, collective prices):
        # stages that share placements (every recompute and ZeRO choice of one (dp, tp) range)
        # walk their operators once
        self._cost_cache: dict = {}
        # the memo of whole plans priced in full (assemble_plan, best_schedule): kept apart
        # from the probes', which price ranges on cut graphs (``neighbourhood``)
        self._plan_cache: dict = {}
        self._plan_hw: tuple | None = None
        self._cp = None  # CpPropagator after its one walk
        self._matmul_floor: float | None = None

    # -- placements ---------------------------------------------------------------------------
    def placements(self, dp: int, tp: int, sp: bool, zero: int, cp: bool = False):
        """(ops, params) of the whole graph under Megatron's rules on a (dp, tp) mesh. The
        operator rules do not read dp or ZeRO (only parameter storage does), so the graph
        is walked once per (tp, sp)."""
        sp = sp and tp > 1
        key = (dp, tp, sp, zero, cp)
        if key not in self._placements:
            walk = self._walks.get((tp, sp, cp))
            if walk is None:
                prop = Propagator(self.graph, dp=1, tp=tp, sp=sp, seq_len=self.seq, zero=0)
                if cp:
                    prop.vocab = set()  # planner/manual.with_cp_axis
                walk = self._walks[(tp, sp, cp)] = (
                    {n.name: prop.visit(n) for n in self.graph.nodes}, prop.consumed)
            ops, consumed = walk
            # storage reads dp only under ZeRO-3 (the dp shard of each weight)
            skey = (tp, sp, cp, dp if zero >= 3 and dp > 1 else 1)
            params = self._storage.get(skey)
            if params is None:
                store = Propagator(self.graph, dp=skey[3], tp=tp, sp=sp, seq_len=self.seq,
                                   zero=3 if skey[3] > 1 else 0)
                store.consumed = consumed
                params = self._storage[skey] = {p.name: store.storage(p.name)
                                                for p in self.graph.params}
            self._placements[key] = (ops, params)
        return self._placements[key]

    def stage(self, names, option: StageOption, *, index: int = 0, layers=(0, 0)) -> Stage:
        dp, tp = option.mesh_shape
        ops, params = self.placements(dp, tp, option.sequence_parallel, option.zero,
                                      option.cp > 1)
        span = (names[0], names[-1], len(names))
        if span not in self._stage_params:
            self._stage_params[span] = stage_params(self.graph, names)
        # one dict (by identity) per range and storage: the cost model keeps the parameter
        # walk of every recompute choice and pipeline position of a stage under it
        pkey = (span, id(params))
        hit = self._param_dicts.get(pkey)
        if hit is None or hit[0] is not params:
            hit = self._param_dicts[pkey] = (params, {p: params[p]
                                                      for p in self._stage_params[span]})
        params = hit[1]
        # the same operator and input dicts (by identity) for every recompute and ZeRO choice
        # of one range and mesh: the cost model's memo is keyed on them. The operator rules
        # do not read dp, and the cp layout only whether a dp axis exists (with_cp_axis
        # leaves out one-rank axes), so one dict serves every dp > 1
        key = (names[0], names[-1], len(names), dp > 1, tp, option.sequence_parallel and tp > 1,
               option.cp)
        hit = self._stage_ops.get(key)
        if hit is None:
            inputs = {name: (shard(0), REPLICATE) for name, _ in self.graph.inputs}
            ops = {n: ops[n] for n in names}
            if option.cp > 1:  # the cp axis as planner/manual.py writes it
                _, _, ops, _, inputs = with_cp_axis(
                    self._cp_records(names), dp, option.cp, tp, ops, {}, inputs)
            hit = self._stage_ops[key] = (ops, inputs)
        ops, inputs = hit
        shape, axes, n = (dp, tp), ("dp", "tp"), dp * tp
        if option.cp > 1:  # parameters and inputs read no cp records
            ckey = (pkey, dp, option.cp, tp)
            chit = self._param_dicts.get(ckey)
            if chit is None or chit[0] is not params:
                shape, axes, _, cparams, _ = with_cp_axis({}, dp, option.cp, tp, {}, params, {})
                chit = self._param_dicts[ckey] = (params, cparams, shape, axes)
            _, params, shape, axes = chit
            n *= option.cp
        return Stage(index=index, devices=tuple(range(index * n, (index + 1) * n)),
                     mesh_shape=shape, axis_names=axes, layers=layers,
                     nodes=(names[0], names[-1]), recompute=option.recompute, zero=option.zero,
                     inputs=inputs, params=params, ops=ops, ep=option.ep)

    def _cp_records(self, names) -> dict:
        """cp-axis placements of ``names`` (one walk of the graph; they do not depend on
        the cp degree)."""
        if self._cp is None:
            prop = CpPropagator(self.graph, self.seq)
            for node in self.graph.nodes:
                prop.visit(node)
            self._cp = prop
        span = (names[0], names[-1], len(names))
        if span not in self._cp_spans:
            self._cp_spans[span] = self._cp.gather_kv_early(names)
        return self._cp_spans[span]

    def predicted(self, plan: Plan, graph: OpGraph) -> Plan:
        """``with_stage_predictions`` of a plan on the whole graph, with the memo and the
        hardware profile every plan of this search shares (one profile object: the memo
        keys on its id)."""
        hardware = plan.mesh.hardware
        if self._plan_hw is None or self._plan_hw[0] != hardware:
            self._plan_hw = (hardware, HardwareProfile.from_dict(hardware))
        return with_stage_predictions(plan, graph, hw=self._plan_hw[1], cache=self._plan_cache)

    def time_floor_s(self, size: int, microbatches: int) -> float:
        """A lower bound on the relaxed (no recompute, ZeRO-0, time-only) sum of stage times
        of any cut of the model over stages of ``size`` devices at ``microbatches``
        microbatches, priced by no probe: every matmul's forward and backward
        FLOPs at the device's peak times the matmul curve's ceiling, split over every
        device of a stage and every microbatch (``compute.op_time`` prices no matmul
        faster, contention only slows it, and the other terms of a stage's time are not
        negative). 0 where that does not hold: measured operator times, torch.compile's
        fused kernels, fp8 GEMMs, tensor-parallel overlap."""
        runtimes = [default_runtime(self.hw, engine=e, pipeline=True)
                     for e in {self.engine, self.engine_of(True)}]
        if self.hw.measured_ops or self.dtype == "fp8" or \
                any(r.compiled or r.tp_comm_overlap for r in runtimes):
            return 0.0
        if self._matmul_floor is None:
            dev = self.hw.device
            peak = dev.peak_flops(DTYPE_NAMES.get(self.dtype, self.dtype)) * \
                dev.matmul_efficiency.max_eff
            flops = sum(n.flops for n in self.graph.nodes if n.kind == OpKind.MATMUL)
            self._matmul_floor = flops * (1 + BACKWARD_FLOPS_FACTOR[OpKind.MATMUL]) / peak
        # (1 - 1e-9): the search's affine sums round where the walks' sums do not
        return self._matmul_floor / (size * microbatches) * (1 - 1e-9)

    def weights_floor_gib(self, stages: int, dp: int, tp: int, zero: int) -> float:
        """Model state of the average stage with every parameter split over tp: no stage of
        such a pipeline needs less (the cost model's bytes per parameter)."""
        experts = sum(m.numel for m in moe_layers(self.graph).values())
        numel = (self.graph.param_count - experts) / (stages * tp)
        dense = sum(model_state_bytes(numel, dtype=self.dtype, optimizer=self.optimizer,
                                      zero=zero, dp=dp)) / GIB
        # routed experts: split over ep x efsdp = dp x tp at most (costmodel/moe.py), their
        # state never below every byte of it sharded that far
        routed = sum(model_state_bytes(experts / (stages * tp * dp), dtype=self.dtype,
                                       optimizer=self.optimizer, zero=3, dp=1)) / GIB
        return dense + routed

    def engine_of(self, pipelined: bool) -> str:
        """The engine that prices (and will run) a stage of a pipeline or a single stage."""
        return self.pipeline_engine if pipelined and self.pipeline_engine else self.engine

    # -- probes --------------------------------------------------------------------------------
    def probe(self, first: int, last: int, option: StageOption, mbs: int,
              need_memory: bool = True) -> tuple | None:
        """(time, tail, weights GiB, kept GiB, working GiB, receive s) of units [first, last);
        without ``need_memory`` only the time is right (one cost-model call, not two)."""
        dp, tp = option.mesh_shape
        engine = self.engine_of(option.pipelined)
        if self.batch % (dp * mbs) or (tp > 1 and self.heads and self.heads % tp) or \
                (option.ep > 1 and engine == Engine.GRAPH):  # ep runs on the module engine
            return None
        if option.cp > 1 and (not self.heads or self.seq % (2 * option.cp) or
                              option.recompute == Recompute.SELECTIVE or
                              (option.sequence_parallel and engine == Engine.GRAPH)):
            # no attention to split, the layout's 2 x cp chunks do not divide, or what no
            # runtime runs with cp (meshplan/support.py) or the graph engine does not
            # (meshplan/context.graph_engine_cp_refusal: sequence parallelism)
            return None
        if engine == Engine.GRAPH:  # the graph engine's runtime is the same with or without pp
            option = replace(option, pipelined=False)
        key = (tuple(u.key for u in self.units[first:last]), first == 0, option, mbs, engine)
        if (key, True) in self._probes:  # the full probe answers the time-only one too
            return self._probes[(key, True)]
        if not need_memory and (key, False) in self._probes:
            return self._probes[(key, False)]
        names = [n for u in self.units[first:last] for n in u.nodes]
        st = self.stage(names, option)
        m = self.batch // (dp * mbs)
        kw = dict(dtype=self.dtype, optimizer=self.optimizer, microbatches=m,
                  seq_len=self.seq, processes_on_host=self.on_host, cache=self._cost_cache,
                  runtime=default_runtime(self.hw, engine=engine, pipeline=option.pipelined))
        graph = self.neighbourhood(first, last)
        alone = self._alone.get(key)
        if alone is None or (need_memory and alone.memory is None):
            alone = self._alone[key] = stage_cost(st, graph, self.hw, num_stages=1,
                                                  memory=need_memory, **kw)
        if not need_memory:
            self._probes[(key, False)] = (alone.microbatch_s, 0.0, 0.0, 0.0, 0.0, 0.0)
            return self._probes[(key, False)]
        # kept and working activations and the receive do not depend on the ZeRO stage
        # (the activation profile and the send/recv read the operators only), except that
        # below ZeRO-3 an autocast stage keeps a weight copy per microbatch in flight
        # (estimate.stage_cost): one two-stage probe serves ZeRO 0-2, one ZeRO-3
        acts_key = (key[0], key[1], replace(option, zero=3 if option.zero >= 3 else 0), mbs,
                    engine)
        split = self._acts.get(acts_key)
        if split is None:
            two = stage_cost(st, graph, self.hw, num_stages=2, schedule=Schedule.GPIPE, **kw)
            acts1, acts_m = alone.memory.activations_gib, two.memory.activations_gib
            kept = (acts_m - acts1) / (m - 1) if m > 1 else acts1
            split = self._acts[acts_key] = (kept, acts1 - kept, two.comm_s - alone.comm_s)
        kept, working, recv = split
        recv = recv if first > 0 else 0.0
        mem = alone.memory
        weights = mem.params_gib + mem.grads_gib + mem.optimizer_gib + mem.buffers_gib
        out = (alone.microbatch_s, alone.grad_sync_s + alone.optimizer_s, weights, kept,
               working, recv)
        self._probes[(key, True)] = out
        return out

    def neighbourhood(self, first: int, last: int) -> OpGraph:
        """The graph cut to what pricing units [first, last) reads: the operators before the
        blocks (embedding, positions, masks the blocks consume), the unit before (the
        producer of the stage's input) and the units themselves. The cost model scans the
        whole graph it is given on every call; a 96-block model would cost 30x more."""
        key = (first, last)
        if key not in self._neighbourhoods:
            keep = set(self.units[0].nodes) if self.units else set()
            for u in self.units[max(0, first - 1):last]:
                keep.update(u.nodes)
            g = self.graph
            self._neighbourhoods[key] = OpGraph(
                nodes=tuple(n for n in g.nodes if n.name in keep), params=g.params,
                inputs=g.inputs, output=g.output, layer_fingerprints=g.layer_fingerprints,
                block_module=g.block_module, model_name=g.model_name, whole=g.whole or g)
        return self._neighbourhoods[key]

    def range_cost(self, first: int, last: int, option: StageOption, mbs: int, *,
                   need_memory: bool = True) -> StageCost | None:
        """Units [first, last) priced in full as one stage (no affine sum): stagedp uses it
        for models of at most ``exact_units`` units."""
        p = self.probe(first, last, option, mbs, need_memory)
        return None if p is None else StageCost(*p[:5], recv_s=p[5] if first > 0 else 0.0)

    def unit_cost(self, i: int, option: StageOption, mbs: int, *, leading: bool,
                  need_memory: bool = True) -> StageCost | None:
        if leading:
            p = self.probe(i, i + 1, option, mbs, need_memory)
            if p is None:
                return None
            return StageCost(*p[:5], recv_s=p[5])
        one = self.probe(i - 1, i, option, mbs, need_memory)
        two = self.probe(i - 1, i + 1, option, mbs, need_memory)
        if one is None or two is None:
            return None
        d = [b - a for a, b in zip(one, two)]
        return StageCost(time_s=d[0], step_s=d[1], weights_gib=d[2], activation_gib=d[3],
                         transient_gib=d[4], recv_s=0.0)


def assemble_plan(graph: OpGraph, mesh, units: tuple[LayerUnit, ...], answer: PipelinePlan,
                  cost: MegatronStageCost, *, dtype: str, optimizer: str, notes=()) -> Plan:
    """The search's answer as a ``meshplan.plan/v1`` Plan, priced in full by the cost model."""
    stages = []
    for sp in answer.stages:
        names = [n for u in units[sp.units[0]:sp.units[1]] for n in u.nodes]
        st = cost.stage(names, sp.option, layers=sp.layers)
        first = sp.devices[0]
        stages.append(replace(st, index=sp.index,
                              devices=tuple(range(first, first + sp.devices[1]))))
    training = training_config(graph, microbatches=answer.microbatches,
                               microbatch_size=answer.stages[0].microbatch_size, dtype=dtype,
                               optimizer=optimizer, schedule=answer.schedule,
                               virtual_stages=answer.virtual_stages,
                               sequence_parallel=any(s.option.sequence_parallel
                                                     for s in answer.stages))
    status = (f"optimal over the searched space ({answer.combos_searched} pipeline shapes, "
              f"{answer.dp_runs} DP runs)")
    plan = Plan(model=model_info(graph), mesh=mesh_info(mesh), training=training,
                stages=tuple(stages), predicted=_EMPTY,
                solver=SolverInfo(name=NAME, status=status, notes=tuple(notes)), graph=graph,
                engine=cost.engine_of(len(stages) > 1))
    plan = cost.predicted(plan, graph)
    return replace(plan, solver=replace(plan.solver, objective_s=answer.step_time_s))


def plan_hybrid(graph: OpGraph, mesh, *, dtype: str, optimizer: str = "adam",
                memory_limit_gib: float | None = None, space: SearchSpace = SearchSpace(),
                max_units: int | None = None, cost: MegatronStageCost | None = None,
                engine: str = Engine.GRAPH, cap_s: float = float("inf"),
                pipeline_engine: str | None = None) -> Plan:
    """The pipeline search on a traced model: units -> priced candidates -> DP -> Plan,
    every price the one of ``engine``'s runtime (the plan records it), but pipelines' where
    ``pipeline_engine`` names another engine (the one that runs this model's pipelines). Pass
    ``cost`` to share its probes with other searches over the same graph and mesh.
    ``cap_s``: prune every plan the search prices slower (PlanningError when none is
    faster)."""
    start = time.perf_counter()
    hw = mesh.hardware
    units = cost.units if cost is not None else layer_units(graph, max_units=max_units)
    cost = cost or MegatronStageCost(graph, units, hw, num_devices=mesh.num_devices,
                                     dtype=dtype, optimizer=optimizer)
    cost.engine, cost.pipeline_engine = engine, pipeline_engine
    problem = Problem(unit_layers=tuple(u.layers for u in units),
                      unit_keys=tuple(u.key for u in units), num_devices=mesh.num_devices,
                      devices_per_node=mesh.devices_per_node,
                      global_batch=graph.inputs[0][1].shape[0],
                      memory_limit_gib=memory_limit_gib if memory_limit_gib is not None
                      else hw.device.memory_gib, cost_fn=cost,
                      weights_floor_gib=cost.weights_floor_gib, dtype=dtype,
                      experts=routed_experts(graph))
    # the search ranks with affine stage prices; the few best shapes are priced in full
    plans = [assemble_plan(graph, mesh, units, answer, cost, dtype=dtype, optimizer=optimizer)
             for answer in search_best(problem, space, keep=RERANK, within=RERANK_WITHIN,
                                           cap=cap_s)]
    if not any(p.predicted.fits for p in plans):
        # the affine memory of the best shapes was optimistic: widen to more shapes, however
        # far from the fastest, before giving a plan that does not fit
        seen = {_shape(p) for p in plans}
        plans += [p for p in (assemble_plan(graph, mesh, units, answer, cost, dtype=dtype,
                                            optimizer=optimizer)
                              for answer in search_best(problem, space, keep=WIDEN, cap=cap_s))
                  if _shape(p) not in seen]
    plan = min(plans, key=lambda p: (not p.predicted.fits, p.predicted.step_time_s))
    plan = best_schedule(plan, graph, space, cost)
    return replace(plan, wall_time_s=time.perf_counter() - start)


def routed_experts(graph: OpGraph) -> int:
    """Routed experts per MoE layer of ``graph`` (the fewest where layers differ), 0 for a
    dense model: the expert-parallel degrees the search tries divide it."""
    layers = moe_layers(graph)
    return min((m.experts for m in layers.values()), default=0)


def _shape(plan: Plan) -> tuple:
    t = plan.training
    return (t.schedule, t.virtual_stages, t.microbatches,
            tuple((st.layers, st.mesh_shape, st.zero, st.recompute, st.ep) for st in plan.stages))


def best_schedule(plan: Plan, graph: OpGraph, space: SearchSpace,
                  cost: MegatronStageCost | None = None) -> Plan:
    """The chosen pipeline shape under every schedule the space allows, priced in full.

    The search ranks candidates with stage prices rounded to ``space.eps``, so it can miss
    a schedule that is better by less than that; this exact pass over a handful of
    variants (GPipe, 1F1B, interleaved with each allowed depth that divides every stage's
    blocks and with microbatches divisible by the stage count) closes that gap.
    """
    p, t = plan.num_stages, plan.training
    if p == 1:
        return plan
    variants = []
    for schedule in space.schedules:
        depths = space.virtual_stages if schedule == Schedule.INTERLEAVED else (1,)
        for v in depths:
            if schedule == Schedule.INTERLEAVED and (
                    t.microbatches % p or any((st.layers[1] - st.layers[0]) % v
                                              for st in plan.stages)):
                continue
            if (schedule, v) != (t.schedule, t.virtual_stages) and not support.plan_problems(
                    replace(plan, training=replace(t, schedule=schedule, virtual_stages=v))):
                variants.append(replace(t, schedule=schedule, virtual_stages=v))
    best = plan
    for training in variants:
        candidate = replace(plan, training=training)
        candidate = cost.predicted(candidate, graph) if cost is not None else \
            with_stage_predictions(candidate, graph)
        if candidate.predicted.fits and \
                candidate.predicted.step_time_s < best.predicted.step_time_s:
            best = candidate
    return best
