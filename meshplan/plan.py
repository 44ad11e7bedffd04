"""The plan: versioned JSON (``meshplan.plan/v1``) that says how to run a model on a mesh.

trace -> cost -> solve -> **plan** -> run. A plan is data, never code: loading one executes
nothing. It is validated on load against ``plan.schema.json`` (shipped beside this module)
and against the rules a schema cannot state (placements match the stage mesh, devices exist).
The same inputs give a byte-identical file; files are written atomically.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from meshplan.errors import PlanFileError
from meshplan.placements import shard_dim
from meshplan.schedules import SCHEDULES, Schedule
from meshplan.schema import validate_schema
from meshplan.support import export_problems
from meshplan.vocabulary import RECOMPUTE, BatchNormStats, ComputeDtype, Engine, Recompute, plain

SCHEMA_VERSION = "meshplan.plan/v1"


def _hold_plain(record, *names: str) -> None:
    """Records hold the plan file's plain strings: a vocabulary member passed in (a StrEnum
    of meshplan/vocabulary.py or schedules.py) is stored as its value, so a record made in
    code pickles, ``torch.save``s and loads with ``weights_only=True`` like one read from a
    file."""
    for name in names:
        object.__setattr__(record, name, plain(getattr(record, name)))


# -- records ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Per-device memory in GiB."""

    params_gib: float = 0.0
    grads_gib: float = 0.0
    optimizer_gib: float = 0.0
    activations_gib: float = 0.0
    buffers_gib: float = 0.0  # collective and temporary buffers

    @property
    def total_gib(self) -> float:
        return (self.params_gib + self.grads_gib + self.optimizer_gib + self.activations_gib
                + self.buffers_gib)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted cost of one training step (one global batch)."""

    step_time_s: float
    peak_memory_gib: float  # per device, the largest over devices
    memory_capacity_gib: float
    fits: bool
    mfu: float  # model FLOPs (no recompute) / (step time x devices x peak)
    tokens_per_s: float
    bubble_fraction: float = 0.0
    breakdown: dict = field(default_factory=dict)  # forward, backward, recompute, comm, bubble, optimizer (s)
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)  # of the peak device
    overflow: str = ""  # when fits is False: what overflows, in words


@dataclass(frozen=True, slots=True)
class OpPlacement:
    """Placements (one string per stage mesh axis) of an operator's inputs and output."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StagePrediction:
    compute_s: float = 0.0  # forward + backward (+ recompute) of one microbatch
    comm_s: float = 0.0  # exposed communication of one microbatch
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    devices: tuple[int, ...]  # global device ids, row-major in mesh_shape
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    layers: tuple[int, int]  # [first, last) layer indices; embedding/head are layer -1
    nodes: tuple[str, str]  # first and last operator of the stage, graph order
    recompute: str = Recompute.NONE
    zero: int = 0
    inputs: dict = field(default_factory=dict)  # graph input name -> placements
    params: dict = field(default_factory=dict)  # parameter name -> placements
    ops: dict = field(default_factory=dict)  # node name -> OpPlacement
    predicted: StagePrediction = field(default_factory=StagePrediction)
    # expert parallelism: the routed experts split over ``ep`` ranks borrowed from the
    # stage's dp x cp x tp ranks (torchtitan's layout; it adds no devices); 1 = replicated
    ep: int = 1

    def __post_init__(self):
        _hold_plain(self, "recompute")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    fingerprint: str
    param_count: int
    train_flops_per_step: int  # forward + backward, no recompute, one global batch
    num_layers: int
    num_nodes: int
    # the call the plan was made for: {name, role (arg | kwarg | target), key, shape, dtype}
    # per flat graph input, global shapes (planner/assemble.input_records)
    inputs: tuple = ()
    # the model spec the plan was made from on the command line ("transformers:gpt2?...",
    # "file.py:factory"); "" for a plan made from a Python object. Commands that need the
    # model (show/explain/report/estimate/run) default to it.
    spec: str = ""
    # a config-file spec (path/config.json): the file's sha256 (hex) when the plan was made;
    # ``meshplan run`` refuses the plan when the file has changed since. "" for other specs.
    spec_sha256: str = ""
    # the loss the graph was traced with (tracing.loss_label: "torch.nn.functional.
    # cross_entropy", "my_loss", meshplan's default); "" in plans written before it was
    # recorded. A run whose loss differs is refused with both named.
    loss: str = ""
    # a file spec's file (factory or config), absolute with links resolved, as it was when
    # the plan was written: where a plan copied away from its file still finds it ("" else)
    spec_file: str = ""


@dataclass(frozen=True, slots=True)
class MeshInfo:
    name: str
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices_per_node: int
    hardware: dict  # the full HardwareProfile, so a plan is priced the same way anywhere


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    global_batch: int
    seq_len: int
    microbatches: int = 1
    microbatch_size: int = 0  # sequences per microbatch per data-parallel rank
    # fp32 | bf16 | fp16 (mixed precision with fp32 master weights) | fp8 (fp8 GEMMs, bf16
    # elsewhere: estimation and export only, meshplan/support.py); vocabulary.ComputeDtype
    dtype: str = ComputeDtype.FP32
    optimizer: str = "adam"
    schedule: str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    sequence_parallel: bool = False
    # the repeated blocks run under torch.compile (parallelize(..., compile=True) on the
    # module engine, torchtitan's compile.enable): priced so (costmodel/fusion.py)
    compiled: bool = False
    # the rows a BatchNorm normalises together (vocabulary.BatchNormStats): "batch", the
    # global batch (one microbatch), or "microbatch", each microbatch (the user's opt-in)
    batch_norm: str = BatchNormStats.BATCH
    # under dtype "fp8": the scaling recipe priced (costmodel/fp8.py PUBLIC_RECIPES:
    # "tensorwise", "tensorwise-fp8-all-gather", "rowwise"); "" (and absent in files
    # written before it): the recipe of the engine the plan is priced for
    fp8_recipe: str = ""

    def __post_init__(self):
        _hold_plain(self, "dtype", "schedule", "batch_norm")


@dataclass(frozen=True, slots=True)
class SolverInfo:
    name: str
    status: str
    gap: float = 0.0
    time_s: float = 0.0  # deterministic solver time (CP-SAT deterministic_time); 0 without search
    objective_s: float = 0.0
    notes: tuple[str, ...] = ()  # e.g. operators that fell back to replication
    # the simplest plan within this fraction of the fastest was kept (planner/simplest.py):
    # the cost model's measured error on this kind of machine; 0: the fastest plan, as is
    margin: float = 0.0
    runner_up: str = ""  # the faster, more elaborate plan the kept one beat, if any


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    mesh: MeshInfo
    training: TrainingConfig
    stages: tuple[Stage, ...]
    predicted: Estimate
    solver: SolverInfo
    schema: str = SCHEMA_VERSION
    # which runtime executes it: "modules" (PyTorch's composables: parallelize_module,
    # fully_shard, checkpoint wrappers; runtime/modules.py) where the plan is expressible
    # in them, else "graph" (the exported graph on DTensor; runtime/graph/parallelize.py);
    # a stack the cost model prices (costmodel/runtime_profiles.STACKS: "megatron",
    # "megatron-2021", "nemo", "torchtitan"): a plan made for that stack (plan --for, or
    # --manual --engine STACK), priced as it runs it, run there after `meshplan export`
    # (meshplan/stacks/; EXPORT_TARGET), refused by meshplan's runtimes (support.stack_refusal)
    engine: str = Engine.GRAPH
    engine_note: str = ""  # why the graph engine runs it, when the module engine cannot
    # Not written to the file: the traced graph the plan was made from (for estimate/explain)
    # and the wall-clock planning time (the file records the solver's deterministic time so
    # that the same inputs give the same bytes).
    graph: object = field(default=None, compare=False, repr=False)
    wall_time_s: float = field(default=0.0, compare=False)

    def __post_init__(self):
        _hold_plain(self, "engine")

    # -- convenience -----------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh.shape:
            n *= s
        return n

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def with_prediction(self, estimate: Estimate) -> "Plan":
        return replace(self, predicted=estimate)

    def summary(self) -> str:
        # local: meshplan/inspect.py loads rich (tables), which `import meshplan` does not
        from meshplan.inspect import summary_text

        return summary_text(self)

    def check_model(self, fingerprint: str, loss: str | None = None) -> None:
        """Refuse to run on a model other than the one this plan was made for; with the
        ``loss`` a graph was traced with, a different loss is named as the difference."""
        if fingerprint != self.model.fingerprint and loss is not None and self.model.loss \
                and loss != self.model.loss:
            raise PlanFileError(
                f"plan for {self.model.name} was made with the loss {self.model.loss}, but "
                f"this run's loss is {loss} (its operators differ: fingerprint "
                f"{fingerprint}, the plan's {self.model.fingerprint}); pass the plan's "
                f"loss_fn, or make a new plan with this one (meshplan plan ...)")
        if fingerprint != self.model.fingerprint:
            raise PlanFileError(
                f"plan was made for model {self.model.name} with fingerprint "
                f"{self.model.fingerprint}, but this model (with these input shapes) has "
                f"{fingerprint}; make a new plan for this model (meshplan plan ...)")

    def with_spec(self, spec: str, sha256: str | None = None) -> "Plan":
        """This plan, recording the model spec it was made from (and, for a config file,
        its sha256; None keeps the recorded one)."""
        sha = self.model.spec_sha256 if sha256 is None else sha256
        return replace(self, model=replace(self.model, spec=spec, spec_sha256=sha))

    def check_param_ranks(self, ndims: dict[str, int]) -> None:
        """Every planned parameter placement against its tensor's number of dims
        (``ndims``: parameter name -> ndim; names it lacks are not checked)."""
        for stage in self.stages:
            for name, placements in stage.params.items():
                if name in ndims:
                    check_placements(placements, ndims[name],
                                     f"stage {stage.index} parameter {name}")

    def check_graph(self, graph) -> None:
        """``check_model`` on ``graph``'s fingerprint, then every planned placement against
        the tensor it places: a hand-edited "S(7)" on a 2-D weight is refused here, with the
        tensor named, not at step 1 inside DTensor. ``graph`` is the model's OpGraph."""
        self.check_model(graph.fingerprint, getattr(graph, "loss", None))
        self.check_param_ranks({n: len(i.shape) for n, i in graph.param_map.items()})
        for stage in self.stages:
            for name, op in stage.ops.items():
                node = graph.node(name) if name in graph else None
                if node is not None and node.outputs:
                    check_placements(op.output, len(node.outputs[0].shape),
                                     f"stage {stage.index} operator {name} output")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"schema": self.schema}
        for f in fields(self):
            if f.name not in _NOT_SERIALIZED:
                out[f.name] = _as_data(getattr(self, f.name))
        if not self.training.fp8_recipe:  # written only where it says something
            out["training"].pop("fp8_recipe")
        for st in out["stages"]:
            if st.get("ep") == 1:
                st.pop("ep")
        return json.loads(json.dumps(out))  # JSON-native: tuples become lists

    def to_json_text(self) -> str:
        return _dumps(self.to_dict())

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path``; a factory or config file the spec names (as typed,
        relative to the working directory, or absolute) is recorded relative to the plan's
        folder, where ``from_json`` looks for it, whichever command writes the file."""
        spec = spec_for_plan_folder(self.model.spec, os.path.dirname(os.path.abspath(path)))
        parts = _file_spec(self.model.spec)
        where = os.path.realpath(parts[0]) if parts else ""
        plan = self if spec == self.model.spec and where == self.model.spec_file else \
            replace(self, model=replace(self.model, spec=spec, spec_file=where))
        atomic_write(path, plan.to_json_text())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Plan":
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise PlanFileError(f"plan file {path} does not exist") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
            raise PlanFileError(f"cannot read plan file {path}: {exc}") from None
        plan = cls.from_json_text(text, origin=str(path))
        spec = spec_from_plan_folder(plan.model.spec, os.path.dirname(os.path.abspath(path)),
                                     plan.model.spec_file)
        return plan.with_spec(spec) if spec != plan.model.spec else plan

    @classmethod
    def from_json_text(cls, text: str, *, origin: str = "plan") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"{origin} is not valid JSON ({exc.msg} at line {exc.lineno}, "
                                f"column {exc.colno}); the file is truncated or corrupt") from None
        return cls.from_dict(data, origin=origin)

    @classmethod
    def from_dict(cls, data: dict, *, origin: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanFileError(f"{origin}: a plan is a JSON object, got {type(data).__name__}")
        version = data.get("schema")
        if version != SCHEMA_VERSION:
            raise PlanFileError(f"{origin} has schema {version!r}; this meshplan reads "
                                f"{SCHEMA_VERSION!r} only. Re-plan with this version.")
        problems = validate_schema(data, plan_schema())
        if problems:
            raise PlanFileError(f"{origin} does not match {SCHEMA_VERSION}: {problems[0]}"
                                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        plan = _plan_from_dict(data)
        problems = check_consistency(plan)
        if problems:
            raise PlanFileError(f"{origin} is inconsistent: {problems[0]}")
        problems = export_problems(plan)
        if problems:
            raise PlanFileError(f"{origin} cannot run: {problems[0]}")
        return plan


_NOT_SERIALIZED = ("schema", "graph", "wall_time_s")


def _as_data(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, tuple):
        return [_as_data(v) for v in value]
    return value


def _plan_from_dict(d: dict) -> Plan:
    def mem(m):
        return MemoryBreakdown(**m)

    def est(e):
        e = dict(e)
        e["memory"] = mem(e.get("memory", {}))
        return Estimate(**e)

    stages = []
    for s in d["stages"]:
        s = dict(s)
        s["devices"] = tuple(s["devices"])
        s["mesh_shape"] = tuple(s["mesh_shape"])
        s["axis_names"] = tuple(s["axis_names"])
        s["layers"] = tuple(s["layers"])
        s["nodes"] = tuple(s["nodes"])
        s["inputs"] = {k: tuple(v) for k, v in s["inputs"].items()}
        s["params"] = {k: tuple(v) for k, v in s["params"].items()}
        s["ops"] = {k: OpPlacement(inputs=tuple(tuple(i) for i in v["inputs"]),
                                   output=tuple(v["output"])) for k, v in s["ops"].items()}
        p = dict(s["predicted"])
        p["memory"] = mem(p["memory"])
        s["predicted"] = StagePrediction(**p)
        stages.append(Stage(**s))
    mesh = dict(d["mesh"])
    mesh["shape"] = tuple(mesh["shape"])
    mesh["axis_names"] = tuple(mesh["axis_names"])
    solver = dict(d["solver"])
    solver["notes"] = tuple(solver.get("notes", ()))
    model = dict(d["model"])
    model["inputs"] = tuple(dict(r) for r in model.get("inputs", ()))
    return Plan(model=ModelInfo(**model), mesh=MeshInfo(**mesh),
                training=TrainingConfig(**d["training"]), stages=tuple(stages),
                predicted=est(d["predicted"]), solver=SolverInfo(**solver), schema=d["schema"],
                engine=d.get("engine", "graph"), engine_note=d.get("engine_note", ""))


def check_consistency(plan: Plan) -> list[str]:
    """Rules beyond the schema: placements fit the stage mesh, devices exist and add up."""
    problems = []
    n = plan.num_devices
    for st in plan.stages:
        ndim = len(st.mesh_shape)
        size = 1
        for s in st.mesh_shape:
            size *= s
        if size != len(st.devices):
            problems.append(f"stage {st.index}: mesh_shape {list(st.mesh_shape)} has {size} "
                            f"devices but {len(st.devices)} are listed")
        if any(d < 0 or d >= n for d in st.devices):
            problems.append(f"stage {st.index}: device ids must lie in [0, {n}) for mesh "
                            f"{list(plan.mesh.shape)}")
        if len(st.axis_names) != ndim:
            problems.append(f"stage {st.index}: {len(st.axis_names)} axis names for {ndim} axes")
        borrowed = 1
        for name, deg in zip(st.axis_names, st.mesh_shape):
            if name in ("dp", "cp", "tp"):
                borrowed *= deg
        if st.ep < 1 or borrowed % st.ep:
            problems.append(f"stage {st.index}: ep={st.ep} must divide the stage's dp x cp x tp "
                            f"= {borrowed} (experts are split over ranks the stage already has)")
        if st.recompute not in RECOMPUTE:
            problems.append(f"stage {st.index}: recompute {st.recompute!r} not in {RECOMPUTE}")
        for kind, table in (("parameter", st.params), ("input", st.inputs)):
            for name, pl in table.items():
                if len(pl) != ndim:
                    problems.append(f"stage {st.index}: {kind} {name} has {len(pl)} placements "
                                    f"for a {ndim}-D stage mesh")
        for name, op in st.ops.items():
            for pl in (op.output, *op.inputs):
                if pl and len(pl) != ndim:
                    problems.append(f"stage {st.index}: operator {name} has placements {list(pl)} "
                                    f"for a {ndim}-D stage mesh")
                    break
    if plan.training.schedule not in SCHEDULES:
        problems.append(f"schedule {plan.training.schedule!r} not in {SCHEDULES}")
    used = sorted({d for st in plan.stages for d in st.devices})
    if used and used != list(range(n)) and plan.stages:
        problems.append(f"stages use devices {used[:8]}... but the mesh has {n}; every device "
                        "must belong to a stage")
    return problems


# -- JSON text -------------------------------------------------------------------------------

def _dumps(obj) -> str:
    """Indented JSON with short lists of scalars kept on one line (placements stay readable)."""
    text = json.dumps(obj, indent=1, sort_keys=False, ensure_ascii=True, allow_nan=False)
    collapse = re.compile(r"\[\s*((?:(?:\"[^\"\n]*\"|-?[\d.eE+-]+|true|false|null),?\s*){1,16})\]")

    def inline(m: re.Match) -> str:
        items = [x.strip() for x in m.group(1).split("\n") if x.strip()]
        return "[" + " ".join(items) + "]"
    text = collapse.sub(inline, text)
    # placements inside op records: [["R"], ["S(0)"]] on one line as well
    text = re.sub(r"\[\s*(\[[^\[\]\n]*\](?:,\s*\[[^\[\]\n]*\])*)\s*\]",
                  lambda m: "[" + re.sub(r",\s*", ", ", m.group(1)) + "]", text)
    return text + "\n"


def _file_spec(spec: str) -> tuple[str, str] | None:
    """(path, rest) of a model spec that names a file: ``path/file.py:factory`` (rest
    ``:factory``) or a Hugging Face ``path/config.json`` (rest ""); None for other specs."""
    if spec.endswith(".json") and not spec.startswith("transformers:"):
        return spec, ""
    path, sep, factory = spec.rpartition(":")
    return (path, f":{factory}") if sep and path.endswith(".py") else None


def spec_for_plan_folder(spec: str, folder: str) -> str:
    """A file spec as a plan file in ``folder`` records it: the file's path relative to
    that folder (so the plan runs from any working directory, and moves with its file),
    both sides with symbolic links resolved (a folder reached through a link and read back
    from its real path finds the same file); other specs unchanged."""
    parts = _file_spec(spec)
    if parts is None:
        return spec
    path = os.path.relpath(os.path.realpath(parts[0]), os.path.realpath(folder))
    return f"{Path(path).as_posix()}{parts[1]}"


def spec_from_plan_folder(spec: str, folder: str, recorded: str = "") -> str:
    """The inverse of ``spec_for_plan_folder`` for a plan read from ``folder``: a relative
    path resolved against that folder's real path (absolute), where the file is. Where
    nothing is there (a plan copied away from its file), the absolute path ``recorded`` when
    the plan was written; then (a plan written before paths were stored this way, relative
    to where it was made) the path as typed from the working directory."""
    parts = _file_spec(spec)
    if parts is None or os.path.isabs(parts[0]):
        return spec
    for base in (os.path.realpath(folder), os.path.abspath(folder)):
        beside = os.path.normpath(os.path.join(base, parts[0]))
        if os.path.exists(beside):
            return f"{beside}{parts[1]}"
    if recorded and os.path.exists(recorded):
        return f"{recorded}{parts[1]}"
    if os.path.exists(parts[0]):
        return f"{os.path.abspath(parts[0])}{parts[1]}"
    return f"{os.path.normpath(os.path.join(os.path.realpath(folder), parts[0]))}{parts[1]}"


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never half of one."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise PlanFileError(f"cannot write {path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    except OSError as exc:
        raise PlanFileError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- schema validation -------------------------------------------------------------------------

def plan_schema() -> dict:
    return json.loads(resources.files("meshplan").joinpath("plan.schema.json").read_text())


def check_placements(placements, ndim: int, what: str) -> None:
    """Every "S(d)" of ``placements`` names a dim of an ``ndim``-dim tensor."""
    for axis, text in enumerate(placements):
        dim = shard_dim(text)
        if dim is not None and not -ndim <= dim < ndim:
            raise PlanFileError(f"{what} is placed {text} on mesh axis {axis}, but it has "
                                f"{ndim} dims; shard a dim in 0..{ndim - 1} or use R")
