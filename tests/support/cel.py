"""Run a rendered ValidatingAdmissionPolicy's CEL on an admission request, in-process (cel-python).

Only for unit tests of what a policy lets through and refuses; the API server's own evaluation is the
e2e tests' (tests/e2e/test_tenant_admission.py). cel-python has CEL's standard library; the few
Kubernetes string and list extensions our policies call (`substring`, `join`) and comparisons with
null are added here with the Kubernetes semantics. Every matchCondition, variable, validation and
message is evaluated as the API server does: matchConditions all true, else the policy does not
apply; variables in order; a validation that is false (or fails to evaluate: failurePolicy Fail)
denies, with its message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy import celtypes
from celpy import evaluation as celeval
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError


def _substring(s: Any, start: Any, end: Any = None) -> Any:
    text = str(s)
    a, b = int(start), len(text) if end is None else int(end)
    if not 0 <= a <= b <= len(text):
        raise ValueError(f"substring({a}, {b}) out of range for {text!r}")
    return celtypes.StringType(text[a:b])


def _join(items: Any, sep: Any = "") -> Any:
    return celtypes.StringType(str(sep).join(str(i) for i in items))


def _eq(a: Any, b: Any) -> Any:
    # Kubernetes compares an object with null (`oldObject != null` on CREATE); cel-python has no overload
    if a is None or b is None:
        return celtypes.BoolType(a is None and b is None)
    return celeval.bool_eq(a, b)


def _ne(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return celtypes.BoolType(not (a is None and b is None))
    return celeval.bool_ne(a, b)


_AUTHORIZER = re.compile(r"authorizer(?:\.\w+\([^()]*\))+")
FUNCTIONS = {"substring": _substring, "join": _join, "_==_": _eq, "_!=_": _ne}


@dataclass(frozen=True)
class Decision:
    applies: bool
    denied: tuple[str, ...] = field(default_factory=tuple)  # the messages of the validations that failed

    @property
    def allowed(self) -> bool:
        return not self.denied


def _eval(env: Any, expression: str, activation: Mapping[str, Any]) -> Any:
    program = env.program(env.compile(expression), functions=FUNCTIONS)
    result = program.evaluate(dict(activation))
    if isinstance(result, CELEvalError):
        raise result
    return result


def admit(
    policy: Mapping[str, Any],
    *,
    operation: str,
    name: str,
    namespace: str,
    username: str,
    extra: Mapping[str, list[str]] | None = None,
    obj: Mapping[str, Any] | None = None,
    old: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    authorized: bool | None = None,
) -> Decision:
    """`params`: the param object (paramKind) of this evaluation; `authorized`: what every authorizer
    check answers (the chain ``authorizer.group(..)...allowed()`` is replaced by it; None leaves it)."""
    env = celpy.Environment()
    if authorized is not None:
        answer = "true" if authorized else "false"
        policy = json.loads(_AUTHORIZER.sub(answer, json.dumps(policy)))
    request: dict[str, Any] = {
        "operation": operation,
        "name": name,
        "namespace": namespace,
        "userInfo": {"username": username, **({"extra": dict(extra)} if extra is not None else {})},
    }
    base = {
        "request": json_to_cel(request),
        "object": json_to_cel(dict(obj) if obj is not None else None),
        "oldObject": json_to_cel(dict(old) if old is not None else None),
        "params": json_to_cel(dict(params) if params is not None else None),
    }
    spec = policy["spec"]
    for cond in spec.get("matchConditions", []):
        if not bool(_eval(env, cond["expression"], base)):
            return Decision(applies=False)
    variables: dict[str, Any] = {}
    for var in spec.get("variables", []):
        try:
            variables[var["name"]] = _eval(env, var["expression"], {**base, "variables": celtypes.MapType(variables)})
        except CELEvalError as e:
            raise AssertionError(f"variable {var['name']} failed: {e}") from e
    activation = {**base, "variables": celtypes.MapType(variables)}
    denied = []
    for v in spec["validations"]:
        try:
            ok = bool(_eval(env, v["expression"], activation))
        except CELEvalError as e:
            denied.append(f"evaluation failed: {e}")
            continue
        if not ok:
            try:
                denied.append(str(_eval(env, v["messageExpression"], activation)))
            except CELEvalError as e:
                denied.append(f"message failed to evaluate: {e}")
    return Decision(applies=True, denied=tuple(denied))
