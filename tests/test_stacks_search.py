"""``plan --for torchtitan|megatron`` (meshplan/stacks/search.py): the search over the layouts
a stack runs, priced as it runs them; its prunings drop nothing; the plan it returns is
what ``estimate`` and ``import_plan`` price."""

import dataclasses

import pytest
import torch

import meshplan
from meshplan.errors import NotSupportedError, PlanningError
from meshplan.specs import parse_model_spec
from meshplan.stacks import StackLayout, layout_of
from meshplan.stacks.arch import arch_of_spec
from meshplan.stacks.search import layouts, search_layouts, state_floor_gib, target_module

SPEC = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=4"
        "&num_attention_heads=8&num_key_value_heads=4&vocab_size=2048"
        "&max_position_embeddings=8192")


@pytest.fixture(scope="module")
def small():
    model = parse_model_spec(SPEC).build(device="meta")
    ids = torch.zeros((16, 8192), dtype=torch.long, device="meta")
    graph = meshplan.trace(model, (ids,), model_name="small-llama")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    # a device small enough that memory decides between layouts
    dev = dataclasses.replace(mesh.hardware.device, memory_gib=0.6)
    mesh = dataclasses.replace(mesh, hardware=dataclasses.replace(mesh.hardware, device=dev))
    return model, graph, mesh


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
def test_prunings_drop_nothing(small, target):
    model, graph, mesh = small
    fast, priced = search_layouts(model, mesh, target, graph=graph)
    full, every = search_layouts(model, mesh, target, graph=graph, exhaustive=True)
    assert layout_of(fast) == layout_of(full)
    assert fast.predicted == full.predicted
    assert len(priced) < len(every)  # the prunings did prune
    assert any(not p.fits for p in every) and any(p.fits for p in every)  # memory mattered


def test_keep_prices_the_fastest_few(small):
    """``keep=k`` (meshplan fit's list): the k fastest fitting layouts it priced are the k
    fastest of the exhaustive search, less those a lighter recompute of the same layout
    beats (never listed: a heavier recompute is never faster)."""
    from meshplan.plan import RECOMPUTE

    model, graph, mesh = small
    k = 32  # keep=1 lists a wrong 32nd here (its bound pruned a layout faster than it)
    _, priced = search_layouts(model, mesh, "torchtitan", graph=graph, keep=k)
    _, every = search_layouts(model, mesh, "torchtitan", graph=graph, exhaustive=True)

    def shape(lay):
        return dataclasses.replace(lay, recompute="none")

    lightest = {}
    for p in every:
        if p.fits:
            r = RECOMPUTE.index(p.layout.recompute)
            lightest[shape(p.layout)] = min(r, lightest.get(shape(p.layout), r))
    want = sorted(p.step_time_s for p in every if p.fits
                  and RECOMPUTE.index(p.layout.recompute) == lightest[shape(p.layout)])[:k]
    got = sorted(p.step_time_s for p in priced if p.fits)[:k]
    assert len(want) == k and got == want
    assert all(p.memory is not None and p.memory.total_gib == pytest.approx(p.peak_gib)
               for p in priced)


def test_nothing_fits_is_a_memory_error(small):
    from meshplan.errors import MemoryLimitError

    model, graph, mesh = small
    dev = dataclasses.replace(mesh.hardware.device, memory_gib=0.01)
    tiny = dataclasses.replace(mesh, hardware=dataclasses.replace(mesh.hardware, device=dev))
    with pytest.raises(MemoryLimitError) as err:
        search_layouts(model, tiny, "torchtitan", graph=graph)
    assert err.value.min_memory_gib > 0.01 and err.value.code == "MEMORY_OVER_BUDGET"


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
def test_plan_is_priced_as_the_stack_runs_it(small, target, tmp_path):
    model, graph, mesh = small
    plan, _ = search_layouts(model, mesh, target, graph=graph)
    assert plan.engine == target
    assert meshplan.estimate(plan) == plan.predicted  # one pricer: the stack's profile
    again = meshplan.manual_plan(model, mesh, graph=graph, engine=target,
                                 **layout_of(plan).manual_kwargs())
    assert again.predicted == plan.predicted
    plan.to_json(tmp_path / "p.json")
    loaded = meshplan.Plan.from_json(tmp_path / "p.json")
    assert loaded.engine == target and layout_of(loaded) == layout_of(plan)


def test_every_layout_in_the_space_is_one_the_target_runs(small):
    _, graph, mesh = small
    arch = arch_of_spec(SPEC)
    for target in ("torchtitan", "megatron"):
        space = layouts(target, arch, devices=8, devices_per_node=8, global_batch=16,
                        seq_len=8192)
        assert space
        assert not any(target_module(target).problems(lay, arch) for lay in space)
        assert {lay.devices for lay in space} == {8}


def test_state_floor_is_below_what_the_estimate_counts(small):
    model, graph, mesh = small
    arch = arch_of_spec(SPEC)
    for lay in layouts("megatron", arch, devices=8, devices_per_node=8, global_batch=16,
                       seq_len=8192)[::37]:
        plan = meshplan.manual_plan(model, mesh, graph=graph, engine="megatron",
                                    **lay.manual_kwargs())
        # the stage holding at least the average share of parameters holds at least this
        states = max(st.predicted.memory.params_gib + st.predicted.memory.grads_gib
                     + st.predicted.memory.optimizer_gib for st in plan.stages)
        assert state_floor_gib(lay, graph.param_count, "bf16") <= states + 1e-9, lay
        assert state_floor_gib(lay, graph.param_count, "bf16") <= plan.predicted.peak_memory_gib


def test_a_plan_for_a_stack_is_run_there(small):
    model, graph, mesh = small
    plan, _ = search_layouts(model, mesh, "torchtitan", graph=graph)
    from meshplan.runtime.run import parallelize

    with pytest.raises(NotSupportedError, match="made for torchtitan.*meshplan export"):
        parallelize(model, plan)


def test_a_compiled_search_prices_what_the_estimate_prices(small):
    """The search prices each layout as ``meshplan.estimate`` prices the plan it returns under
    torch.compile (``runtime_profiles.with_compile``). Before, the search priced fp8 casts
    eager and the estimate fused: a 405B layout searched at 20.1 s was 17.4 s once returned.
    (fp8 itself is refused for torchtitan 0.3, whose converter has rowwise recipes only.)"""
    model, graph, mesh = small
    plan, priced = search_layouts(model, mesh, "torchtitan", graph=graph, compiled=True)
    chosen = [p for p in priced if p.layout == layout_of(plan, compiled=True)]
    assert chosen and plan.training.compiled
    assert chosen[0].step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert chosen[0].peak_gib == pytest.approx(plan.predicted.peak_memory_gib, rel=1e-9)
    with pytest.raises(PlanningError) as err:
        search_layouts(model, mesh, "torchtitan", graph=graph, dtype="fp8", compiled=True)
    assert "rowwise recipes only" in str(err.value) and "\n" not in str(err.value)


# -- expert parallelism in the stack search ---------------------------------------------------

def _moe_arch(layers: int = 2):
    """torchtitan 0.3.0's qwen3 debugmodel_moe (64 experts, top 8), ``layers`` blocks."""
    from meshplan.stacks.torchtitan_flavors import FLAVORS

    return dataclasses.replace(FLAVORS[("qwen3", "debugmodel_moe")], layers=layers)


@pytest.fixture(scope="module")
def moe():
    """The MoE model traced once; 8 H100s of 0.85 GiB, where memory decides whether experts
    must be split (torchtitan's leanest layout without ep is priced at 0.866 GiB, with its
    activations split per rank: costmodel/stage_layout.factory_split); each target's fast
    and exhaustive searches, run once."""
    arch = _moe_arch()
    model = parse_model_spec(arch.spec()).build(device="meta")
    ids = torch.zeros((16, 4096), dtype=torch.long, device="meta")
    graph = meshplan.trace(model, (ids,), model_name="moe-debug")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    dev = dataclasses.replace(mesh.hardware.device, memory_gib=0.85)
    mesh = dataclasses.replace(mesh, hardware=dataclasses.replace(mesh.hardware, device=dev))
    runs = {t: (search_layouts(model, mesh, t, graph=graph),
                search_layouts(model, mesh, t, graph=graph, exhaustive=True))
            for t in ("torchtitan", "megatron")}
    return model, graph, mesh, arch, runs


def test_ep_space_is_the_axis_tables_degrees_the_target_runs():
    """Every ep degree EP_AXIS offers at a (dp, cp, tp) is searched where the target runs it,
    and no other; a dense model's space has ep 1 only."""
    from meshplan.axes import EP_AXIS

    arch = _moe_arch()
    for target in ("torchtitan", "megatron"):
        space = layouts(target, arch, devices=8, devices_per_node=8, global_batch=16,
                        seq_len=4096)
        eps: dict = {}
        for lay in space:
            eps.setdefault((lay.dp, lay.cp, lay.tp, lay.pp), set()).add(lay.ep)
        for (dp, cp, tp, pp), got in eps.items():
            offered = set(EP_AXIS.degrees(dp * cp * tp, arch.experts))
            assert got <= offered
            for ep in offered:  # each offered degree is searched unless the target refuses
                lay = StackLayout(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, global_batch=16,
                                  seq_len=4096, sequence_parallel=tp > 1,
                                  zero=3 if target == "torchtitan" and dp * cp > 1 else 0)
                if not target_module(target).problems(lay, arch):
                    assert ep in got, (target, lay)
        assert max(max(e) for e in eps.values()) == 8
        assert any(lay.ep > 1 and lay.tp > 1 for lay in space)
        if target == "torchtitan":  # borrowed from dp_shard x cp x tp only (FSDP)
            assert all((lay.cp * lay.tp * (lay.dp if lay.zero >= 2 else 1)) % lay.ep == 0
                       for lay in space)
    dense = layouts("torchtitan", arch_of_spec(SPEC), devices=8, devices_per_node=8,
                    global_batch=16, seq_len=8192)
    assert {lay.ep for lay in dense} == {1}


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
def test_ep_prunings_drop_nothing(moe, target):
    (fast, priced), (full, every) = moe[4][target]
    assert layout_of(fast) == layout_of(full)
    assert fast.predicted == full.predicted
    assert len(priced) < len(every)
    assert {p.layout.ep for p in every} == {1, 2, 4, 8}


def test_ep_wins_where_only_it_fits(moe):
    """On 0.85 GiB devices the experts' state must be split: torchtitan fits only with ep > 1;
    Megatron-LM fits without ep only in a pipeline or with full recompute, beyond the error
    margin slower than the ep layout it picks (planner/simplest.py's order: within the
    margin of the fastest, fewer stages first)."""
    from meshplan.planner.simplest import error_margin

    _, _, mesh, _, runs = moe
    margin = error_margin(mesh.hardware)
    (plan, _), (_, every) = runs["torchtitan"]
    assert layout_of(plan).ep > 1
    assert all(p.layout.ep > 1 for p in every if p.fits)
    (plan, _), (_, every) = runs["megatron"]
    chosen = layout_of(plan)
    fits = [p for p in every if p.fits]
    assert chosen.ep > 1 and chosen.pp == 1
    no_ep = [p for p in fits if p.layout.ep == 1 and p.layout.pp == 1]
    assert all(p.layout.recompute == "full" for p in no_ep)
    assert plan.predicted.step_time_s * (1 + margin) < min(p.step_time_s for p in no_ep)
    assert plan.predicted.step_time_s <= min(p.step_time_s for p in fits) * (1 + margin)


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
def test_ep_plan_is_priced_and_exported_as_the_stack_runs_it(moe, target):
    """The ep plan is what ``estimate`` and ``manual_plan(ep=...)`` price; its layout exported
    carries the degree (expert_parallel_degree, --expert-model-parallel-size) and reads back
    to the same layout."""
    from meshplan.stacks import megatron as mg
    from meshplan.stacks import torchtitan as tt

    model, graph, _, arch, runs = moe
    (plan, _), _ = runs[target]
    lay = layout_of(plan)
    assert lay.ep > 1 and {st.ep for st in plan.stages} == {lay.ep}
    assert meshplan.estimate(plan) == plan.predicted
    again = meshplan.manual_plan(model, plan_mesh(plan), graph=graph, engine=target,
                                 ep=lay.ep, **lay.manual_kwargs())
    assert again.predicted == plan.predicted
    if target == "megatron":
        text = mg.to_megatron(lay, arch)
        assert f"--expert-model-parallel-size {lay.ep}" in text
        assert "--expert-tensor-parallel-size 1" in text
        assert mg.from_megatron(text)[0] == lay
    else:
        flavor = _moe_arch(layers=8)  # the flavor torchtitan ships (8 blocks)
        text = tt.to_torchtitan(lay, flavor)
        assert f"config.parallelism.expert_parallel_degree = {lay.ep}" in text
        assert tt.from_torchtitan(text, devices=lay.devices)[0] == lay
        assert tt.from_torchtitan(tt.torchtitan_command(lay, flavor),
                                  devices=lay.devices)[0] == lay


def plan_mesh(plan):
    from meshplan.costmodel.hardware import HardwareProfile

    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    return meshplan.Mesh(shape=plan.mesh.shape, axis_names=plan.mesh.axis_names, hardware=hw,
                         name=plan.mesh.name)


def test_state_floor_with_ep_is_below_what_the_estimate_counts(moe):
    """The memory pruning's bound stays a bound under ep > 1 (the experts' state split over
    ep x pp, sharded over the dp x cp x tp / ep ranks holding the same experts)."""
    from meshplan.stacks.search import expert_param_count

    model, graph, mesh, arch, _ = moe
    experts = expert_param_count(graph)
    assert 0 < experts < graph.param_count
    space = {}
    for lay in layouts("megatron", arch, devices=8, devices_per_node=8, global_batch=16,
                       seq_len=4096):
        if lay.ep > 1 and lay.recompute == "full" and lay.microbatch_size == 1:
            space.setdefault((lay.dp, lay.tp, lay.pp, lay.ep, lay.zero), lay)
    picked = list(space.values())[::max(1, len(space) // 8)]
    assert len(picked) >= 6
    for lay in picked:
        plan = meshplan.manual_plan(model, mesh, graph=graph, engine="megatron", ep=lay.ep,
                                    **lay.manual_kwargs())
        states = max(st.predicted.memory.params_gib + st.predicted.memory.grads_gib
                     + st.predicted.memory.optimizer_gib for st in plan.stages)
        floor = state_floor_gib(lay, graph.param_count, "bf16", experts)
        assert floor <= states + 1e-9, lay
        if lay.ep > lay.tp:  # and it prunes more than the bound that ignores the split
            assert floor < state_floor_gib(lay, graph.param_count, "bf16")
