"""The engine interface (runtime/engine.py): every engine class provides each of its members,
and one run class drives them all (issue 25: one run class over a small engine interface,
one clipping, one state-dict path). Pure: nothing is launched."""

import inspect

import pytest

from meshplan.runtime.engine import Engine


def _members() -> list[str]:
    methods = [n for n, v in vars(Engine).items()
               if inspect.isfunction(v) and not n.startswith("_")]
    return sorted({*Engine.__annotations__, *methods})


def _engine_classes():
    from meshplan.runtime.graph.parallelize import ParallelModel
    from meshplan.runtime.graph.pipeline import PipelineModel
    from meshplan.runtime.module_pipeline import PipelineModuleEngine
    from meshplan.runtime.modules import ModuleEngine
    return [ModuleEngine, PipelineModuleEngine, ParallelModel, PipelineModel]


def test_the_interface_is_small():
    assert set(_members()) == {"name", "plan", "device", "compute_grads", "forward", "train",
                               "optimizer_params", "tied_elsewhere", "state_tensors",
                               "sync_weights", "after_load"}


@pytest.mark.parametrize("cls", _engine_classes(), ids=lambda c: c.__name__)
def test_every_engine_class_provides_every_member(cls):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) and not fields else ""
    for name in _members():
        # attributes an instance sets in __init__ (plan, device) or a dataclass field
        present = hasattr(cls, name) or name in fields or f"self.{name} " in init or \
            f"self.{name}," in init or f", self.{name}" in init
        assert present, f"{cls.__name__} lacks {name} of runtime/engine.py's Engine"
    for name in ("compute_grads", "forward", "state_tensors", "after_load"):
        want = list(inspect.signature(getattr(Engine, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[:len(want)] == want, f"{cls.__name__}.{name}{got} is not Engine's {want}"
    assert cls.name in ("graph", "modules")


def test_one_run_class():
    import meshplan.runtime.run as run

    classes = [c for _, c in inspect.getmembers(run, inspect.isclass)
               if c.__module__ == run.__name__]
    assert [c.__name__ for c in classes] == ["ParallelRun"]
    assert run.ParallelRun.__subclasses__() == []


@pytest.mark.parametrize("max_norm,norm_type,word", [(0.0, 2.0, "max_norm"),
                                                      (1.0, 0.0, "norm_type"),
                                                      (1.0, float("nan"), "norm_type"),
                                                      (1.0, -1.0, "norm_type")])
def test_clipping_refuses_a_norm_it_cannot_clip_by(max_norm, norm_type, word):
    """Checked before any engine or collective is touched (a zero norm_type divided by zero)."""
    from meshplan.runtime.run import DataError, ParallelRun

    with pytest.raises(DataError, match=word):
        ParallelRun.clip_grad_norm_(object(), max_norm, norm_type)
