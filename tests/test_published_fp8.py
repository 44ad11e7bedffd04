"""CI holds the fp8 accuracy (issue 43): torchtitan's published Float8 runs, priced here
with the public API and the presets' documented constants (nothing fitted to these rows),
their MAPE and max error asserted, and tensorwise fp8 priced faster than bf16 where it was
published faster.

Rows (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tokens/s per GPU,
torchtitan's Grand Teton H100s: the ``h100-96gb-hbm2e`` preset, SDPA's flash backend as
the runs had it: ``torchtitan_published.h100_mesh``):

- Table 1 / Table 3: Llama-3.1-8B, FSDP over 8 / 128 GPUs, local batch 2 x 8192,
  selective AC, torch.compile + Float8 (tensorwise, weights all-gathered in fp8): 8,532 /
  8,380, beside compiled bf16 6,667 / 6,514 (``torchtitan_float8_published.ROWS``).
- Table 4: Llama-3.1-70B, FSDP 32 x TP 8 (sequence parallel) on 256 GPUs, local batch 16
  x 8192, full AC, torch.compile + Float8: 829, and 876 with AsyncTP. Async TP is not
  modelled (issue 43's next bullet): both rows get one prediction, so the AsyncTP row's
  error is its published gain (5.7%) plus the first row's.

Excluded here, priced by ``benchmarks/h100_validation.py --price-parallel`` (results in
benchmarks/results/h100_validation.md): Table 2's long-context CP rows (another mechanism
of issue 43, errors to -37%) and Tables 5 / 6's 405B pipelines (minutes of tracing); NeMo's
FP8 tables (Transformer Engine's recipe: ``benchmarks/nemo_published.py --dtype fp8``).
"""

from __future__ import annotations

import os
import sys

import pytest

import meshplan

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

# (row, model flavour, GPUs, FSDP, TP, local batch, recompute, published tok/s/GPU,
#  published compiled bf16 tok/s/GPU or None)
ROWS = (
    ("Table 1 8B FSDP 8 + Float8", "8b", 8, 8, 1, 2, "selective", 8532, 6667),
    ("Table 3 8B FSDP 128 + Float8", "8b", 128, 128, 1, 2, "selective", 8380, 6514),
    ("Table 4 70B FSDP 32 TP 8 + Float8", "70b", 256, 32, 8, 16, "full", 829, None),
    ("Table 4 70B FSDP 32 TP 8 + AsyncTP + Float8", "70b", 256, 32, 8, 16, "full", 876, None),
)
SEQ = 8192
# measured by this test at its commit (issue 43): errors -0.5%, -1.8%, +1.7%, +7.4%
# (MAPE 2.8%, max 7.4%; before issue 43: -0.5%, -1.8%, +42.9%, +51.0%); bounds with a
# little room, well inside the dense-fp8 targets (MAPE <= 10%, max <= 20%)
MAPE_BOUND, MAX_BOUND = 0.05, 0.10


@pytest.fixture(scope="module")
def priced():
    sys.path.insert(0, BENCH)
    try:
        import torchtitan_published as tp
    finally:
        sys.path.remove(BENCH)
    flavours = {"8b": tp.LLAMA3_8B, "70b": tp.LLAMA3_70B}
    graphs, out = {}, {}
    for row, flavour, gpus, fsdp, tpd, local, ac, published, bf16_pub in ROWS:
        key = (flavour, fsdp * local)
        if key not in graphs:
            graphs[key] = tp.torchtitan_graph(flavours[flavour], fsdp * local, SEQ, flavour)
        model, graph = graphs[key]
        mesh = tp.h100_mesh(gpus)
        tokens = {}
        for dtype in ("bf16", "fp8"):
            plan = meshplan.manual_plan(model, mesh, graph=graph, dp=fsdp, tp=tpd, zero=3,
                                        microbatch_size=local, recompute=ac, dtype=dtype,
                                        sequence_parallel=tpd > 1, engine="torchtitan")
            est = meshplan.estimate(plan, compiled=True)
            tokens[dtype] = local * fsdp * SEQ / est.step_time_s / gpus
        out[row] = tokens
    return out


def test_published_torchtitan_float8_rows_hold_their_accuracy(priced):
    errors = {}
    for row, *_, published, _bf16 in ROWS:
        # + where the prediction is slower (step time: published / predicted throughput)
        errors[row] = published / priced[row]["fp8"] - 1
    mape = sum(map(abs, errors.values())) / len(errors)
    worst = max(map(abs, errors.values()))
    print({r: f"{e:+.1%}" for r, e in errors.items()}, f"MAPE {mape:.1%} max {worst:.1%}")
    assert mape <= MAPE_BOUND, errors
    assert worst <= MAX_BOUND, errors


def test_tensorwise_fp8_is_priced_faster_than_bf16_where_published_faster(priced):
    for row, *_, published, bf16_pub in ROWS:
        if bf16_pub is not None:
            assert published > bf16_pub  # the table's own comparison
        # every row: published Float8 runs beat bf16 (Tables 1 / 3: 1.28x); Table 4's
        # bf16 run is not published, and its fp8 was priced slower before issue 43
        assert priced[row]["fp8"] > priced[row]["bf16"], row
