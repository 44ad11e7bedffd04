"""Interleaved pipelines whose blocks do not split into pp x v equal chunks (issue 14).

Pure: the chunk sizes (``chunk_bounds``), the step-time formula (``chunked_step_time``) and
how a manual plan records and prices uneven chunks. On 2 gloo processes (one launch), run by
both engines against one process (losses and every gradient): a 5-block Llama cut into 4
chunks of 1, 1, 2 and 1 blocks (pp=2, v=2), and a 2-block Llama cut into 4 chunks of 0, 1,
1 and 0 blocks, the first holding only the embedding and the last only the norm, head and
loss (Llama 3's layout, arXiv 2407.21783 section 3.3.2). A split given by the caller
(``manual_plan(stage_layers=)``) is recorded and priced as given.
"""

from __future__ import annotations

import sys

import pytest
import torch

import meshplan
from meshplan.specs import parse_model_spec

LLAMA5 = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=5&"
          "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
LLAMA2 = LLAMA5.replace("num_hidden_layers=5", "num_hidden_layers=2")
BATCH, SEQ, STEPS = 8, 16, 2
ENGINES = ("modules", "graph")
MODELS = {"uneven": LLAMA5, "empty_ends": LLAMA2}


def build(device: str = "cpu", spec: str = LLAMA5):
    torch.manual_seed(0)
    return parse_model_spec(spec).build(device=device)


def plan_for(model, graph=None, engine: str = "auto") -> meshplan.Plan:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return meshplan.manual_plan(model, meshplan.Mesh.local(2), example_inputs=(ids,), graph=graph,
                                pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                microbatch_size=2, engine=engine)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


# -- pure ------------------------------------------------------------------------------------

def test_chunk_bounds_are_near_equal_with_the_lighter_chunks_at_the_ends():
    from meshplan.planner.manual import chunk_bounds

    sizes = lambda bounds: [b - a for a, b in bounds]  # noqa: E731
    assert sizes(chunk_bounds(5, 4)) == [1, 1, 2, 1]
    # Llama 3 405B: 126 layers on 16 stages, one fewer on the first and the last (sec. 3.3.2)
    assert sizes(chunk_bounds(126, 16)) == [7] + [8] * 14 + [7]
    assert sizes(chunk_bounds(126, 32)) == [3] + [4] * 30 + [3]
    assert sizes(chunk_bounds(8, 4)) == [2, 2, 2, 2]
    # one block per chunk and two more chunks: embedding-only first, head-only last
    assert sizes(chunk_bounds(126, 128)) == [0] + [1] * 126 + [0]
    assert sizes(chunk_bounds(2, 3)) == [0, 1, 1] and sizes(chunk_bounds(2, 4)) == [0, 1, 1, 0]
    with pytest.raises(meshplan.PlanningError, match="5 chunks need"):
        chunk_bounds(2, 5)
    for n in (1, 7, 16, 63, 126):
        b = chunk_bounds(126, n)
        assert b[0][0] == 0 and b[-1][1] == 126 and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert max(sizes(b)) - min(sizes(b)) <= 1


def test_chunked_step_time_closed_form():
    from meshplan.costmodel.pipeline import chunked_step_time, pipeline_step_time

    # 2 groups: chunks (1, 2) s and (1, 1) s, 4 microbatches: 4 x 3 + (2 - 1) x 2 = 14 s
    t = chunked_step_time([3.0, 2.0], 2.0, 4)
    assert t.step_s == pytest.approx(14.0) and t.bubble_s == pytest.approx(2.0)
    # equal chunks reduce to the interleaved formula (m + (p - 1) / v) x T
    eq = chunked_step_time([4.0] * 4, 2.0, 8)
    assert eq.step_s == pytest.approx(pipeline_step_time([4.0] * 4, 8, "interleaved-1f1b", 2).step_s)


@pytest.fixture(scope="module")
def meta():
    return build("meta")


@pytest.fixture(scope="module")
def graph(meta):
    from meshplan.tracing import trace
    return trace(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))


def test_manual_plan_writes_one_record_per_uneven_chunk_and_prices_the_groups(meta, graph):
    from meshplan.costmodel.estimate import chunk_groups, plan_stage_costs
    from meshplan.costmodel.hardware import HardwareProfile

    plan = plan_for(meta, graph)
    assert [s.layers for s in plan.stages] == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert [s.devices for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert meshplan.support.plan_problems(plan) == ()
    assert chunk_groups(plan) == [[0, 2], [1, 3]]
    costs = plan_stage_costs(plan, graph, HardwareProfile.from_dict(plan.mesh.hardware))
    groups = [costs[0].microbatch_s + costs[2].microbatch_s,
              costs[1].microbatch_s + costs[3].microbatch_s]
    m = plan.training.microbatches
    pipelined = m * max(groups) + max(c.microbatch_s for c in costs)
    tail = max(c.grad_sync_s + c.optimizer_s for c in costs)
    assert plan.predicted.step_time_s == pytest.approx(pipelined + tail)
    # a group's memory holds both of its chunks' parameters
    assert costs[0].memory == costs[2].memory and costs[0].memory.params_gib > 0


def test_too_many_chunks_is_one_clear_line(meta, graph):
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    with pytest.raises(meshplan.PlanningError, match="pp\\*virtual_stages = 8 chunks"):
        meshplan.manual_plan(meta, meshplan.Mesh.local(2), example_inputs=(ids,), graph=graph,
                             pp=2, schedule="interleaved-1f1b", virtual_stages=4)


def test_a_given_split_is_recorded_and_priced_as_given(meta, graph):
    """``stage_layers``: a stack's own split (torchtitan's default puts the lighter stages
    at the two ends), one record per chunk; a wrong count is one clear line."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    kw = dict(example_inputs=(ids,), graph=graph, pp=2, microbatch_size=2)
    mesh = meshplan.Mesh.local(2)
    even = meshplan.manual_plan(meta, mesh, **kw)
    given = meshplan.manual_plan(meta, mesh, stage_layers=(1, 4), **kw)
    assert [s.layers for s in even.stages] == [(0, 3), (3, 5)]
    assert [s.layers for s in given.stages] == [(0, 1), (1, 5)]
    assert given.predicted.step_time_s > even.predicted.step_time_s  # 4 blocks + head
    inter = meshplan.manual_plan(meta, mesh, stage_layers=(2, 1, 1, 1), virtual_stages=2,
                                 schedule="interleaved-1f1b", **kw)
    assert [s.layers for s in inter.stages] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert [s.devices for s in inter.stages] == [(0,), (1,), (0,), (1,)]
    for bad in ((2, 2), (1, 1, 3)):
        with pytest.raises(meshplan.PlanningError, match="summing to the model's 5"):
            meshplan.manual_plan(meta, mesh, stage_layers=bad, **kw)


def test_a_split_that_is_not_whole_numbers_is_one_clear_line(meta, graph):
    """Fractions, strings, bools or a bare int as ``stage_layers`` were a TypeError traceback
    (or, for True, a stage of layers (0, True)); now one PlanningError line."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    kw = dict(example_inputs=(ids,), graph=graph, pp=2, microbatch_size=2)
    for bad in ((2.5, 2.5), ("1", "4"), (True, 4), 5):
        with pytest.raises(meshplan.PlanningError, match="whole numbers; give 2 ints summing"):
            meshplan.manual_plan(meta, meshplan.Mesh.local(2), stage_layers=bad, **kw)


def test_empty_end_chunks_hold_the_embedding_and_the_head():
    from meshplan.tracing import trace

    model = build("meta", LLAMA2)
    graph = trace(model, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))
    plan = plan_for(model, graph)
    assert [s.layers for s in plan.stages] == [(0, 0), (0, 1), (1, 2), (2, 2)]
    assert meshplan.support.plan_problems(plan) == ()
    first, last = plan.stages[0], plan.stages[-1]
    assert set(first.params) == {"model.embed_tokens.weight"}
    assert set(last.params) == {"model.norm.weight", "lm_head.weight"}
    kinds = {graph.node(n).kind.name for n in last.ops}
    assert "LOSS" in kinds and all(graph.node(n).layer < 0 for n in last.ops)
    assert plan.predicted.step_time_s > 0 and plan.predicted.fits


# -- 2 gloo processes against one process ---------------------------------------------------

def expected(spec: str = LLAMA5):
    """One process, no optimizer step (tests/harness/equivalence.py): fp32 and fp64."""
    from meshplan.tracing import next_token_loss
    from tests.harness.equivalence import expected as reference

    return reference(lambda: build(spec=spec), batches(),
                     lambda model, ids: model(ids, use_cache=False).logits, next_token_loss,
                     optimizer=None)


def worker(path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for key, spec in MODELS.items():
        for engine in ENGINES:
            holder = [plan_for(build("meta", spec), engine=engine)
                      if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(holder)
            plan = holder[0]
            assert plan.engine == engine, plan.engine_note
            run = meshplan.parallelize(build(spec=spec), plan)
            got = {"losses": [], "grads": []}
            for ids in batches():
                got["losses"].append(run.train_step((ids,)))
                got["grads"].append(run.engine.full_grads())
                for p in run.parameters():
                    p.grad = None
            results[key, engine] = got
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("uneven") / "out.pt", nproc=2,
                            timeout=300)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("key", MODELS)
def test_uneven_chunks_match_one_process(launched, key, engine):
    """Each step's loss and gradients, within the harness's rule."""
    from tests.harness.equivalence import assert_equivalent

    assert_equivalent(launched[key, engine], expected(MODELS[key]), f"{key} {engine}",
                      fields=("losses", "grads"))


if __name__ == "__main__":
    worker(sys.argv[1])


def test_the_default_split_given_explicitly_prices_the_same(meta, graph):
    """One layout, one price: ``stage_layers`` equal to meshplan's own split gives the same
    records and step time as leaving it out: 3 + 2 blocks at pp=2, the interleaved chunks of
    5 blocks at v=2, and (the review's case, 1.2% apart before) 4 blocks in four chunks of
    one at pp=2, v=2, which meshplan prices as two records of two."""
    from meshplan.planner.manual import chunk_bounds
    from meshplan.tracing import trace

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    mesh = meshplan.Mesh.local(2)
    inter = dict(virtual_stages=2, schedule="interleaved-1f1b")
    four = build("meta", LLAMA5.replace("num_hidden_layers=5", "num_hidden_layers=4"))
    graph4 = trace(four, (ids,))
    chunks = tuple(b - a for a, b in chunk_bounds(5, 4))
    for model, g, extra, split in ((meta, graph, {}, (3, 2)), (meta, graph, inter, chunks),
                                   (four, graph4, inter, (1, 1, 1, 1))):
        kw = dict(example_inputs=(ids,), graph=g, pp=2, microbatch_size=2, **extra)
        plain = meshplan.manual_plan(model, mesh, **kw)
        given = meshplan.manual_plan(model, mesh, stage_layers=split, **kw)
        assert [s.layers for s in given.stages] == [s.layers for s in plain.stages]
        assert given.predicted.step_time_s == plain.predicted.step_time_s
