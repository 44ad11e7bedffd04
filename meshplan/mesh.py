"""Mesh: the devices a plan runs on, as an N-D grid, plus the hardware profile that prices them.

Axis 0 is the slowest (it crosses nodes on multi-node clusters); the last axis stays inside
a node. A mesh is plain data: planning for 1,024 devices needs no 1,024 processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from meshplan.costmodel.hardware import HardwareProfile, load_preset, preset_names, read_json
from meshplan.errors import MeshError

GPU_PRESETS = ("dgx-a100-80gb", "dgx-h100", "dgx-h200", "h100-96gb-hbm2e", "dgx-h800", "dgx-b200",
               "gb200-nvl72")


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    hardware: HardwareProfile
    axis_names: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self):
        if not self.shape or any(int(s) < 1 for s in self.shape):
            raise MeshError(f"mesh shape {self.shape} must be a non-empty tuple of positive ints")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.axis_names:
            object.__setattr__(self, "axis_names", tuple(f"d{i}" for i in range(len(self.shape))))
        if len(self.axis_names) != len(self.shape):
            raise MeshError(f"axis_names {self.axis_names} must name each of the "
                            f"{len(self.shape)} axes of shape {self.shape}")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> "Mesh":
        """A cluster of ``nodes`` identical nodes: shape (nodes, gpus_per_node), or (gpus,)."""
        if name not in GPU_PRESETS + ("cpu-local",):
            raise MeshError(f"unknown mesh preset {name!r}; valid presets: "
                            f"{', '.join(GPU_PRESETS + ('cpu-local',))}")
        nodes = _count(nodes, "nodes", f"Mesh.preset({name!r}, nodes={nodes!r})")
        hw = load_preset(name)
        per_node = hw.devices_per_node if name != "cpu-local" else 1
        if nodes == 1:
            return cls((per_node,), hw, ("gpu",), name=f"{name}:nodes=1")
        return cls((int(nodes), per_node), hw, ("node", "gpu"), name=f"{name}:nodes={nodes}")

    @classmethod
    def local(cls, n: int, *, profile: HardwareProfile | None = None) -> "Mesh":
        """``n`` CPU processes on this machine, priced by the latest calibration if any."""
        n = _count(n, "n", f"Mesh.local(n={n!r})")
        hw = profile or cached_calibration() or load_preset("cpu-local")
        return cls((int(n),), hw, ("proc",), name=f"local:{n}")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Mesh":
        """A cluster file: {"shape": [...], "axis_names": [...], "hardware": preset name or profile}."""
        return cls.from_dict(read_json(path, "cluster file"), origin=str(path))

    @classmethod
    def from_dict(cls, data: dict, *, origin: str = "mesh") -> "Mesh":
        if not isinstance(data, dict) or "shape" not in data or "hardware" not in data:
            raise MeshError(f"{origin}: a cluster needs 'shape' and 'hardware' (a preset name "
                            f"among {', '.join(preset_names())} or a full profile)")
        hw = data["hardware"]
        hardware = load_preset(hw) if isinstance(hw, str) else HardwareProfile.from_dict(hw)
        return cls(tuple(data["shape"]), hardware, tuple(data.get("axis_names", ())),
                   name=data.get("name", origin))

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "axis_names": list(self.axis_names),
                "devices_per_node": self.devices_per_node, "hardware": self.hardware.to_dict()}

    # -- facts -----------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def devices_per_node(self) -> int:
        return min(self.hardware.devices_per_node, self.num_devices)

    def axis_crosses_nodes(self, axis: int) -> bool:
        """True when the devices along ``axis`` sit on different nodes (row-major numbering)."""
        stride = 1
        for s in self.shape[axis + 1:]:
            stride *= s
        return stride * (self.shape[axis] - 1) >= self.devices_per_node or \
            stride >= self.devices_per_node

    def __repr__(self) -> str:
        return f"Mesh({self.name or 'custom'}, shape={self.shape}, hardware={self.hardware.name})"


def _count(value, name: str, call: str) -> int:
    """A positive whole number of nodes or processes (an int, or digits as a spec gives)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MeshError(f"{call}: {name} must be a positive whole number, e.g. {name}=8")
    return value


def calibration_cache_path() -> Path:
    """Where ``meshplan calibrate`` leaves this machine's profile for ``Mesh.local``:
    ``$MESHPLAN_CACHE_DIR/calibration.json`` where that is set (the test suite points it at
    an empty directory, so no developer's calibration changes its plans), else
    ``$XDG_CACHE_HOME/meshplan`` or ``~/.cache/meshplan``."""
    own = os.environ.get("MESHPLAN_CACHE_DIR")
    if own:
        return Path(own) / "calibration.json"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshplan" / "calibration.json"


def cached_calibration() -> HardwareProfile | None:
    path = calibration_cache_path()
    if not path.exists():
        return None
    try:
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, MeshError):
        return None
