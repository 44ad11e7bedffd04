"""JSON Schema checks of the files meshplan reads (plans: ``plan.schema.json``; hardware
profiles: ``costmodel/hardware.schema.json``), by the ``jsonschema`` library (draft 2020-12),
each problem as one line that names the field, the rule and the value.

core: imported by ``meshplan.plan`` and ``costmodel.hardware``.
"""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator


def validate_schema(value, schema: dict) -> list[str]:
    """The problems of ``value`` against ``schema``, in document order (empty: valid)."""
    errors = Draft202012Validator(schema).iter_errors(value)
    return [line for e in sorted(errors, key=lambda e: [str(p) for p in e.absolute_path])
            for line in _lines(e)]


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
