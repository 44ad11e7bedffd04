"""The H800, B200 and GB200 NVL72 presets (issue 43): each loads and validates, plans a small
model, and holds the datasheet's (or the DeepSeek-V3 report's) numbers, each with its source.
Their kernel curves are the H100's carried as fractions of their own peaks, an assumption the
sources say in words."""

import pytest

import meshplan
from meshplan.costmodel.hardware import HardwareProfile, load_preset

# name -> (devices per node (the NVLink domain), intra GB/s, inter GB/s, HBM GB/s, GiB,
#          dense TFLOP/s bf16, fp8, fp4 (None: no fp4 tensor cores))
CITED = {
    # DeepSeek-V3 report (arXiv 2412.19437) sec. 3.1/3.2.2: 8 GPUs a node, NVLink 160 GB/s
    # reached (400 GB/s bidirectional on the datasheet), IB 50 GB/s (8x 400 Gb/s a node);
    # H800 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, 1,979 bf16 / 3,958 fp8 with sparsity
    "dgx-h800": (8, 160.0, 50.0, 3350.0, 79.6, 989.0, 1979.0, None),
    # HGX/DGX B200 datasheets, 8 GPUs: 36 / 72 / 144 PFLOPS bf16 / fp8 / fp4 with sparsity,
    # 1,440 GB and 64 TB/s HBM3e, 14.4 TB/s NVLink (900 GB/s per GPU per direction, at 0.844
    # as NVLink4 reached on H100), 8x 400 Gb/s ConnectX-7
    "dgx-b200": (8, 760.0, 50.0, 8000.0, 167.6, 2250.0, 4500.0, 9000.0),
    # GB200 NVL72 datasheet, 72 GPUs in one NVLink domain: 360 / 720 / 1,440 PFLOPS with
    # sparsity, 13.4 TB and 576 TB/s HBM3e, 130 TB/s NVLink; 400 Gb/s ConnectX-7 per GPU
    "gb200-nvl72": (72, 760.0, 50.0, 8000.0, 173.2, 2500.0, 5000.0, 10000.0),
}


@pytest.mark.parametrize("name", sorted(CITED))
def test_preset_holds_the_cited_numbers_each_with_its_source(name):
    hw = load_preset(name)
    per_node, intra, inter, hbm, gib, bf16, fp8, fp4 = CITED[name]
    dev = hw.device
    assert hw.devices_per_node == per_node
    assert (hw.intra_node.bandwidth_gbps, hw.inter_node.bandwidth_gbps) == (intra, inter)
    assert (dev.memory_bandwidth_gbps, dev.memory_gib) == (hbm, gib)
    assert dev.peak_tflops["bfloat16"] == bf16 and dev.peak_tflops["float8"] == fp8
    assert dev.peak_tflops.get("float4") == fp4
    assert dev.peak_tflops["float8"] == pytest.approx(2 * dev.peak_tflops["bfloat16"], abs=1)
    for key in ("device.peak_tflops", "device.peak_tflops.float8", "device.memory_gib",
                "device.memory_bandwidth_gbps", "device.matmul_efficiency",
                "device.attention_kernels", "device.fp8_gemm_efficiency", "intra_node",
                "inter_node", "devices_per_node"):
        assert hw.sources.get(key), (name, key)
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


@pytest.mark.parametrize("name", sorted(CITED))
def test_kernel_curves_are_the_h100_s_carried_and_say_so(name):
    """Not measured on these parts: the same fractions of peak as the H100 measured, and
    the source says it (an assumption for Blackwell, the same chip for the H800)."""
    hw, h100 = load_preset(name).device, load_preset("dgx-h100").device
    assert hw.matmul_efficiency == h100.matmul_efficiency
    assert hw.attention_kernels == h100.attention_kernels
    assert hw.fp8_gemm_efficiency == h100.fp8_gemm_efficiency
    src = load_preset(name).sources
    for key in ("device.matmul_efficiency", "device.fp8_gemm_efficiency",
                "device.attention_kernels"):
        assert "carried from dgx-h100" in src[key]
        if name != "dgx-h800":
            assert src[key].startswith("ASSUMPTION, not a measurement")


@pytest.mark.parametrize("name", sorted(CITED))
def test_each_preset_plans_a_small_model(tiny_llama_h100, name):
    model, graph, _ = tiny_llama_h100
    mesh = meshplan.Mesh.preset(name, nodes=2)
    assert mesh.num_devices == 2 * CITED[name][0]
    eight = meshplan.Mesh((8,), load_preset(name), ("gpu",))  # 8 GPUs of one NVLink domain
    plan = meshplan.manual_plan(model, eight, graph=graph, dp=8, engine="torchtitan",
                                dtype="bf16")
    assert plan.predicted.step_time_s > 0 and plan.mesh.hardware["name"] == name
    # faster chips price the same layout faster: bf16 peaks 989 < 2,250 < 2,500
    h100 = meshplan.manual_plan(model, meshplan.Mesh.preset("dgx-h100"), graph=graph, dp=8,
                                engine="torchtitan", dtype="bf16")
    if name == "dgx-h800":  # the H100's compute and HBM, a slower NVLink
        assert plan.predicted.step_time_s >= h100.predicted.step_time_s
    else:
        assert plan.predicted.step_time_s < h100.predicted.step_time_s


def test_gb200_keeps_16_gpus_inside_its_72_gpu_nvlink_domain(tiny_llama_h100):
    """dp 8 x tp 2 on 16 GPUs: the dp axis stays on NVLink in a GB200 NVL72 rack and
    crosses InfiniBand between two DGX B200 nodes of 8: its communication prices lower."""
    model, graph, _ = tiny_llama_h100
    kw = dict(graph=graph, dp=8, tp=2, engine="torchtitan", dtype="bf16")
    gb = meshplan.manual_plan(model, meshplan.Mesh((16,), load_preset("gb200-nvl72"), ("gpu",)),
                              **kw)
    b200 = meshplan.manual_plan(model, meshplan.Mesh.preset("dgx-b200", nodes=2), **kw)
    assert gb.predicted.breakdown["comm"] < b200.predicted.breakdown["comm"]
