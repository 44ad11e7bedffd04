"""Hardware profiles: what one device computes and how fast the links between devices are.

trace -> **cost** -> solve -> run. A profile is plain data (JSON). Its schema ships beside
this module (``hardware.schema.json``, the same text as docs/hardware.schema.json) and every
profile is validated against it on load. Presets ship in ``presets/`` with the source of
every number beside it; ``meshplan calibrate`` writes the same format from measurements
(meshplan/calibrate.py), with its fit residuals under ``fitted``.

Fields the first presets lacked all have defaults, so older profiles still load:
``device.host_cores`` (CPU processes of one host share these cores; 0 = dedicated devices),
``device.framework_overhead_s`` (per-operator cost of the executing framework on top of the
kernel, e.g. DTensor dispatch), ``device.effective_cores`` (the cores N CPU processes
effectively share, fitted from runs of the runtime; 0 = ``host_cores``), ``LinkSpec.collectives`` (per-collective overrides of the
link's bandwidth and latency), ``measured_ops`` (operator signature -> measured time) and
``device.attention_efficiency`` (fused attention's fraction of peak against one query row's
FLOPs, ``compute.attention_work``; absent: as GEMMs) and
``device.fp8_gemm_efficiency`` (fp8 GEMMs by scaling, of ``peak_tflops.float8``) and
``device.memory_paths`` (eager elementwise kernels by path, a fraction of the contiguous
streaming rate: costmodel/kernel_paths.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

from meshplan.errors import MeshError
from meshplan.schema import validate_schema

# the paths an eager kernel takes (costmodel/kernel_paths.py), the elementwise ones slowest
# first: the keys of ``device.memory_paths``, each the measured fraction of the contiguous rate
CONTIGUOUS, STRIDED, UPCAST, BROADCAST, MIXED_DTYPE = \
    "contiguous", "strided", "upcast", "broadcast", "mixed_dtype"
REDUCTION, SLICE_BACKWARD = "reduction", "slice_backward"
PATHS = (CONTIGUOUS, STRIDED, UPCAST, BROADCAST, MIXED_DTYPE, REDUCTION, SLICE_BACKWARD)


@dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Fraction of peak reached by a kernel of a given size: ``max_eff * w / (w + half_w)``.

    ``w`` is the work of one kernel (FLOPs for matmuls, bytes for memory-bound ops; for
    fused attention the FLOPs of one query row of one head, ``compute.attention_work``); a
    kernel of ``half_w`` reaches half of ``max_eff``. Small kernels do not reach peak.
    """

    max_eff: float
    half_work: float

    def __call__(self, work: float) -> float:
        return self.max_eff * work / (work + self.half_work) if work > 0 else self.max_eff


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    peak_tflops: dict  # dtype name -> dense TFLOP/s
    memory_gib: float
    memory_bandwidth_gbps: float  # GB/s
    matmul_efficiency: EfficiencyCurve
    memory_efficiency: EfficiencyCurve
    kernel_latency_s: float  # fixed cost per launched operator
    host_cores: int = 0  # CPU processes share this many cores; 0: every device is its own
    framework_overhead_s: float = 0.0  # per-operator cost of the executing framework
    effective_cores: float = 0.0  # fitted cores N processes share (0: host_cores)
    # fused attention (flash attention) kernels reach less of peak than GEMMs; None: as GEMMs
    attention_efficiency: EfficiencyCurve | None = None
    # fused attention by kernel ("fa2", "fa3", "cudnn"): the curve of the kernel a runtime
    # names (RuntimeModel.attention_kernel); a kernel not listed runs attention_efficiency
    attention_kernels: dict = field(default_factory=dict)
    # fp8 GEMMs by scaling ("tensorwise", "rowwise"): fraction of peak_tflops["float8"]
    # (costmodel/fp8.py); empty: the device prices no fp8 GEMMs
    fp8_gemm_efficiency: dict = field(default_factory=dict)
    # eager elementwise kernels by path (costmodel/kernel_paths.py PATHS: "mixed_dtype",
    # "broadcast", "upcast", "strided", "reduction", "slice_backward"): bandwidth reached as
    # a fraction of the contiguous same-dtype kernel's (memory_efficiency); a path not
    # listed streams at the contiguous rate
    memory_paths: dict = field(default_factory=dict)
    # fraction by which compute slows while a collective runs beside it on the same device
    # (NCCL's kernels take SMs, memory bandwidth and power): each second of communication an
    # engine hides behind compute adds this much compute time (costmodel/estimate.py)
    overlap_slowdown: float = 0.0

    def memory_path_ratio(self, path: str) -> float:
        """Fraction of the contiguous streaming rate an eager kernel on ``path`` reaches."""
        return float(self.memory_paths.get(path, 1.0))

    def with_attention_kernel(self, kernel: str) -> "DeviceSpec":
        """This device pricing fused attention on ``kernel``'s curve, where it lists one."""
        curve = self.attention_kernels.get(kernel) if kernel else None
        return replace(self, attention_efficiency=curve) if curve is not None else self

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12
        return self.peak_tflops.get("float32", min(self.peak_tflops.values())) * 1e12


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link level. ``bandwidth_gbps``: GB/s per device per direction (bus bandwidth).

    ``collectives`` optionally overrides bandwidth and latency per collective kind, e.g.
    ``{"all_reduce": {"bandwidth_gbps": 230.0, "latency_s": 2e-05}}`` (a calibration fits
    each collective separately).
    """

    name: str
    bandwidth_gbps: float
    latency_s: float
    collectives: dict = field(default_factory=dict)

    def for_collective(self, kind: str) -> tuple[float, float]:
        """(bandwidth GB/s, latency s) of this link for one collective kind."""
        over = self.collectives.get(str(kind), {})
        return (float(over.get("bandwidth_gbps", self.bandwidth_gbps)),
                float(over.get("latency_s", self.latency_s)))


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    devices_per_node: int
    sources: dict = field(default_factory=dict)  # field path -> where the number comes from
    description: str = ""
    fitted: dict = field(default_factory=dict)  # calibration residuals, when measured
    measured_ops: dict = field(default_factory=dict)  # op signature -> [forward_s, backward_s]

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["device"].get("attention_efficiency") is None:  # optional: absent, not null
            d["device"].pop("attention_efficiency", None)
        for key in ("attention_kernels", "fp8_gemm_efficiency", "memory_paths"):  # optional
            if not d["device"].get(key):
                d["device"].pop(key, None)
        return d

    @classmethod
    def from_dict(cls, d: dict, *, origin: str = "hardware profile") -> "HardwareProfile":
        problems = validate_profile(d)
        if problems:
            raise MeshError(f"{origin} does not match docs/hardware.schema.json: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                            + "; fix the field or re-run `meshplan calibrate`")
        dev = dict(d["device"])
        dev["matmul_efficiency"] = EfficiencyCurve(**dev["matmul_efficiency"])
        dev["memory_efficiency"] = EfficiencyCurve(**dev["memory_efficiency"])
        if dev.get("attention_efficiency") is not None:
            dev["attention_efficiency"] = EfficiencyCurve(**dev["attention_efficiency"])
        dev["attention_kernels"] = {k: EfficiencyCurve(**v)
                                    for k, v in dev.get("attention_kernels", {}).items()}
        dev["fp8_gemm_efficiency"] = {k: EfficiencyCurve(**v)
                                      for k, v in dev.get("fp8_gemm_efficiency", {}).items()}
        return cls(
            name=d["name"], device=DeviceSpec(**dev),
            intra_node=LinkSpec(**d["intra_node"]), inter_node=LinkSpec(**d["inter_node"]),
            devices_per_node=int(d["devices_per_node"]), sources=dict(d.get("sources", {})),
            description=d.get("description", ""), fitted=dict(d.get("fitted", {})),
            measured_ops=dict(d.get("measured_ops", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def hardware_schema() -> dict:
    text = resources.files("meshplan.costmodel").joinpath("hardware.schema.json").read_text()
    return json.loads(text)


# An attention curve is read at one query row's FLOPs (compute.attention_work): 4 x keys x
# head dim, 1.07e9 at a million keys of head dim 256. A half_work above it is in the
# kernel-FLOPs units of the curves before DECISIONS 102 (8e9), which would price attention at
# under 0.1% of peak.
MAX_ATTENTION_HALF_WORK = 4 * 2 ** 20 * 256


def validate_profile(d) -> list[str]:
    """Problems of a profile dict against the schema (empty when it is valid)."""
    if not isinstance(d, dict):
        return [f"a profile is a JSON object, got {type(d).__name__}"]
    problems = validate_schema(d, hardware_schema())
    if not problems:
        dev = d["device"]
        for key in ("matmul_efficiency", "memory_efficiency", "attention_efficiency"):
            if key in dev and not 0 < dev[key]["max_eff"] <= 1:
                problems.append(f"$.device.{key}.max_eff is {dev[key]['max_eff']}; it is a "
                                "fraction of peak in (0, 1]")
        attention = ([("attention_efficiency", dev["attention_efficiency"])]
                     if "attention_efficiency" in dev else []) + \
            [(f"attention_kernels.{k}", c) for k, c in dev.get("attention_kernels", {}).items()]
        for key, curve in attention:
            if curve["half_work"] > MAX_ATTENTION_HALF_WORK:
                problems.append(
                    f"$.device.{key}.half_work is {curve['half_work']:g}; attention curves are "
                    "read at one query row's FLOPs (4 x keys x head dim <= "
                    f"{MAX_ATTENTION_HALF_WORK:g}), not the kernel's (DECISIONS 102): take the "
                    "preset's curve or refit it (python benchmarks/gpu_check.py fit)")
        known = [p for p in PATHS if p != CONTIGUOUS]
        for path, ratio in dev.get("memory_paths", {}).items():
            if path not in known:
                problems.append(f"$.device.memory_paths.{path} is not a path meshplan prices; "
                                f"use one of {', '.join(known)}")
            elif not 0 < ratio <= 1:
                problems.append(f"$.device.memory_paths.{path} is {ratio}; it is a fraction "
                                "of the contiguous rate in (0, 1]")
        if not dev["peak_tflops"]:
            problems.append("$.device.peak_tflops is empty; give at least float32")
    return problems


def preset_names() -> tuple[str, ...]:
    files = resources.files("meshplan.costmodel").joinpath("presets").iterdir()
    return tuple(sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json")))


def load_preset(name: str) -> HardwareProfile:
    if name not in preset_names():
        raise MeshError(f"unknown hardware preset {name!r}; valid presets: "
                        f"{', '.join(preset_names())}")
    text = resources.files("meshplan.costmodel").joinpath("presets", f"{name}.json").read_text()
    return HardwareProfile.from_dict(json.loads(text), origin=f"preset {name}")


def read_json(path, what: str):
    """The JSON in ``path``; a missing or malformed file is a MeshError naming ``what``."""
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MeshError(f"{what} {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise MeshError(f"{what} {path} is not valid JSON: {exc}") from None


def load_profile(path) -> HardwareProfile:
    """A profile JSON file (e.g. written by ``meshplan calibrate -o``)."""
    return HardwareProfile.from_dict(read_json(path, "hardware profile"), origin=str(path))


# the profile fields a calibration measures (on CUDA; a CPU calibration also measures its
# peak, bandwidth and cores); the others keep the starting preset's value and source
MEASURED = ("device.name", "device.memory_gib", "device.matmul_efficiency",
            "device.memory_efficiency", "device.kernel_latency_s", "device.framework_overhead_s",
            "intra_node", "inter_node")
MEASURED_ON_CPU = MEASURED + ("device.peak_tflops", "device.memory_bandwidth_gbps",
                              "device.host_cores")


def calibrated_sources(preset_sources: dict, preset: str, where: str, measured) -> dict:
    """Sources of a calibrated profile: ``where`` for what it measured ("*"), and for every
    field it kept from ``preset`` (overlap slowdown, attention curves, eager paths...) that
    preset's source, so a kept constant is not labelled as measured."""
    out = {"*": where}
    for key, text in preset_sources.items():
        if not any(key == m or key.startswith(m + ".") for m in measured):
            out[key] = f"not measured by calibrate, kept from the {preset} preset: {text}"
    return out
