"""One vocabulary (issue 28): placements, schedules, recompute modes, engines and dtypes are
each defined once in core, as types with their parsing and printing, and the code outside
those homes names them by the types (string literals only in the homes; the JSON boundary
reads and writes the same strings, so plan files do not change)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from meshplan.errors import PlanningError
from meshplan.placements import (PARTIAL, REPLICATE, is_shard, parse_placement, placement_str,
                                 shard, shard_dim)
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for
from meshplan.vocabulary import (DTYPES, ENGINE_DTYPES, ENGINES, PRICED_ONLY_DTYPES, RECOMPUTE,
                                 TRAINED_DTYPES, ComputeDtype, Engine, Recompute)

ROOT = Path(__file__).resolve().parent.parent


def test_members_are_their_plan_strings():
    # a member equals, formats, reprs and serializes as its string: records holding a member
    # write the same JSON and the same error messages as records holding the string
    for member in (Schedule.INTERLEAVED, Recompute.SELECTIVE, Engine.MODULES, ComputeDtype.BF16):
        text = member.value
        assert member == text and hash(member) == hash(text)
        assert f"{member}" == text and repr(member) == repr(text)
        assert json.dumps({"k": member}) == json.dumps({"k": text})
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b")
    assert RECOMPUTE == ("none", "selective", "full")
    assert ENGINES == ("graph", "modules")
    assert DTYPES == ("fp32", "bf16", "fp16", "fp8")


def test_dtype_sets_say_which_runtime_trains_what():
    assert set(TRAINED_DTYPES) == set(ENGINE_DTYPES[Engine.GRAPH]) == {"fp32", "bf16", "fp16"}
    assert set(ENGINE_DTYPES[Engine.MODULES]) == {"fp32", "bf16"}  # no loss scaling
    assert PRICED_ONLY_DTYPES == (ComputeDtype.FP8,)
    assert not set(TRAINED_DTYPES) & set(PRICED_ONLY_DTYPES)


def test_schedule_parse_and_virtual_stages():
    assert Schedule.parse("1f1b") is Schedule.ONE_F_ONE_B
    with pytest.raises(PlanningError, match="schedule='zb'; choose one of gpipe, 1f1b, "
                                            "interleaved-1f1b"):
        Schedule.parse("zb")
    assert virtual_stages_for("interleaved-1f1b", 3) == 3
    assert virtual_stages_for(Schedule.ONE_F_ONE_B, 3) == 1
    assert virtual_stages_for("gpipe", 1) == 1


def test_placement_print_and_parse_round_trip():
    for text in (REPLICATE, PARTIAL, shard(0), shard(3)):
        kind, dim = parse_placement(text)
        assert (kind == "S") == is_shard(text) == (dim is not None)
        assert shard_dim(text) == dim
    assert (REPLICATE, PARTIAL, shard(2)) == ("R", "P", "S(2)")
    assert placement_str((-1, 0, -2)) == (REPLICATE, shard(0), PARTIAL)


def test_no_vocabulary_literal_outside_its_homes():
    """tools/vocabulary_counts.py over the packages: no placement, schedule, recompute,
    engine or dtype string literal outside meshplan/placements.py, meshplan/schedules.py and
    meshplan/vocabulary.py (before: "S(0)" 22 times in 10 files, "R" 55 in 14, ...), except
    the plan file's own field name "graph" and its default engine on read; each set defined
    once; no hand-built "S(d)"; no copy of "virtual stages if interleaved, else 1"."""
    sys.path.insert(0, str(ROOT / "tools"))
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        import vocabulary_counts as vc

        c = vc.count(vc.PACKAGES)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(ROOT / "tools"))
    allowed = {"graph": {"meshplan/plan.py"}}  # _NOT_SERIALIZED's field; Plan.from_dict's default
    stray = {lit: sorted(c["where"][lit]) for lit in vc.LITERALS
             if set(map(str, c["where"][lit])) - allowed.get(lit, set())}
    assert not stray, ("use meshplan.placements (REPLICATE, PARTIAL, shard), "
                       f"meshplan.schedules.Schedule or meshplan.vocabulary instead: {stray}")
    twice = {name: places for name, places in c["defined"].items() if len(places) > 1}
    assert not twice, f"defined more than once: {twice}"
    assert not c["shard_fstrings"], f"use placements.shard(d): {c['shard_fstrings']}"
    assert not c["local_constants"], f"use placements.REPLICATE/PARTIAL: {c['local_constants']}"
    assert not c["virtual"], f"use schedules.virtual_stages_for: {c['virtual']}"


def test_records_hold_plain_strings_that_torch_load_reads(tmp_path):
    """A plan made in code (members as defaults and arguments) holds the plain strings a
    plan read from a file holds: torch.load(weights_only=True) refuses meshplan's enum
    classes, so a worker's result or a checkpoint carrying plan.engine would not load
    (test_context_parallel's workers failed so before this)."""
    import torch

    from meshplan.plan import Plan, Stage, TrainingConfig

    t = TrainingConfig(global_batch=8, seq_len=4, schedule=Schedule.INTERLEAVED,
                       dtype=ComputeDtype.BF16)
    st = Stage(index=0, devices=(0,), mesh_shape=(1,), axis_names=("dp",), layers=(0, 1),
               nodes=("a", "b"), recompute=Recompute.FULL)
    values = {"dtype": t.dtype, "schedule": t.schedule, "recompute": st.recompute,
              "default_dtype": TrainingConfig(global_batch=1, seq_len=1).dtype,
              "default_recompute": Stage(index=0, devices=(0,), mesh_shape=(1,),
                                         axis_names=("dp",), layers=(0, 1),
                                         nodes=("a", "b")).recompute}
    assert all(type(v) is str for v in values.values()), values
    assert "engine" in Plan.__dataclass_fields__
    torch.save(values, tmp_path / "v.pt")
    assert torch.load(tmp_path / "v.pt", weights_only=True) == values


def test_token_file_names_its_own_dtypes(tmp_path):
    # runtime/data's token-file types are TOKEN_DTYPES (DTYPES names the compute dtypes);
    # the refusal of another width names them (a NameError before its f-string was renamed)
    from meshplan.errors import SpecError
    from meshplan.runtime.data import TokenFile

    with pytest.raises(SpecError, match="--data-dtype 'int8' is not one of uint16, uint32"):
        TokenFile(str(tmp_path / "t.bin"), "int8")
