"""Hardware profiles: what one device computes and how fast the links between devices are.

trace -> **cost** -> solve -> run. A profile is plain data (JSON, schema in
docs/hardware.schema.json); presets ship in ``presets/`` with the source of every number
beside it, and ``meshplan calibrate`` writes the same format from measurements.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

from meshplan.errors import MeshError


@dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Fraction of peak reached by a kernel of a given size: ``max_eff * w / (w + half_w)``.

    ``w`` is the work of one kernel (FLOPs for matmuls, bytes for memory-bound ops); a
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

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12
        return self.peak_tflops.get("float32", min(self.peak_tflops.values())) * 1e12


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link level. ``bandwidth_gbps``: GB/s per device per direction (bus bandwidth)."""

    name: str
    bandwidth_gbps: float
    latency_s: float


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        try:
            dev = dict(d["device"])
            dev["matmul_efficiency"] = EfficiencyCurve(**dev["matmul_efficiency"])
            dev["memory_efficiency"] = EfficiencyCurve(**dev["memory_efficiency"])
            return cls(
                name=d["name"], device=DeviceSpec(**dev),
                intra_node=LinkSpec(**d["intra_node"]), inter_node=LinkSpec(**d["inter_node"]),
                devices_per_node=int(d["devices_per_node"]), sources=dict(d.get("sources", {})),
                description=d.get("description", ""), fitted=dict(d.get("fitted", {})),
            )
        except (KeyError, TypeError) as exc:
            raise MeshError(f"hardware profile is malformed: {exc!r}; see "
                            "docs/hardware.schema.json for the fields") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def preset_names() -> tuple[str, ...]:
    files = resources.files("meshplan.costmodel").joinpath("presets").iterdir()
    return tuple(sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json")))


def load_preset(name: str) -> HardwareProfile:
    if name not in preset_names():
        raise MeshError(f"unknown hardware preset {name!r}; valid presets: "
                        f"{', '.join(preset_names())}")
    text = resources.files("meshplan.costmodel").joinpath("presets", f"{name}.json").read_text()
    return HardwareProfile.from_dict(json.loads(text))
