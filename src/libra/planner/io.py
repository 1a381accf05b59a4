"""Plans on disk: plain JSON with a schema version. Loading validates every field and never runs code."""

from __future__ import annotations

import json
import math
from pathlib import Path

from libra.errors import PlanFormatError
from libra.planner.types import PLAN_SCHEMA_VERSION, Decision, Plan, RegionPlan
from libra.planner.regions import GRANULARITIES

__all__ = ["save_plan", "load_plan", "plan_to_dict", "plan_from_dict"]

_PLAN_FIELDS = {
    "schema_version": int,
    "budget_bytes": int,
    "predicted_peak_bytes": int,
    "predicted_step_seconds": float,
    "eager_peak_bytes": int,
    "eager_step_seconds": float,
    "static_bytes": int,
    "device": str,
    "solver": str,
    "decisions": dict,
    "regions": list,
    "parameters": list,
    "peak_op": int,
    "peak_description": str,
    "planner_seconds": float,
    "input_signature": list,
    "refused": list,
    "allowed": list,
    "host_bandwidth": float,
    "provenance": dict,
    "granularity": str,
    "unprofiled": list,
}
# added after schema 1 was first written; absent means "not recorded"
_OPTIONAL = {"input_signature", "skip", "plain", "hooked", "stay", "offload_inputs", "refused", "plain_ok", "allowed",
             "host_bandwidth", "provenance", "prefetch_after", "granularity", "unprofiled"}
_REGION_FIELDS = {"module": str, "call": int, "ops": list, "save": list, "offload": list, "protect": dict,
                  "input_shapes": list, "skip": list, "plain": bool, "hooked": bool, "stay": list,
                  "offload_inputs": bool, "plain_ok": bool, "prefetch_after": list}
_NON_NEGATIVE = {"budget_bytes", "predicted_peak_bytes", "eager_peak_bytes", "static_bytes", "predicted_step_seconds",
                 "eager_step_seconds", "planner_seconds", "host_bandwidth"}


def plan_to_dict(plan: Plan) -> dict:
    return {
        "schema_version": plan.schema_version,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_seconds": plan.predicted_step_seconds,
        "eager_peak_bytes": plan.eager_peak_bytes,
        "eager_step_seconds": plan.eager_step_seconds,
        "static_bytes": plan.static_bytes,
        "device": plan.device,
        "solver": plan.solver,
        "decisions": {k: d.value for k, d in plan.decisions.items()},
        "regions": [
            {
                "module": r.module,
                "call": r.call,
                "ops": list(r.ops),
                "save": list(r.save),
                "offload": list(r.offload),
                "protect": {str(k): list(v) for k, v in r.protect.items()},
                "input_shapes": [list(s) for s in r.input_shapes],
                "skip": list(r.skip),
                "plain": r.plain,
                "hooked": r.hooked,
                "stay": list(r.stay),
                "offload_inputs": r.offload_inputs,
                "plain_ok": r.plain_ok,
                "prefetch_after": list(r.prefetch_after),
            }
            for r in plan.regions
        ],
        "parameters": [[name, list(shape), dtype] for name, shape, dtype in plan.parameters],
        "peak_op": plan.peak_op,
        "peak_description": plan.peak_description,
        "planner_seconds": plan.planner_seconds,
        "input_signature": list(plan.input_signature),
        "refused": [[m, c, r] for m, c, r in plan.refused],
        "allowed": list(plan.allowed),
        "host_bandwidth": plan.host_bandwidth,
        "provenance": dict(plan.provenance),
        "granularity": plan.granularity,
        **({} if plan.unprofiled is None else {"unprofiled": list(plan.unprofiled)}),
    }


def save_plan(plan: Plan, path) -> None:
    Path(path).write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")


def _fail(path, what: str) -> PlanFormatError:
    return PlanFormatError(
        f"libra.Plan.load: {path} is not a valid Libra plan: {what}. "
        "Fix: make a new plan with libra.plan(profile, budget) and save it with plan.save(path); do not edit it."
    )


def _check_fields(data, fields: dict, where: str, path) -> None:
    if not isinstance(data, dict):
        raise _fail(path, f"{where} should be a JSON object, found {type(data).__name__}")
    unknown = sorted(set(data) - set(fields))
    missing = sorted(set(fields) - set(data) - _OPTIONAL)
    if unknown:
        raise _fail(path, f"{where} has unknown field(s) {', '.join(unknown)}")
    if missing:
        raise _fail(path, f"{where} lacks field(s) {', '.join(missing)}")
    for name, kind in fields.items():
        if name not in data:
            continue
        value = data[name]
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            raise _fail(path, f"{where}.{name} should be {kind.__name__}, found {value!r}")
        if kind is float and not math.isfinite(value):
            raise _fail(path, f"{where}.{name} should be finite, found {value!r}")
        if name in _NON_NEGATIVE and value < 0:
            raise _fail(path, f"{where}.{name} should not be negative, found {value!r}")


def _int_list(value, where: str, path) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise _fail(path, f"{where} should be a list of non-negative ints, found {value!r}")
    return list(value)


def plan_from_dict(data: dict, path="<dict>") -> Plan:
    if isinstance(data, dict) and data.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise _fail(path, f"schema_version is {data.get('schema_version')!r}, this Libra reads {PLAN_SCHEMA_VERSION}")
    _check_fields(data, _PLAN_FIELDS, "plan", path)
    decisions = {}
    for key, value in data["decisions"].items():
        try:
            decisions[key] = Decision(value)
        except ValueError:
            raise _fail(path, f"decision {key!r} is {value!r}, expected one of keep, recompute, offload") from None
    regions = []
    for i, r in enumerate(data["regions"]):
        where = f"regions[{i}]"
        _check_fields(r, _REGION_FIELDS, where, path)
        if r["call"] < 0 or not all(isinstance(o, str) for o in r["ops"]):
            raise _fail(path, f"{where} has a negative call or non-string op names")
        save = _int_list(r["save"], f"{where}.save", path)
        if any(j >= len(r["ops"]) for j in save):
            raise _fail(path, f"{where}.save names an op beyond the region's {len(r['ops'])} ops")
        offload = _int_list(r["offload"], f"{where}.offload", path)
        if not set(offload) <= set(save):
            raise _fail(path, f"{where}.offload names ops that are not in save")
        protect = {}
        for k, names in r["protect"].items():
            if not k.isdigit() or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise _fail(path, f"{where}.protect has an invalid entry {k!r}: {names!r}")
            protect[int(k)] = list(names)
        shapes = [_int_list(s, f"{where}.input_shapes", path) for s in r["input_shapes"]]
        skip = _int_list(r.get("skip", []), f"{where}.skip", path)
        if any(j >= len(r["ops"]) for j in skip) or set(skip) & set(save):
            raise _fail(path, f"{where}.skip names an op beyond the region's ops or one it saves")
        plain = r.get("plain", False)
        if plain and (save or offload or skip):
            raise _fail(path, f"{where} is plain (recomputes everything) but saves, offloads or skips ops")
        hooked = r.get("hooked", False)
        if hooked and (plain or save or offload or skip or protect):
            raise _fail(path, f"{where} is hooked (offloads everything it saves) but is also plain, or saves, "
                              "offloads, skips or protects ops")
        stay = _int_list(r.get("stay", []), f"{where}.stay", path)
        offload_inputs = r.get("offload_inputs", False)
        if (stay or offload_inputs) and not hooked:
            raise _fail(path, f"{where} keeps saves on the device (stay) or offloads its inputs but is not hooked")
        after = r.get("prefetch_after", [])
        if after and not (len(after) == 2 and isinstance(after[0], str) and isinstance(after[1], int)
                          and not isinstance(after[1], bool) and after[1] >= 0 and (offload or hooked)):
            raise _fail(path, f"{where}.prefetch_after should be [module, call] of a region that offloads, "
                              f"found {after!r}")
        regions.append(RegionPlan(module=r["module"], call=r["call"], ops=list(r["ops"]), save=save,
                                  offload=offload, protect=protect, input_shapes=shapes, skip=skip, plain=plain,
                                  hooked=hooked, stay=stay, offload_inputs=offload_inputs,
                                  plain_ok=r.get("plain_ok", False), prefetch_after=list(after)))
    parameters = []
    for entry in data["parameters"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[2], str)):
            raise _fail(path, f"parameters has an invalid entry {entry!r}")
        parameters.append((entry[0], _int_list(entry[1], "parameters shape", path), entry[2]))
    signature = data.get("input_signature", [])
    if not all(isinstance(x, str) for x in signature):
        raise _fail(path, f"input_signature should be a list of strings, found {signature!r}")
    refused = data.get("refused", [])
    if not all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and isinstance(x[1], int)
               and isinstance(x[2], str) for x in refused):
        raise _fail(path, f"refused should be a list of [module, call, reason], found {refused!r}")
    allowed = data.get("allowed", [])
    if not all(x in ("keep", "recompute", "offload") for x in allowed):
        raise _fail(path, f"allowed should list decisions (keep, recompute, offload), found {allowed!r}")
    provenance = data.get("provenance", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in provenance.items()):
        raise _fail(path, f"provenance should map strings to strings, found {provenance!r}")
    if data.get("granularity", "") not in ("", *GRANULARITIES):
        raise _fail(path, f"granularity should be one of {', '.join(GRANULARITIES)}, found {data['granularity']!r}")
    unprofiled = data.get("unprofiled")
    if unprofiled is not None and not all(isinstance(x, str) for x in unprofiled):
        raise _fail(path, f"unprofiled should be a list of module names, found {unprofiled!r}")
    skip = ("decisions", "regions", "parameters", "input_signature", "refused", "allowed", "provenance",
            "unprofiled")
    fields = {k: data[k] for k in _PLAN_FIELDS if k not in skip and k in data}
    fields["input_signature"] = list(signature)
    fields["refused"] = [list(x) for x in refused]
    fields["allowed"] = list(allowed)
    fields["provenance"] = dict(provenance)
    fields["unprofiled"] = None if unprofiled is None else list(unprofiled)
    return Plan(decisions=decisions, regions=regions, parameters=parameters, **fields)


def load_plan(path) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanFormatError(f"libra.Plan.load: cannot read {path}: {e.strerror}. Fix: check the path.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"it is not JSON ({e.msg} at line {e.lineno}); it may be truncated") from None
    return plan_from_dict(data, path)
