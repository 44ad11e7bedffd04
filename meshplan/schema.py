"""JSON Schema checks of the files meshplan reads (plans: ``plan.schema.json``; hardware
profiles: ``costmodel/hardware.schema.json``), by the ``jsonschema`` library (draft 2020-12),
each problem as one line that names the field, the rule and the value.

core: imported by ``meshplan.plan`` and ``costmodel.hardware``.
"""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator, validators

# draft 2020-12 counts a float with a zero fraction (8.0) as an integer; meshplan's files never
# did: a count or mesh size read as 8.0 would reach range() and torch as a float
_Validator = validators.extend(Draft202012Validator, type_checker=(
    Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))))


def validate_schema(value, schema: dict) -> list[str]:
    """The problems of ``value`` against ``schema``, ordered by their path, each once (one
    ``required`` error per missing field names them all: ``_lines``); empty: valid."""
    errors = _Validator(schema).iter_errors(value)
    lines = [line for e in sorted(errors, key=_path_key)
             for line in _lines(e)]
    return list(dict.fromkeys(lines))


def _path_key(e) -> list:
    """Sort key of an error's path: array indices as numbers (item 2 before item 10)."""
    return [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in e.absolute_path]


def _lines(e) -> list[str]:
    path, value, rule = e.json_path, e.instance, e.validator_value
    if e.validator == "type":
        types = rule if isinstance(rule, list) else [rule]
        return [f"{path} should be {' or '.join(types)}, got {json.dumps(value)[:40]}"]
    if e.validator == "enum":
        return [f"{path} is {value!r}; expected one of {rule}"]
    if e.validator == "pattern":
        return [f"{path} is {value!r}, which does not match {rule}"]
    if e.validator == "minimum":
        return [f"{path} is {value}, below the minimum {rule}"]
    if e.validator == "required":
        return [f"{path} is missing required field {key!r}" for key in rule if key not in value]
    if e.validator == "additionalProperties" and rule is False:
        known = e.schema.get("properties", {})
        return [f"{path} has unknown field {key!r}" for key in value if key not in known]
    return [f"{path}: {e.message}"]
