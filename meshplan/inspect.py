"""Reading plans: the tables and plain words of ``meshplan show`` and ``Plan.summary()``.

trace -> cost -> solve -> plan -> **read**. Pure functions of a Plan (and, when there is
one, the OpGraph it was made from): the top table (predicted step time, throughput, MFU,
bubble, peak memory against capacity, solver status and gap), one row per stage (devices,
layers, recompute, memory breakdown, compute against communication), and one line per
group of identical layers saying in words how their weights and batch are split
("attention qkv: column-parallel over axis 1 (gpu); batch over axis 0 (node)").

A plan loaded from a file carries no graph; the words then come from the parameter table
alone ("weight split on dim 1"). With the graph (``Plan.graph``, or re-traced with
``meshplan show --model``) they name the parallel style from the consuming operator.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from meshplan.context import chunk_words
from meshplan.placements import PARTIAL, REPLICATE, shard, shard_dim
from meshplan.support import cp_degree
from meshplan.vocabulary import ENGINES, EXPORT_TARGET, Engine

if TYPE_CHECKING:  # annotations only: Plan.summary() calls this module (meshplan/plan.py)
    from meshplan.plan import Plan, Stage

# Readable names of the common transformer sub-modules (GPT-2, Llama, BERT, OPT, NeoX
# naming in transformers); anything else shows its module path.
MODULE_WORDS = {
    "attn.c_attn": "attention qkv", "attn.c_proj": "attention out",
    "mlp.c_fc": "mlp up", "mlp.c_proj": "mlp down",
    "self_attn.q_proj": "attention q", "self_attn.k_proj": "attention k",
    "self_attn.v_proj": "attention v", "self_attn.o_proj": "attention out",
    "self_attn.out_proj": "attention out",
    "mlp.gate_proj": "mlp gate", "mlp.up_proj": "mlp up", "mlp.down_proj": "mlp down",
    "attention.query_key_value": "attention qkv", "attention.dense": "attention out",
    "mlp.dense_h_to_4h": "mlp up", "mlp.dense_4h_to_h": "mlp down",
    "attention.self.query": "attention q", "attention.self.key": "attention k",
    "attention.self.value": "attention v", "attention.output.dense": "attention out",
    "intermediate.dense": "mlp up", "output.dense": "mlp down",
    "fc1": "mlp up", "fc2": "mlp down",
    "ln_1": "norm 1", "ln_2": "norm 2", "input_layernorm": "norm 1",
    "post_attention_layernorm": "norm 2",
    "wte": "token embedding", "wpe": "position embedding", "embed_tokens": "token embedding",
    "lm_head": "output head", "ln_f": "final norm", "norm": "final norm",
    "word_embeddings": "token embedding", "position_embeddings": "position embedding",
}
_LAYER_RE = re.compile(r"^(.*?)\.(\d+)\.(.+)$")
OUTSIDE = -1  # embedding, final norm and head: outside the repeated blocks


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_range(first: int, last: int) -> str:
    """Inclusive range of layer indices in words."""
    if first == OUTSIDE:
        return "outside blocks"
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def module_words(module: str) -> str:
    parts = module.split(".")
    for k in (3, 2, 1):
        key = ".".join(parts[-k:])
        if len(parts) >= k and key in MODULE_WORDS:
            return MODULE_WORDS[key]
    return module


def split_param_name(name: str) -> tuple[int, str]:
    """``transformer.h.3.attn.c_attn.weight`` -> (3, "attn.c_attn"); outside blocks -> -1."""
    owner = name.rsplit(".", 1)[0] if "." in name else name
    m = _LAYER_RE.match(owner)
    if m:
        return int(m.group(2)), m.group(3)
    return OUTSIDE, owner


def axis_label(stage: Stage, axis: int) -> str:
    return f"axis {axis} ({stage.axis_names[axis]})"


def _param_consumer_outputs(stage: Stage, graph) -> dict[str, tuple]:
    """parameter -> (consuming node, its output placements), from the graph when known."""
    out: dict[str, tuple] = {}
    if graph is None:
        return out
    for name, op in stage.ops.items():
        if name not in graph:
            continue
        node = graph.node(name)
        for p in node.params:
            out.setdefault(p, (node, op.output))
    for info in graph.params:  # tied weights (embedding = output head) share a consumer
        if info.tied_to is not None:
            if info.name not in out and info.tied_to in out:
                out[info.name] = out[info.tied_to]
            elif info.tied_to not in out and info.name in out:
                out[info.tied_to] = out[info.name]
    return out


def _style(param_pl: str, axis: int, consumer) -> str:
    """Words for one sharded parameter on one axis."""
    d = shard_dim(param_pl)
    if consumer is not None:
        node, out = consumer
        kind = str(node.kind)
        opl = out[axis] if axis < len(out) else REPLICATE
        ndim = len(node.out.shape) if node.out is not None else 0
        if kind == "matmul":
            if opl == PARTIAL:
                return "row-parallel"
            if ndim and shard_dim(opl) == ndim - 1:
                return "column-parallel"
        if kind == "embedding" and d == 0:
            return "vocab-parallel"
        if kind == "embedding" and d == 1:
            return "hidden-parallel"
    if param_pl == PARTIAL:
        return "partial sums"
    return f"weight split on dim {d}"


def param_styles(stage: Stage, graph=None) -> dict[int, dict[str, list[tuple[int, str]]]]:
    """layer -> readable module name -> [(mesh axis, style)] for its sharded weights.

    Every module with parameters appears, with an empty list when all are replicated.
    """
    consumers = _param_consumer_outputs(stage, graph)
    layer_of = {}
    if graph is not None:
        for name in stage.ops:
            if name in graph:
                for p in graph.node(name).params:
                    layer_of.setdefault(p, graph.node(name).layer)
    out: dict[int, dict[str, list[tuple[int, str]]]] = {}
    for pname, pl in stage.params.items():
        layer, module = split_param_name(pname)
        layer = layer_of.get(pname, layer)
        styles = out.setdefault(layer, {}).setdefault(module_words(module), [])
        if pname.endswith(".bias") and pname[:-5] + ".weight" in stage.params:
            continue  # the weight already says it
        for axis, p in enumerate(pl):
            if p != REPLICATE and stage.mesh_shape[axis] > 1:
                item = (axis, _style(p, axis, consumers.get(pname)))
                if item not in styles:
                    styles.append(item)
    return out


def stage_layer_words(stage: Stage, graph=None) -> dict[int, str]:
    """For every layer of the stage (and -1 for ops outside blocks), its placements in words."""
    per_layer = {
        layer: {w: [f"{style} over {axis_label(stage, axis)}" for axis, style in items]
                for w, items in modules.items()}
        for layer, modules in param_styles(stage, graph).items()}
    batch = _batch_words(stage)
    first, last = stage.layers[0], stage.layers[1] - 1
    layers = sorted(set(range(first, last + 1)) | set(per_layer))
    out = {}
    for layer in layers:
        phrases = per_layer.get(layer, {})
        parts = [f"{w}: {', '.join(ps)}" for w, ps in phrases.items() if ps]
        text = "; ".join(parts) if parts else "weights replicated"
        if batch:
            text += "; " + batch
        if stage.zero:
            text += f"; ZeRO-{stage.zero}"
        out[layer] = text
    return out


def _batch_words(stage: Stage) -> str:
    """How the first graph input (the token ids) is split: batch and sequence axes."""
    split: dict[str, list[str]] = {}
    for placements in list(stage.inputs.values())[:1]:
        for axis, p in enumerate(placements):
            if stage.mesh_shape[axis] > 1 and p in (shard(0), shard(1)):
                word = "batch" if p == shard(0) else "sequence"
                split.setdefault(word, []).append(f"{axis} ({stage.axis_names[axis]})")
    if "cp" in stage.axis_names:  # the ids are R on cp; every activation's sequence is split
        axis = tuple(stage.axis_names).index("cp")
        split.setdefault("sequence (head + tail chunks)", []).append(f"{axis} (cp)")
    return "; ".join(f"{w} over axis {ax[0]}" if len(ax) == 1 else
                     f"{w} over axes {', '.join(ax)}" for w, ax in split.items())


def fmt_mem(gib: float) -> str:
    a = abs(gib)
    if a >= 1 or a == 0:
        return f"{gib:.2f} GiB"
    return f"{gib * 1024:.2f} MiB" if a >= 2 ** -10 else f"{gib * 2 ** 20:.1f} KiB"


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Consecutive layers of one stage whose placements read the same."""

    stage: int
    first: int
    last: int
    words: str


def layer_groups(plan: Plan, graph=None) -> list[LayerGroup]:
    graph = graph if graph is not None else plan.graph
    groups: list[LayerGroup] = []
    for st in plan.stages:
        words = stage_layer_words(st, graph)
        # ops outside the blocks come first in the first stage (embedding), last otherwise (head)
        for layer in sorted(words, key=lambda x: x if x != OUTSIDE or st.layers[0] == 0 else 1 << 30):
            prev = groups[-1] if groups else None
            if (prev and prev.stage == st.index and prev.words == words[layer]
                    and prev.last == layer - 1 and layer != OUTSIDE and prev.first != OUTSIDE):
                groups[-1] = LayerGroup(st.index, prev.first, layer, prev.words)
            else:
                groups.append(LayerGroup(st.index, layer, layer, words[layer]))
    return groups


# -- what the batch is made of ---------------------------------------------------------------

def has_sequence(plan: Plan) -> bool:
    """Whether the plan's first input (the one ``training.seq_len`` is read from: its dim 1,
    planner/assemble.py ``batch_and_seq``) has a sequence axis: token ids (integers, batch x
    seq ...) or float embeddings (batch x seq x features). Float features (batch x features)
    and images (batch x channels x height x width) have none; nor has a plan that records no
    inputs from before the records (read as the token ids it was made for)."""
    if not plan.model.inputs:
        return True
    rec = plan.model.inputs[0]
    shape, dtype = rec.get("shape", ()), str(rec.get("dtype", ""))
    if len(shape) < 2:
        return False
    if dtype.startswith(("float", "bfloat", "complex")):
        return len(shape) == 3
    return True


def batch_words(plan: Plan) -> str:
    """``16 x 32`` (global batch x sequence) or ``16 samples`` where there is no sequence."""
    t = plan.training
    return f"{t.global_batch} x {t.seq_len}" if has_sequence(plan) else \
        f"{t.global_batch} samples"


def throughput(plan: Plan) -> tuple[str, float]:
    """("tokens/s", tokens per second), or ("samples/s", ...) where the input has no sequence
    (the estimate's ``tokens_per_s`` counts batch x dim 1 of the first input)."""
    p, t = plan.predicted, plan.training
    if has_sequence(plan):
        return "tokens/s", p.tokens_per_s
    return "samples/s", p.tokens_per_s / max(t.seq_len, 1)


# -- tables -------------------------------------------------------------------------------------

def head_table(plan: Plan) -> Table:
    p, t = plan.predicted, plan.training
    head = Table(title=f"meshplan plan: {plan.model.name} on {plan.mesh.name} "
                       f"(mesh {'x'.join(map(str, plan.mesh.shape))}, {plan.num_devices} devices)",
                 show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row("parameters", f"{plan.model.param_count:,}")
    sched = t.schedule + (f" x{t.virtual_stages} virtual" if t.virtual_stages > 1 else "")
    head.add_row("global batch x seq" if has_sequence(plan) else "global batch",
                 f"{batch_words(plan)} "
                 f"({t.microbatches} microbatch{'es' if t.microbatches != 1 else ''}"
                 f"{f' of {t.microbatch_size}' if t.microbatch_size else ''}, {t.dtype}, "
                 f"{t.optimizer})")
    head.add_row("stages / schedule", f"{plan.num_stages} / {sched}"
                 + (", sequence parallel" if t.sequence_parallel else ""))
    cp = cp_degree(plan.stages[0]) if plan.stages else 1
    if cp > 1:
        head.add_row("context parallel", chunk_words(t.seq_len, cp))
    head.add_row("predicted step time", fmt_time(p.step_time_s))
    unit, rate = throughput(plan)
    head.add_row("throughput", f"{rate:,.0f} {unit}")
    head.add_row("MFU", f"{p.mfu * 100:.1f}%")
    head.add_row("pipeline bubble", f"{p.bubble_fraction * 100:.1f}%")
    head.add_row("peak memory / device", f"{p.peak_memory_gib:.3f} GiB of "
                 f"{p.memory_capacity_gib:.1f} GiB ({_pct(p.peak_memory_gib, p.memory_capacity_gib)})"
                 + ("" if p.fits else f"  DOES NOT FIT: {p.overflow}"))
    head.add_row("time breakdown", ", ".join(f"{k} {fmt_time(v)}" for k, v in p.breakdown.items()))
    if plan.engine not in ENGINES:  # priced for a stack (support.stack_refusal)
        target = EXPORT_TARGET[plan.engine]
        runs_on = (f"{plan.engine}, not meshplan: `meshplan export PLAN --to {target}`"
                   + (f" ({plan.engine_note})" if plan.engine_note else ""))
    elif plan.engine == Engine.MODULES:
        runs_on = "module engine (parallelize_module, fully_shard, checkpoint wrappers" + \
            (", torch.distributed.pipelining)" if plan.num_stages > 1 else ")")
    else:
        runs_on = "graph engine (exported graph on DTensor)" + \
            (f": {plan.engine_note}" if plan.engine_note else "")
    head.add_row("runs on", runs_on)
    head.add_row("solver", f"{plan.solver.name}: {plan.solver.status}, gap {plan.solver.gap:.2%}, "
                 f"{plan.solver.time_s:.2f} s (deterministic)")
    for note in plan.solver.notes:
        head.add_row("note", note)
    return head


def _pct(a: float, b: float) -> str:
    return f"{a / b:.0%}" if b else "-"


def stage_table(plan: Plan) -> Table:
    stages = Table(title="stages (memory per device in GiB; time of one microbatch)",
                   title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                   padding=(0, 1))
    for col in ("stage", "devices", "mesh", "layers", "recompute", "zero", "params", "grads",
                "optim", "activ", "total", "compute", "comm"):
        stages.add_column(col, justify="left" if col == "recompute" else "right")
    for st in plan.stages:
        m = st.predicted.memory
        devs = f"{st.devices[0]}-{st.devices[-1]}" if len(st.devices) > 1 else str(st.devices[0])
        c, k = st.predicted.compute_s, st.predicted.comm_s
        stages.add_row(str(st.index), f"{devs} ({len(st.devices)})",
                       "x".join(map(str, st.mesh_shape)) + (
                           f" ({','.join(st.axis_names)})" if "cp" in st.axis_names else "")
                       + (f" ep{st.ep}" if st.ep > 1 else ""),
                       f"{st.layers[0]}-{st.layers[1] - 1}" if st.layers[1] > st.layers[0] else "-",
                       st.recompute, str(st.zero), f"{m.params_gib:.3f}", f"{m.grads_gib:.3f}",
                       f"{m.optimizer_gib:.3f}", f"{m.activations_gib:.3f}", f"{m.total_gib:.3f}",
                       fmt_time(c), f"{fmt_time(k)} ({_pct(k, c + k)})")
    return stages


def layer_table(plan: Plan, graph=None) -> Table:
    table = Table(title="placements by layer", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1),
                  pad_edge=False)
    table.add_column("stage", justify="right")
    table.add_column("layers")
    table.add_column("placements")
    for g in layer_groups(plan, graph):
        table.add_row(str(g.stage), fmt_range(g.first, g.last), g.words)
    return table


def routed_experts_of(graph) -> int:
    """The routed-expert count of a traced model (its 3-D ``experts`` weights' leading size),
    0 when unknown."""
    if graph is None:
        return 0
    sizes = {p.shape[0] for p in graph.params if len(p.shape) == 3 and "expert" in p.name}
    return min(sizes) if sizes else 0


def expert_lines(plan: Plan, graph=None) -> list[str]:
    """Which ranks hold which routed experts, one line per ep group of each stage with
    ep > 1 (the layout of runtime/expert_parallel.py ``ep_mesh``: the dp axis viewed as
    (efsdp, ep), ep inner, so an ep group is a run of ``ep`` consecutive dp ranks and the
    experts are split in order over it)."""
    graph = graph if graph is not None else plan.graph
    experts = routed_experts_of(graph)
    out = []
    for st in plan.stages:
        if st.ep == 1 or "dp" not in st.axis_names:
            continue
        ranks = _ranks_by_dp(st)
        for g in range(0, len(ranks), st.ep):
            group = ranks[g:g + st.ep]
            held = []
            for i, rank_set in enumerate(group):
                which = (f"experts {i * experts // st.ep}-{(i + 1) * experts // st.ep - 1}"
                         if experts else f"expert shard {i}/{st.ep}")
                held.append(f"rank {'/'.join(map(str, rank_set))}: {which}")
            out.append(f"stage {st.index} ep group {g // st.ep} (dp ranks {g}-{g + st.ep - 1}): "
                       + "; ".join(held))
    return out


def _ranks_by_dp(stage: Stage) -> list[tuple[int, ...]]:
    """Each dp index's devices (the stage's other axes' ranks, which hold the same shard)."""
    shape, names = list(stage.mesh_shape), list(stage.axis_names)
    dp = names.index("dp")
    out: list[list[int]] = [[] for _ in range(shape[dp])]
    for flat, device in enumerate(stage.devices):
        index, rest = [], flat
        for size in reversed(shape):
            index.append(rest % size)
            rest //= size
        out[list(reversed(index))[dp]].append(device)
    return [tuple(r) for r in out]


def expert_table(plan: Plan, graph=None) -> Table | None:
    lines = expert_lines(plan, graph)
    if not lines:
        return None
    table = Table(title="routed experts by rank (expert parallelism)", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    table.add_column("ep group: ranks: experts they hold")
    for line in lines:
        table.add_row(line)
    return table


def summary_table(plan: Plan, graph=None) -> list:
    experts = expert_table(plan, graph)
    return [head_table(plan), stage_table(plan), layer_table(plan, graph),
            *([experts] if experts is not None else [])]


def render(tables, width: int = 120) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for table in tables:
        console.print(table)
    return buf.getvalue()


def summary_text(plan: Plan, width: int = 120, graph=None) -> str:
    return render(summary_table(plan, graph), width)
